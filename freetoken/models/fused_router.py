"""The MoE router in one kernel on cuda (Triton): softmax -> top-k -> renormalise, what
moe.softmax_topk's torch code does (moe.py picks it when fused.enabled holds).

  softmax_topk grid (T,):        p = softmax(logits.float()); K times: the largest p, the lowest
                                 expert id on ties; [w / sum(w)]

The router does the softmax with the operations torch's cuda softmax uses: libdevice's expf and
a correctly rounded division (div_rn), not Triton's approximate exp and `/`. The sum of the
exponentials and the renormalising sum are added in another order, so they may differ in the
last fp32 bits: a weight moves by about 1e-7 relative, an id only where two probabilities are
that close. Probabilities below fp32's normal range (< 1.2e-38) come out 0 (Triton links
libdevice flushing denormals), where torch keeps the denormal.

Shape legend: T tokens, E experts, K experts per token.
"""
import torch

from ..config import triton_interpreted
from . import fused

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs: moe.py keeps its torch code
    triton = None

if triton is not None:
    @triton.jit
    def _softmax_topk(x_ptr, ids_ptr, w_ptr, x_stride, E: tl.constexpr, K: tl.constexpr,
                      BLOCK: tl.constexpr, KBLOCK: tl.constexpr,
                      RENORM: tl.constexpr, LIBDEVICE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < E
        x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=float("-inf")).to(tl.float32)
        if LIBDEVICE:  # expf as torch's kernel has it (tl.exp is ex2.approx on nvidia)
            e = libdevice.exp(x - tl.max(x, axis=0))
        else:  # the interpreter has no libdevice; its tl.exp is numpy's
            e = tl.exp(x - tl.max(x, axis=0))
        p = tl.math.div_rn(e, tl.sum(e, axis=0))  # [BLOCK], 0 past E
        # One int64 key per expert: p's bits above (p >= 0 orders as its bits; the sign bit is
        # cleared so a NaN sorts above all, as in torch.topk), BLOCK-1-id below (the lower id
        # wins a tie); -1 for lanes past E and for experts already taken.
        bits = p.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        key = tl.where(ok, (bits.to(tl.int64) << 32) | (BLOCK - 1 - cols), -1)
        slots = tl.arange(0, KBLOCK)
        ids = tl.zeros([KBLOCK], dtype=tl.int64)
        ws = tl.zeros([KBLOCK], dtype=tl.float32)
        total = 0.0
        for i in range(K):
            best = tl.max(key, axis=0)
            key = tl.where(key == best, -1, key)
            w = (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
            ids = tl.where(slots == i, BLOCK - 1 - (best & 0xFFFFFFFF), ids)
            ws = tl.where(slots == i, w, ws)
            total += w
        if RENORM:
            ws = tl.math.div_rn(ws, tl.zeros([KBLOCK], dtype=tl.float32) + total)
        out = row * K + slots
        tl.store(ids_ptr + out, ids, mask=slots < K)
        tl.store(w_ptr + out, ws, mask=slots < K)


def softmax_topk(router_logits: torch.Tensor, k: int, renormalize: bool):
    """moe.softmax_topk in one kernel: router_logits [..., E] of a float dtype ->
    (expert_ids [..., K] int64, weights [..., K] fp32), the weights in descending order, ties to
    the lower expert id. Nothing the host waits on, so a CUDA graph can capture it."""
    E = router_logits.shape[-1]
    if not 0 <= k <= E:
        raise ValueError(f"softmax_topk: k={k} experts per token out of range for {E} experts")
    x = fused.rows(router_logits)
    T = x.shape[0]
    ids = torch.empty((T, k), dtype=torch.int64, device=router_logits.device)
    weights = torch.empty((T, k), dtype=torch.float32, device=router_logits.device)
    if T and k:
        block = triton.next_power_of_2(E)
        _softmax_topk[(T,)](x, ids, weights, x.stride(0), E=E, K=k, BLOCK=block,
                            KBLOCK=triton.next_power_of_2(k), RENORM=bool(renormalize),
                            LIBDEVICE=not triton_interpreted(),
                            num_warps=max(1, min(4, block // 512)), enable_fp_fusion=False)
    lead = router_logits.shape[:-1]
    return ids.view(*lead, k), weights.view(*lead, k)
