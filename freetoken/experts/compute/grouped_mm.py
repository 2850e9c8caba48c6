"""A streamed prefill layer's experts through torch's grouped GEMM (torch._grouped_mm: CUTLASS
on sm90 and later): grouped_experts.run_stacked takes it wherever chosen() says so, and its
Triton kernels everywhere else (fp32, other activations, biases, older GPUs). On the H200 host
an 8K-token streamed forward of the Qwen3-30B-A3B shape took 1.6-2.4x less with it for the
quantized types and the same for bf16, which is bound by the link
(docs/MEASUREMENTS.md#grouped-prefill-experts, where the switch that compared them is buried).

  bf16 weights  the stacks' [G, I, D] / [G, D, I] views go in as they lie in the layer buffer
                (each expert one stride apart; their transposes are the column-major operands
                the GEMM takes), no copy
  quantized     each projection of the call's experts decoded once into a bf16 scratch
                (_dequant: quant_blocks.tile_t's values times their scale, in fp32, rounded to
                bf16), then the same GEMMs. mxfp4's weights are exact in bf16; q8_0, q4_0 and
                fp8_e4m3 ones are rounded to bf16 here, where the Triton kernels scale each
                block's exact partial sum in fp32

  gate, up  g = x[tok] gate^T, u = x[tok] up^T per group (bf16 out, as F.linear's)
  h         F.silu(g) * u (bf16, rounded as torch's per-expert path rounds it)
  down      y = (h down^T) in bf16, times w_flat[rid] in fp32: grouped_experts._down's rounding

Only x in bf16 on cuda (sm90+), SiLU, no biases: every other call keeps the Triton kernels.

Shape legend: R' routes of the call (grouped order), G experts of the call, D hidden, I expert
hidden.
"""
import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
else:
    from .quant_blocks import tile_t

BN_DEQUANT = 64  # weight rows per program of _dequant


def chosen(x: torch.Tensor, stacks, act, quant=None) -> bool:
    """Whether run_stacked takes the grouped GEMM for x and stacks (non-None ExpertWeights of
    [E, ...] views): torch has it, x bf16 on a cuda device of compute capability 9 or more,
    SiLU, gate / up / down alone (no biases), every operand 16-byte aligned as the GEMM wants
    (bf16 stacks: their starts and strides; quantized: D and I multiples of 8 for the
    scratch)."""
    if not (hasattr(torch, "_grouped_mm") and x.is_cuda
            and x.dtype == torch.bfloat16 and act.name == "silu" and len(stacks) == 3
            and x.shape[1] % 8 == 0 and torch.cuda.get_device_capability(x.device) >= (9, 0)):
        return False
    if quant is not None:
        return quant.I % 8 == 0 and quant.D % 8 == 0
    return all(w.dtype == torch.bfloat16 and w.stride(2) == 1 and w.data_ptr() % 16 == 0
               and w.stride(0) % 8 == 0 and w.stride(1) % 8 == 0 for w in stacks)


def run(x, tok, rid, w_flat, stacks, first: int, counts_d, quant=None) -> torch.Tensor:
    """fp32 [R', D]: row r = w_flat[rid[r]] * expert(x[tok[r]]) for the routes of experts
    first .. first + G - 1 of stacks (gate, up, down: [E, I, D], [E, I, D], [E, D, I] views, or
    with quant [E, nbytes] uint8 projections), counts_d [G] routes each, back to back."""
    G = counts_d.shape[0]
    if quant is None:
        gate, up, down = (w[first:first + G] for w in stacks)
    else:
        gate, up = (dequantized(w, first, G, quant.I, quant.D, quant.gate_scales, quant) for w in stacks[:2])
        down = dequantized(stacks[2], first, G, quant.D, quant.I, quant.down_scales, quant)
    return grouped_ffn(x.index_select(0, tok), gate, up, down, counts_d, w_flat[rid])


def grouped_ffn(xs, gate, up, down, counts, weights) -> torch.Tensor:
    """fp32 [R', D]: weights[r] * down_g(silu(gate_g xs[r]) * up_g xs[r]) for the rows of group
    g (counts [G] rows each, back to back); gate, up [G, I, D], down [G, D, I] with unit stride
    along their last axis (the column-major operands of the GEMM are their transposes)."""
    offs = torch.cumsum(counts, 0).to(torch.int32)
    g = torch._grouped_mm(xs, gate.transpose(1, 2), offs=offs)
    u = torch._grouped_mm(xs, up.transpose(1, 2), offs=offs)
    y = torch._grouped_mm(F.silu(g) * u, down.transpose(1, 2), offs=offs)
    return y.float() * weights.float()[:, None]


def dequantized(stack: torch.Tensor, first: int, G: int, rows: int, cols: int, scale_off: int,
                quant) -> torch.Tensor:
    """bf16 [G, rows, cols]: projections first .. first + G - 1 of a quantized stack ([E,
    nbytes] uint8 views, one stride apart; each projection's blocks, then its scales at
    scale_off bytes), decoded by _dequant."""
    storage = stack.untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8, device=stack.device)
    whole.set_(storage, 0, (storage.nbytes(),))
    base = stack.data_ptr() - storage.data_ptr() + first * stack.stride(0)  # bytes
    out = torch.empty(G, rows, cols, dtype=torch.bfloat16, device=stack.device)
    _dequant[(G, triton.cdiv(rows, BN_DEQUANT))](
        whole, quant.scale_view(whole), out, base, stack.stride(0), scale_off, rows, cols,
        SS=quant.scale_size, QUANT=quant.code, BN=BN_DEQUANT)
    return out


if triton is not None:
    @triton.jit
    def _dequant(w_ptr, s_ptr, out_ptr, base, stride, scale_off, n_rows, n_cols,
                 SS: tl.constexpr, QUANT: tl.constexpr, BN: tl.constexpr):
        """Rows [BN] of projection program_id(0): every 32-block's values times its scale, in
        fp32, stored as bf16 (out [G, n_rows, n_cols])."""
        e = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BN + tl.arange(0, BN)
        row_ok = rows < n_rows
        at = base + e * stride  # this projection's first byte in w_ptr
        qs = w_ptr + at
        sc = s_ptr + (at + scale_off) // SS
        dst = out_ptr + e * n_rows * n_cols
        for k0 in range(0, n_cols, 32):
            v, s = tile_t(qs, sc, rows, row_ok, k0, n_cols, QUANT)  # [32, BN], [BN]
            k = k0 + tl.arange(0, 32)
            tl.store(dst + rows[None, :] * n_cols + k[:, None], (v * s[None, :]).to(tl.bfloat16, fp_downcast_rounding="rtne"),
                     mask=row_ok[None, :] & (k < n_cols)[:, None])
