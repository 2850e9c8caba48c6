"""One token's linear layers on cuda (Triton): y = x W^T (+ b) for a single row x, where cuBLAS's
matrix kernels leave most of the device's read rate unused (the runs:
docs/MEASUREMENTS.md#decode-step-kernels). layers.Linear and the attention's fused q/k/v use it when
chosen(x, weight) holds; more rows (prefill) and the cpu keep F.linear (the tests' reference).

  gemv  grid (N / BN,):  each program BN rows of W, K in blocks of BK: fp32 products summed per
                         lane, the lanes at the end, + b in fp32, rounded once to x's dtype

The sum runs in another order than cuBLAS's, so a result may differ from F.linear's in the last
bit of its rounding (fp32) or by one rounding step (bf16).

Shape legend: N output features, K input features.
"""
import torch
import torch.nn.functional as F

from . import fused

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: F.linear everywhere
    triton = None

if triton is not None:
    @triton.jit
    def _gemv(x_ptr, w_ptr, b_ptr, y_ptr, N, w_stride, K: tl.constexpr, HAS_BIAS: tl.constexpr,
              BN: tl.constexpr, BK: tl.constexpr):
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        row_ok = rows < N
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            k_ok = ks < K
            xv = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            wv = tl.load(w_ptr + rows[:, None].to(tl.int64) * w_stride + ks[None, :],
                         mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc += wv.to(tl.float32) * xv[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def chosen(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether linear() takes the kernel for x: one row on cuda (fused.enabled), weights of x's
    dtype with unit stride along K."""
    return (fused.enabled(x) and x.numel() == x.shape[-1] and weight.dtype == x.dtype
            and weight.stride(-1) == 1)


def _blocks(N: int, K: int):
    """(BN, BK, warps): the H200 sweep's best for K >= 4096 (one row, 8 warps) and below it (two
    rows, 4 warps), both with K blocks of 1024 (docs/MEASUREMENTS.md#decode-step-kernels)."""
    bk = min(1024, triton.next_power_of_2(K))
    return (1, bk, 8) if K >= 4096 else (2, bk, 4)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """x [..., K] holding one row, weight [N, K] (unit stride along K), bias [N] or None ->
    [..., N] in x's dtype: F.linear(x, weight, bias) in one kernel. Nothing the host waits on,
    so a CUDA graph can capture it."""
    N, K = weight.shape
    y = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    bn, bk, warps = _blocks(N, K)
    xr = x.reshape(K).contiguous()
    _gemv[(triton.cdiv(N, bn),)](xr, weight, weight if bias is None else bias, y, N,
                                 weight.stride(0), K=K, HAS_BIAS=bias is not None, BN=bn, BK=bk,
                                 num_warps=warps)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """F.linear(x, weight, bias), by gemv where chosen(x, weight) holds."""
    if chosen(x, weight):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)
