"""Many tokens' experts as two grouped Triton matmuls (cuda): the routes of a prefill layer,
grouped by expert, through every expert at once instead of five torch ops per expert. Each
group is one expert's run of routes; its weights are read in place by element offsets into the
storage they share.

  run          runs of routes over any weights (cache slots: resident and slot-path prefill
               layers, ffn.run_expert_runs); the tables are built on the host, one copy
  run_stacked  a streamed layer buffer's experts (stacks, one stride each); the tables are
               built on the device: no host-to-device copy waits behind the layer copies
               (docs/MEASUREMENTS.md#grouped-prefill-experts)

  gate_up  grid (row tiles, I / BN): h[r] = silu(gate x[tok[r]]) * (up x[tok[r]]), x's dtype
           (or the clamped SwiGLU of kernel_args.ExpertAct; + the gate/up biases of a biased bank)
  down     grid (row tiles, D / BN): y[r] = w[rid[r]] * (down h[r] (+ down bias)), fp32
  combine  out.index_add_(0, tok, y) (torch, as the per-expert path does)

A row tile is up to BM consecutive routes of one group (tiles()). One
block shape and aligned arguments: one compile per dtype and expert shape (and quant type). Products
accumulate in fp32; the gate and up outputs, silu, their product and the down output are
rounded to x's dtype where torch's F.linear / F.silu / mul round them, so the result differs
from the per-expert path only by the order of each dot product's sum. fp32 multiplies in full
precision (no TF32), as torch's matmuls do by default.

Quantized weights (quant_blocks.QuantSpec: q8_0, q4_0, mxfp4; the runs' weights are then each
projection's bytes, uint8): the reduction steps one 32-block at a time (BK 32); each block's
values before its scale, exact in x's dtype, go through tl.dot with x, and the block's product
is scaled in fp32 (quant_blocks.tile_t): the weights are decoded in registers, never copied.

Shape legend: R' routes of the call (grouped order), G groups, D hidden, I expert hidden.
"""
import numpy as np
import torch

from ...config import triton_interpreted
from ...kernel_args import SILU
from . import grouped_mm

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: ffn.py keeps the per-expert path
    triton = None
else:
    from .quant_blocks import tile_t

# routes per tile, output columns per program, reduction step: one shape, not swept (one
# compile per dtype and expert shape: docs/MEASUREMENTS.md#grouped-prefill-experts)
BM, BN, BK = 64, 64, 64
WARPS, STAGES = 4, 3


def available() -> bool:
    return triton is not None


def chosen(x: torch.Tensor, runs, quant=None) -> bool:
    """Whether run_expert_runs takes the grouped kernels for x and runs [(ExpertWeights, n)]:
    x on cuda with Triton, every weight (and bias) of x's dtype
    with rows back to back (gate/up [I, D], down [D, I]), all in one storage (the slot pool);
    with quant (a QuantSpec), every weight a projection's bytes, uint8 [nbytes]."""
    return bool(runs) and _one_storage(x, [w for ws, _ in runs for w in ws if w is not None],
                                       quant)


def chosen_stacks(x: torch.Tensor, stacks, quant=None) -> bool:
    """chosen() for run_stacked's stacks (ExpertWeights of [E, ...] views)."""
    return _one_storage(x, [w[0] for w in stacks if w is not None], quant)


def _one_storage(x, weights, quant=None) -> bool:
    if not (x.is_cuda and triton is not None):
        return False
    storage = weights[0].untyped_storage().data_ptr()
    plain = _bytes if quant is not None else _plain
    return all(plain(w, x.dtype) and w.untyped_storage().data_ptr() == storage for w in weights)


def _plain(w: torch.Tensor, dtype) -> bool:
    if w.dim() == 1:  # a bias
        return w.dtype == dtype and w.stride(0) == 1
    return w.dtype == dtype and w.dim() == 2 and w.stride(1) == 1 and w.stride(0) == w.shape[1]


def _bytes(w: torch.Tensor, dtype) -> bool:
    """A quantized projection's bytes (uint8 [nbytes]), whatever x's dtype."""
    return w.dtype == torch.uint8 and w.dim() == 1 and w.stride(0) == 1


def tiles(counts: torch.Tensor, bm: int, n_tiles: int = None) -> tuple:
    """(tile_group [N], tile_row [N], group_end [G]) int64 on counts' device, for groups of
    counts [G] (int64) routes back to back: tile j covers rows tile_row[j] .. min(+bm,
    group_end[g]) of group g. n_tiles, their number, where the host knows it: then nothing
    syncs on a device. E.g. counts [3, 0, 5], bm 4 -> groups [0, 2, 2], rows [0, 3, 7], ends
    [3, 3, 8]."""
    per = torch.div(counts + (bm - 1), bm, rounding_mode="floor")  # tiles per group
    if n_tiles is None:
        n_tiles = int(per.sum())
    ends = torch.cumsum(counts, 0)
    group = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), per,
                                    output_size=n_tiles)
    first = torch.cumsum(per, 0) - per  # index of each group's first tile
    t = torch.arange(n_tiles, device=counts.device)
    return group, (ends - counts)[group] + (t - first[group]) * bm, ends


def run(x, tok, rid, w_flat, runs, act=SILU, quant=None) -> torch.Tensor:
    """fp32 [R', D]: row r = w_flat[rid[r]] * expert_g(x[tok[r]]) for the routes of runs
    [(ExpertWeights: gate [I, D], up [I, D], down [D, I] and the biases or None, n)] back to
    back (tok, rid [R'] int64 on x's device, grouped order); act a kernel_args.ExpertAct. The
    weights may lie anywhere in one storage on x's device (chosen()). quant: a QuantSpec, the
    weights then each projection's bytes (uint8 [nbytes])."""
    storage = runs[0][0][0].untyped_storage()  # every weight's (chosen)
    size = 1 if quant is not None else x.element_size()
    ptrs = np.array([[w.data_ptr() for w in ws if w is not None] for ws, _ in runs],
                    dtype=np.int64)  # [G, P]: P = 3, or 6 with the biases
    offs = (ptrs - storage.data_ptr()) // size  # [G, P] elements into it
    group, row, end = tiles(torch.tensor([n for _, n in runs]), BM)  # on the host
    tables = _to_device([offs.reshape(-1), group.numpy(), row.numpy(), end.numpy()], x.device)
    I = quant.I if quant is not None else runs[0][0][0].shape[0]
    return _launch(x, tok, rid, w_flat, storage, tables, I, act, ptrs.shape[1], quant)


def run_stacked(x, tok, rid, w_flat, stacks, first: int, counts_d, n_tiles: int,
                act=SILU, quant=None) -> torch.Tensor:
    """run() for experts first .. first + G - 1 of stacks (ExpertWeights of [E, ...] views:
    each expert at one stride, one storage, chosen_stacks) with counts_d [G] int64
    routes each on x's device (tok, rid: theirs back to back, grouped order); n_tiles (the
    host's sum of ceil(count / BM)) sizes the tables, which are built on the device so that
    nothing is copied from the host. quant: a QuantSpec, the stacks then [E, nbytes] uint8."""
    stacks = [w for w in stacks if w is not None]
    if grouped_mm.chosen(x, stacks, act, quant):  # torch's grouped GEMM instead (grouped_mm.py)
        return grouped_mm.run(x, tok, rid, w_flat, stacks, first, counts_d, quant)
    storage = stacks[0].untyped_storage()
    size = 1 if quant is not None else x.element_size()
    offs = torch.stack([torch.arange(first * w.stride(0), (first + len(counts_d)) * w.stride(0),
                                     w.stride(0), device=x.device)
                        + (w.data_ptr() - storage.data_ptr()) // size for w in stacks], 1)  # [G, P]
    tables = [offs.reshape(-1), *tiles(counts_d, BM, n_tiles)]
    I = quant.I if quant is not None else stacks[0].shape[1]
    return _launch(x, tok, rid, w_flat, storage, tables, I, act, len(stacks), quant)


def _launch(x, tok, rid, w_flat, storage, tables, I, act, P, quant=None) -> torch.Tensor:
    """Both kernels over the tables (offs [G * P]: P offsets per group, gate, up, down (+ the
    three biases when P is 6); group [N], row [N], end [G]; int64 on x's device) and weights in
    `storage` -> fp32 [R', D]. quant: a QuantSpec (offsets in bytes, P 3)."""
    clamped = act.name == "clamped_swiglu"
    assert clamped or act.name == "silu", act
    D, R = x.shape[1], tok.shape[0]
    dtype = x.dtype if quant is None else torch.uint8
    weights = torch.empty(0, dtype=dtype, device=x.device)
    weights.set_(storage, 0, (storage.nbytes() // weights.element_size(),))  # the whole storage
    scales, sg, sd, ss, code, bk = weights, 0, 0, 1, 0, BK
    if quant is not None:
        assert P == 3, "a quantized bank has no biases"
        scales, code, bk = quant.scale_view(weights), quant.code, 32
        sg, sd, ss = quant.gate_scales, quant.down_scales, quant.scale_size
    offs_d, group_d, row_d, end_d = tables
    N = group_d.shape[0]
    # fresh, aligned copies: Triton compiles a kernel per alignment of its pointer arguments,
    # and slices of the routes start anywhere
    tok, rid = tok.clone(), rid.clone()
    ieee = "ieee" if x.dtype == torch.float32 else None  # fp32 without TF32, as torch
    # Triton's interpreter (3.5) misreads 16-bit operands of tl.dot: widen them first there
    # (exact: a product of two bf16 or fp16 values fits fp32; the sum is fp32 either way)
    widen = triton_interpreted() and x.dtype != torch.float32
    h = torch.empty(R, I, dtype=x.dtype, device=x.device)
    _gate_up[(N, triton.cdiv(I, BN))](x, tok, weights, scales, offs_d, group_d, row_d, end_d, h,
                                      D, I, sg, float(act.alpha), float(act.limit), BM=BM, BN=BN,
                                      BK=bk, PRECISION=ieee, WIDEN=widen, P=P, CLAMPED=clamped,
                                      QUANT=code, SS=ss, num_warps=WARPS, num_stages=STAGES)
    y = torch.empty(R, D, dtype=torch.float32, device=x.device)
    _down[(N, triton.cdiv(D, BN))](h, rid, w_flat, weights, scales, offs_d, group_d, row_d, end_d,
                                   y, D, I, sd, BM=BM, BN=BN, BK=bk, PRECISION=ieee, WIDEN=widen,
                                   P=P, QUANT=code, SS=ss, num_warps=WARPS, num_stages=STAGES)
    return y


def _to_device(parts, device) -> list:
    """int64 device tensors of the host arrays, by one copy; each starts 16-byte aligned."""
    lens = [len(p) for p in parts]
    spans = [(n + 1) // 2 * 2 for n in lens]  # int64 pairs: 16 bytes
    host = np.zeros(sum(spans), dtype=np.int64)
    starts = np.cumsum([0] + spans[:-1])
    for p, a in zip(parts, starts):
        host[a:a + len(p)] = p
    t = torch.from_numpy(host)
    dev = (t.pin_memory() if str(device).startswith("cuda") else t).to(device, non_blocking=True)
    return [dev[a:a + n] for a, n in zip(starts, lens)]


if triton is not None:
    @triton.jit
    def _tile(group_ptr, row_ptr, end_ptr, n_cols, BM: tl.constexpr, BN: tl.constexpr):
        """This program's (group, its rows [BM], rows in the group, columns [BN], in range)."""
        t = tl.program_id(0)
        g = tl.load(group_ptr + t)
        rows = tl.load(row_ptr + t) + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        return g, rows, rows < tl.load(end_ptr + g), cols, cols < n_cols

    @triton.jit
    def _gate_up(x_ptr, tok_ptr, w_ptr, s_ptr, offs_ptr, group_ptr, row_ptr, end_ptr, h_ptr, D,
                 I, SG, alpha, limit, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 PRECISION: tl.constexpr, WIDEN: tl.constexpr, P: tl.constexpr,
                 CLAMPED: tl.constexpr, QUANT: tl.constexpr, SS: tl.constexpr):
        g, rows, row_ok, cols, col_ok = _tile(group_ptr, row_ptr, end_ptr, I, BM, BN)
        toks = tl.load(tok_ptr + rows, mask=row_ok, other=0)
        off_g = tl.load(offs_ptr + g * P)
        off_u = tl.load(offs_ptr + g * P + 1)
        gate, up = w_ptr + off_g, w_ptr + off_u
        sc_g, sc_u = s_ptr + (off_g + SG) // SS, s_ptr + (off_u + SG) // SS  # quantized: scales
        dt = h_ptr.dtype.element_ty
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, D, BK):
            ks = k0 + tl.arange(0, BK)
            k_ok = ks < D
            xt = tl.load(x_ptr + toks[:, None] * D + ks[None, :],
                         mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
            if QUANT == 0:
                at = cols[None, :] * D + ks[:, None]  # [BK, BN]: weight row `col`, column k
                ok = col_ok[None, :] & k_ok[:, None]
                wg = tl.load(gate + at, mask=ok, other=0.0)
                wu = tl.load(up + at, mask=ok, other=0.0)
                if WIDEN:
                    xt, wg, wu = xt.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
                acc_g = tl.dot(xt, wg, acc_g, input_precision=PRECISION)
                acc_u = tl.dot(xt, wu, acc_u, input_precision=PRECISION)
            else:  # one 32-block: values [BK, BN] (exact in x's dtype), scales [BN]
                wg, dg = tile_t(gate, sc_g, cols, col_ok, k0, D, QUANT)
                wu, du = tile_t(up, sc_u, cols, col_ok, k0, D, QUANT)
                if WIDEN:
                    xt = xt.to(tl.float32)
                else:
                    wg, wu = wg.to(dt), wu.to(dt)
                acc_g += tl.dot(xt, wg, input_precision=PRECISION) * dg[None, :]
                acc_u += tl.dot(xt, wu, input_precision=PRECISION) * du[None, :]
        g_v = acc_g.to(dt).to(tl.float32)
        u_v = acc_u.to(dt).to(tl.float32)
        if P == 6:  # + the biases, rounded as F.linear's biased output
            gb = tl.load(w_ptr + tl.load(offs_ptr + g * P + 3) + cols, mask=col_ok, other=0.0)
            ub = tl.load(w_ptr + tl.load(offs_ptr + g * P + 4) + cols, mask=col_ok, other=0.0)
            g_v = (acc_g + gb.to(tl.float32)[None, :]).to(dt).to(tl.float32)
            u_v = (acc_u + ub.to(tl.float32)[None, :]).to(dt).to(tl.float32)
        if CLAMPED:  # kernel_args.ExpertAct clamped_swiglu, each op rounded as torch's
            gc = tl.minimum(g_v, limit)
            uc = tl.minimum(tl.maximum(u_v, -limit), limit)
            sig = (1.0 / (1.0 + tl.exp(-(gc * alpha).to(dt).to(tl.float32)))).to(dt).to(tl.float32)
            glu = (gc * sig).to(dt).to(tl.float32)
            h = glu * (uc + 1.0).to(dt).to(tl.float32)
        else:
            act = (g_v / (1.0 + tl.exp(-g_v))).to(dt).to(tl.float32)
            h = act * u_v
        tl.store(h_ptr + rows[:, None] * I + cols[None, :], h.to(dt),
                 mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _down(h_ptr, rid_ptr, wt_ptr, w_ptr, s_ptr, offs_ptr, group_ptr, row_ptr, end_ptr, y_ptr,
              D, I, SD, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              PRECISION: tl.constexpr, WIDEN: tl.constexpr, P: tl.constexpr,
              QUANT: tl.constexpr, SS: tl.constexpr):
        g, rows, row_ok, cols, col_ok = _tile(group_ptr, row_ptr, end_ptr, D, BM, BN)
        off_d = tl.load(offs_ptr + g * P + 2)
        down, sc_d = w_ptr + off_d, s_ptr + (off_d + SD) // SS
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, I, BK):
            ks = k0 + tl.arange(0, BK)
            k_ok = ks < I
            ht = tl.load(h_ptr + rows[:, None] * I + ks[None, :],
                         mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
            if QUANT == 0:
                wd = tl.load(down + cols[None, :] * I + ks[:, None],
                             mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # [BK, BN]
                if WIDEN:
                    ht, wd = ht.to(tl.float32), wd.to(tl.float32)
                acc = tl.dot(ht, wd, acc, input_precision=PRECISION)
            else:
                wd, dd = tile_t(down, sc_d, cols, col_ok, k0, I, QUANT)
                if WIDEN:
                    ht = ht.to(tl.float32)
                else:
                    wd = wd.to(h_ptr.dtype.element_ty)
                acc += tl.dot(ht, wd, input_precision=PRECISION) * dd[None, :]
        wt = tl.load(wt_ptr + tl.load(rid_ptr + rows, mask=row_ok, other=0), mask=row_ok, other=0.0)
        if P == 6:  # + the down bias
            db = tl.load(w_ptr + tl.load(offs_ptr + g * P + 5) + cols, mask=col_ok, other=0.0)
            acc += db.to(tl.float32)[None, :]
        y = acc.to(h_ptr.dtype.element_ty).to(tl.float32) * wt[:, None]
        tl.store(y_ptr + rows[:, None] * D + cols[None, :], y,
                 mask=row_ok[:, None] & col_ok[None, :])
