"""Device experts as two Triton kernels that read each route's slot in place (cuda): no gather
copy of the slots, and routes at weight 0 (the CPU's routes in a captured step, see
graph_step.py) read nothing. gathered.py calls run() when Triton imports and x is on cuda.

  gate_up   grid (R, I / BLOCK_I): h[r, i] = silu(gate[i] . x[t]) * (up[i] . x[t]), fp32
            (or the clamped SwiGLU of kernel_args.ExpertAct; + the gate/up biases of a biased bank)
  down      grid (R, D / BLOCK_O): y[r, o] = w[r] * (down[o] . h[r] (+ down bias[o])), fp32
  combine   out[t] = sum_k y[t*K + k] (torch)

Tried and removed: partial experts read zero-copy from the host bank, to split a lone miss
between the link and the CPU; the time hardly shrinks with the rows
(docs/MEASUREMENTS.md#row-split-of-a-cpu-expert).

Math in fp32 from the bank dtype (bf16 weights widened in registers). A quantized bank's
slots (quant_blocks.QuantSpec: q8_0, q4_0, mxfp4) are read as their blocks and scales, each
block decoded in registers and its partial dot scaled in fp32 (quant_blocks.row_dot): the
dequantized weights never exist in memory. fp8_e4m3 slots (any D, I) are read as the plain
path reads elements, each e4m3 byte decoded and times its tile's fp32 scale in registers
(quant_blocks.fp8_weights). K, D, I are compile-time constants: one compile per
expert shape and type (the first decode step of a run pays it).

Shape legend: T tokens, K routes per token, R = T*K routes (route r = t*K + k), D hidden,
I expert hidden.
"""
import torch

from ...kernel_args import SILU

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (CPU-only installs): gathered.py keeps its torch path
    triton = None
else:
    from .quant_blocks import fp8_weights, row_dot, x_pairs

# Blocks and warps, the best of tools/bench_device_experts.py's sweep on the H200: gate_up at
# 0.82 x the device's read rate, down at 0.73 (docs/MEASUREMENTS.md#device-expert-kernels)
BLOCK_I, BLOCK_D, WARPS_GATE_UP = 4, 512, 2  # gate_up: rows per program, columns per step
BLOCK_O, BLOCK_H, WARPS_DOWN = 32, 256, 4  # down: output rows per program, hidden columns per step
# quantized banks: 32-blocks per step (BLOCK_D / 32, BLOCK_H / 32); not swept yet
BLOCKS_GATE_UP, BLOCKS_DOWN = 16, 8


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _gate_up(x_ptr, w_ptr, s_ptr, slot_ptr, wt_ptr, h_ptr, slot_elems, s_slot, off_gate,
                 off_up, off_gs, off_us, off_gb, off_ub, alpha, limit, K: tl.constexpr,
                 D: tl.constexpr, I: tl.constexpr, BI: tl.constexpr, BD: tl.constexpr,
                 NB: tl.constexpr, QUANT: tl.constexpr, CLAMPED: tl.constexpr,
                 BIAS: tl.constexpr):
        r = tl.program_id(0)
        rows = tl.program_id(1) * BI + tl.arange(0, BI)
        live = tl.load(wt_ptr + r + rows * 0) != 0.0  # weight 0: masked loads, nothing read
        row_ok = (rows < I) & live
        slot = tl.load(slot_ptr + r).to(tl.int64)
        base = w_ptr + slot * slot_elems
        x_row = x_ptr + (r // K).to(tl.int64) * D
        acc_g = tl.zeros([BI], dtype=tl.float32)
        acc_u = tl.zeros([BI], dtype=tl.float32)
        if QUANT == 0:
            for d0 in range(0, D, BD):
                cols = d0 + tl.arange(0, BD)
                col_ok = cols < D
                xv = tl.load(x_row + cols, mask=col_ok, other=0.0).to(tl.float32)
                at = rows[:, None] * D + cols[None, :]
                ok = row_ok[:, None] & col_ok[None, :]
                g = tl.load(base + off_gate + at, mask=ok, other=0.0).to(tl.float32)
                u = tl.load(base + off_up + at, mask=ok, other=0.0).to(tl.float32)
                acc_g += tl.sum(g * xv[None, :], axis=1)
                acc_u += tl.sum(u * xv[None, :], axis=1)
        elif QUANT == 4:  # fp8_e4m3: bytes at base, fp32 tile scales at sbase
            sbase = s_ptr + slot * s_slot
            for d0 in range(0, D, BD):
                cols = d0 + tl.arange(0, BD)
                col_ok = cols < D
                xv = tl.load(x_row + cols, mask=col_ok, other=0.0).to(tl.float32)
                g = fp8_weights(base + off_gate, sbase + off_gs, rows, row_ok, cols, col_ok, D)
                u = fp8_weights(base + off_up, sbase + off_us, rows, row_ok, cols, col_ok, D)
                acc_g += tl.sum(g * xv[None, :], axis=1)
                acc_u += tl.sum(u * xv[None, :], axis=1)
        else:  # base: the slot's bytes; sbase: its scales (s_ptr's elements)
            sbase = s_ptr + slot * s_slot
            for b0 in range(0, D // 32, NB):
                blk = b0 + tl.arange(0, NB)
                blk_ok = blk < D // 32
                xa, xb = x_pairs(x_row, blk, blk_ok, QUANT)
                acc_g += row_dot(base + off_gate, sbase + off_gs, rows, row_ok, D, blk, blk_ok,
                                 xa, xb, QUANT)
                acc_u += row_dot(base + off_up, sbase + off_us, rows, row_ok, D, blk, blk_ok,
                                 xa, xb, QUANT)
        if BIAS:
            acc_g += tl.load(base + off_gb + rows, mask=row_ok, other=0.0).to(tl.float32)
            acc_u += tl.load(base + off_ub + rows, mask=row_ok, other=0.0).to(tl.float32)
        if CLAMPED:  # kernel_args.ExpertAct clamped_swiglu
            g = tl.minimum(acc_g, limit)
            u = tl.minimum(tl.maximum(acc_u, -limit), limit)
            h = g / (1.0 + tl.exp(-alpha * g)) * (u + 1.0)
        else:
            h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(h_ptr + r * I + rows, h, mask=rows < I)

    @triton.jit
    def _down(h_ptr, w_ptr, s_ptr, slot_ptr, wt_ptr, y_ptr, slot_elems, s_slot, off_down,
              off_ds, off_db, D: tl.constexpr, I: tl.constexpr, BO: tl.constexpr,
              BH: tl.constexpr, NB: tl.constexpr, QUANT: tl.constexpr, BIAS: tl.constexpr):
        r = tl.program_id(0)
        rows = tl.program_id(1) * BO + tl.arange(0, BO)
        wt = tl.load(wt_ptr + r + rows * 0)  # [BO], one value
        row_ok = (rows < D) & (wt != 0.0)
        slot = tl.load(slot_ptr + r).to(tl.int64)
        base = w_ptr + slot * slot_elems
        acc = tl.zeros([BO], dtype=tl.float32)
        if QUANT == 0:
            for i0 in range(0, I, BH):
                cols = i0 + tl.arange(0, BH)
                col_ok = cols < I
                hv = tl.load(h_ptr + r * I + cols, mask=col_ok, other=0.0)
                dw = tl.load(base + off_down + rows[:, None] * I + cols[None, :],
                             mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
                acc += tl.sum(dw * hv[None, :], axis=1)
        elif QUANT == 4:
            sbase = s_ptr + slot * s_slot
            for i0 in range(0, I, BH):
                cols = i0 + tl.arange(0, BH)
                col_ok = cols < I
                hv = tl.load(h_ptr + r * I + cols, mask=col_ok, other=0.0)
                dw = fp8_weights(base + off_down, sbase + off_ds, rows, row_ok, cols, col_ok, I)
                acc += tl.sum(dw * hv[None, :], axis=1)
        else:
            sbase = s_ptr + slot * s_slot
            for b0 in range(0, I // 32, NB):
                blk = b0 + tl.arange(0, NB)
                blk_ok = blk < I // 32
                ha, hb = x_pairs(h_ptr + r * I, blk, blk_ok, QUANT)
                acc += row_dot(base + off_down, sbase + off_ds, rows, row_ok, I, blk, blk_ok,
                               ha, hb, QUANT)
        if BIAS:
            acc += tl.load(base + off_db + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + r * D + rows, acc * wt, mask=rows < D)


def run(storage_typed: torch.Tensor, layout, x: torch.Tensor, slots: torch.Tensor,
        weights: torch.Tensor, summed: bool = True, act=SILU, quant=None) -> torch.Tensor:
    """storage_typed: the slot pool viewed as the bank dtype, [C, stride / itemsize];
    layout: (gate offset, up offset, down offset[, gate bias, up bias, down bias offsets]) in
    elements and (I, D); x [T, D]; slots [R] int64, weights [R] fp32; act: a
    kernel_args.ExpertAct -> fp32 [T, D], or with summed False each route's weighted output
    fp32 [R, D]. quant: a quant_blocks.QuantSpec for a quantized bank: storage_typed is then
    the uint8 pool [C, stride] and the offsets are bytes (no biases)."""
    offsets, (I, D) = layout
    off_gate, off_up, off_down = offsets[:3]
    bias = len(offsets) == 6
    off_gb, off_ub, off_db = offsets[3:] if bias else (0, 0, 0)
    clamped = act.name == "clamped_swiglu"
    assert clamped or act.name == "silu", act
    T = x.shape[0]
    R = slots.shape[0]
    x = x.contiguous()
    h = torch.empty((R, I), dtype=torch.float32, device=x.device)  # weight-0 rows: 0 (masked)
    y = torch.empty((R, D), dtype=torch.float32, device=x.device)
    slot_elems = storage_typed.stride(0)
    scales, s_slot, off_gs, off_us, off_ds, code = storage_typed, 0, 0, 0, 0, 0
    if quant is not None:
        assert storage_typed.dtype == torch.uint8 and not bias, "a quantized pool: bytes, no biases"
        scales = quant.scale_view(storage_typed)  # [C, stride / scale_size]
        s_slot, size, code = scales.stride(0), quant.scale_size, quant.code
        off_gs, off_us = ((off + quant.gate_scales) // size for off in (off_gate, off_up))
        off_ds = (off_down + quant.down_scales) // size
    _gate_up[(R, triton.cdiv(I, BLOCK_I))](x, storage_typed, scales, slots, weights, h,
                                           slot_elems, s_slot, off_gate, off_up, off_gs, off_us,
                                           off_gb, off_ub, float(act.alpha), float(act.limit),
                                           K=R // T, D=D, I=I, BI=BLOCK_I, BD=BLOCK_D,
                                           NB=BLOCKS_GATE_UP, QUANT=code, CLAMPED=clamped,
                                           BIAS=bias, num_warps=WARPS_GATE_UP)
    _down[(R, triton.cdiv(D, BLOCK_O))](h, storage_typed, scales, slots, weights, y, slot_elems,
                                        s_slot, off_down, off_ds, off_db, D=D, I=I, BO=BLOCK_O,
                                        BH=BLOCK_H, NB=BLOCKS_DOWN, QUANT=code, BIAS=bias,
                                        num_warps=WARPS_DOWN)
    return y.view(T, R // T, D).sum(dim=1) if summed else y
