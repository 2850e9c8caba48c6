"""Fused kernels on cuda (Triton): of the attention segment RMSNorm, residual add + RMSNorm, and
per-head q/k RMSNorm + rotary for q and k (or rotary alone) in one launch, and the captured
decode step's split-K attention; of the MoE block the softmax -> top-k -> renormalise router.
layers.py and moe.py pick them when enabled(x) holds (decode attention: opt-in, see below);
everywhere else (cpu, no Triton, FREETOKEN_FUSED=0) their torch code runs.

Each kernel does torch's arithmetic in torch's order: widened to fp32, rounded to x's dtype
after every op that torch rounds after (so the bf16 products and sums round alike), and no fused
multiply-add (enable_fp_fusion=False). Only the RMS statistics may differ in the last fp32 bit
(another reduction order), which can move a bf16 result by one rounding step.

  rms_norm     grid (N,):        y = w * (x * rsqrt(mean(x^2) + eps)).to(dtype)
  add_rms      grid (N,):        h = x + r; y as rms_norm of h; returns both
  qk_rope      grid (T, H + KV): q heads then k heads: [per-head RMSNorm], then
                                 out = x * cos + roll(x, hd/2) * signed sin
  softmax_topk grid (T,):        p = softmax(logits.float()); K times: the largest p, the lowest
                                 expert id on ties; [w / sum(w)]
  decode_attention               one token's attention over cache slots [lo, pos], split-K:
    _decode_split grid (KV, NSPLIT): a kv head's G queries over one chunk of CHUNK slots ->
                                 fp32 partials (max, sum of exp, unnormalised sum of v)
    _decode_combine grid (H,):   a query head's partials rescaled to one max, summed, divided

The router does the softmax with the operations torch's cuda softmax uses: libdevice's expf and
a correctly rounded division (div_rn), not Triton's approximate exp and `/`. The sum of the
exponentials and the renormalising sum are added in another order, so they may differ in the
last fp32 bits: a weight moves by about 1e-7 relative, an id only where two probabilities are
that close. Probabilities below fp32's normal range (< 1.2e-38) come out 0 (Triton links
libdevice flushing denormals), where torch keeps the denormal.

decode_attention is the captured decode step's attention (layers.py takes it only with
FREETOKEN_DECODE_ATTENTION=triton until it is measured on the GPU; SDPA is the default). It is
not an op-for-op copy of torch's: fp32 math with libdevice's expf and div_rn, scores and weighted
sums accumulated per chunk and combined, so with fp32 inputs it matches softmax(q k^T) v
within ~1e-6 of the largest output. With bf16/fp16 caches the products q.k are exact
(tensor-core dots accumulate in fp32) and each weight p is split into two bf16 halves
(p_hi + p_lo) for the p.v dots, so p keeps ~16 bits where a flash kernel rounds it to bf16.

Shape legend: N rows, D row width, T tokens, H query heads, KV kv heads, G = H / KV query heads
per kv head, hd head dim, S the captured span of cache slots, E experts, K experts per token.
"""
import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs: layers.py and moe.py keep their torch code
    triton = None

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available() -> bool:
    return triton is not None


def enabled(x: torch.Tensor) -> bool:
    """Whether the fused kernels run for x: a cuda tensor of a float dtype, Triton importable,
    and the environment variable FREETOKEN_FUSED not "0"."""
    return (x.is_cuda and triton is not None and x.dtype in _DTYPES
            and os.environ.get("FREETOKEN_FUSED", "1") != "0")


if triton is not None:
    @triton.jit
    def _rms_row(x, w_ptr, cols, ok, eps, D: tl.constexpr):
        """One row x [BLOCK] (any float dtype) -> w * (x * rstd).to(dtype), in x's dtype."""
        xf = x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
        normed = (xf * rstd).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        return (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)

    @triton.jit
    def _rms_norm(x_ptr, r_ptr, w_ptr, h_ptr, y_ptr, x_stride, r_stride, eps,
                  D: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < D
        x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0)
        if HAS_RES:  # h = x + r, rounded as torch's add; the norm is of the rounded sum
            r = tl.load(r_ptr + row * r_stride + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(h_ptr + row * D + cols, x, mask=ok)
        tl.store(y_ptr + row * D + cols, _rms_row(x, w_ptr, cols, ok, eps, D), mask=ok)

    @triton.jit
    def _rope_half(a, b, c, s):
        """a * c + b * s with torch's roundings: each product, then the sum, in a's dtype."""
        p = (a.to(tl.float32) * c.to(tl.float32)).to(a.dtype)
        q = (b.to(tl.float32) * s.to(tl.float32)).to(a.dtype)
        return (p.to(tl.float32) + q.to(tl.float32)).to(a.dtype)

    @triton.jit
    def _qk_rope(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
                 q_stride, k_stride, cs_stride, q_eps, k_eps,
                 H: tl.constexpr, KV: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
                 HAS_NORM: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)
        cols = tl.arange(0, BLOCK)
        ok = cols < HALF
        if j < H:  # query head j
            src = q_ptr + t * q_stride + j * (2 * HALF)
            dst = qo_ptr + (t * H + j) * (2 * HALF)
            w_ptr, eps = qw_ptr, q_eps
        else:  # key head j - H
            src = k_ptr + t * k_stride + (j - H) * (2 * HALF)
            dst = ko_ptr + (t * KV + (j - H)) * (2 * HALF)
            w_ptr, eps = kw_ptr, k_eps
        x1 = tl.load(src + cols, mask=ok, other=0.0)  # first half of the head
        x2 = tl.load(src + HALF + cols, mask=ok, other=0.0)
        if HAS_NORM:
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            ss = tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)
            rstd = tl.math.rsqrt(ss / (2 * HALF) + eps)
            w1 = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + HALF + cols, mask=ok, other=0.0).to(tl.float32)
            x1 = (w1 * (f1 * rstd).to(x1.dtype).to(tl.float32)).to(x1.dtype)
            x2 = (w2 * (f2 * rstd).to(x2.dtype).to(tl.float32)).to(x2.dtype)
        cs = t * cs_stride
        c1 = tl.load(cos_ptr + cs + cols, mask=ok, other=0.0)
        c2 = tl.load(cos_ptr + cs + HALF + cols, mask=ok, other=0.0)
        s1 = tl.load(sin_ptr + cs + cols, mask=ok, other=0.0)
        s2 = tl.load(sin_ptr + cs + HALF + cols, mask=ok, other=0.0)
        # roll(x, hd/2) swaps the halves: out1 = x1 c1 + x2 s1, out2 = x2 c2 + x1 s2
        tl.store(dst + cols, _rope_half(x1, x2, c1, s1), mask=ok)
        tl.store(dst + HALF + cols, _rope_half(x2, x1, c2, s2), mask=ok)

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

    @triton.jit
    def _exp(x, INTERPRETED: tl.constexpr):
        if INTERPRETED:  # the interpreter has no libdevice
            return tl.exp(x)
        else:  # expf as torch's kernels have it (tl.exp is ex2.approx on nvidia)
            return libdevice.exp(x)

    @triton.jit
    def _dot(a, b, INTERPRETED: tl.constexpr):
        """a @ b of bf16/fp16 tiles, products exact and summed in fp32. The interpreter's dot
        would multiply bf16 bit patterns (it stores bf16 as uint16): fp32 operands there."""
        if INTERPRETED:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def _attended(pos_ptr, window, HAS_WINDOW: tl.constexpr):
        """The slots the new token attends to: [lo, pos] (StaticKV.attention_mask)."""
        pos = tl.load(pos_ptr).to(tl.int64)
        lo = pos * 0
        if HAS_WINDOW:
            lo = tl.maximum(pos - window + 1, 0)
        return lo, pos

    @triton.jit
    def _decode_split(q_ptr, k_ptr, v_ptr, pos_ptr, acc_ptr, ml_ptr, q_stride, k_stride0,
                      k_stride1, v_stride0, v_stride1, span, window, num_rows, scale,
                      G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr,
                      CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                      IEEE: tl.constexpr, INTERPRETED: tl.constexpr):
        j = tl.program_id(0).to(tl.int64)  # kv head
        split = tl.program_id(1).to(tl.int64)
        lo, pos = _attended(pos_ptr, window, HAS_WINDOW)
        c0 = split * CHUNK
        end = tl.minimum(tl.minimum(c0 + CHUNK, pos + 1), span)  # past this chunk's last slot
        first = c0 + (tl.maximum(lo - c0, 0) // BLOCK_N) * BLOCK_N  # its first tile with lo
        g, d, n = tl.arange(0, GP), tl.arange(0, HDP), tl.arange(0, BLOCK_N)
        g_ok, d_ok = g < G, d < HD
        q = tl.load(q_ptr + (j * G + g)[:, None] * q_stride + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [GP, HDP]
        if IEEE:
            q = q.to(tl.float32)
        k_base, v_base = k_ptr + j * k_stride0, v_ptr + j * v_stride0
        m_i = tl.full([GP], float("-inf"), tl.float32)  # running max of the scores
        l_i = tl.zeros([GP], dtype=tl.float32)  # sum of exp(score - m_i)
        acc = tl.zeros([GP, HDP], dtype=tl.float32)  # sum of exp(score - m_i) * v
        # Only tiles that hold attended slots: none at all for a chunk outside [lo, pos], whose
        # partial stays neutral (max -inf, sums 0). Each tile run has one slot or more, so the
        # running max is finite after it and no exp sees -inf - -inf.
        for start in range(first, end, BLOCK_N):
            slot = start + n
            ok = (slot >= lo) & (slot < end)  # [BLOCK_N]; masked loads read nothing there
            kv_ok = ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + slot[:, None] * k_stride1 + d[None, :], mask=kv_ok, other=0.0)
            v = tl.load(v_base + slot[:, None] * v_stride1 + d[None, :], mask=kv_ok, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:  # bf16/fp16 products are exact in fp32, the tensor cores sum them in fp32
                s = _dot(q, tl.trans(k), INTERPRETED)
            s = tl.where(ok[None, :], s * scale, float("-inf"))  # [GP, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = _exp(m_i - m_new, INTERPRETED)
            p = _exp(s - m_new[:, None], INTERPRETED)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:  # p as two halves in v's dtype: p_hi + p_lo keeps ~16 of p's 24 bits
                p_hi = p.to(v.dtype)
                p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
                pv = _dot(p_hi, v, INTERPRETED) + _dot(p_lo, v, INTERPRETED)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        row = (j * tl.num_programs(1) + split) * G + g  # [GP] rows of the partials
        tl.store(ml_ptr + row, m_i, mask=g_ok)
        tl.store(ml_ptr + num_rows + row, l_i, mask=g_ok)
        tl.store(acc_ptr + row[:, None] * HD + d[None, :], acc,
                 mask=g_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _decode_combine(acc_ptr, ml_ptr, pos_ptr, out_ptr, span, window, num_splits, num_rows,
                        G: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr,
                        CHUNK: tl.constexpr, BLOCK_S: tl.constexpr, HAS_WINDOW: tl.constexpr,
                        INTERPRETED: tl.constexpr):
        h = tl.program_id(0).to(tl.int64)  # query head: kv head h // G, its query h % G
        lo, pos = _attended(pos_ptr, window, HAS_WINDOW)
        s_lo, s_hi = lo // CHUNK, tl.minimum(pos, span - 1) // CHUNK  # chunks with slots
        d, b = tl.arange(0, HDP), tl.arange(0, BLOCK_S)
        d_ok = d < HD
        base = (h // G) * num_splits * G + h % G
        m_all = float("-inf")
        l_all = 0.0
        acc = tl.zeros([HDP], dtype=tl.float32)
        for s0 in range(s_lo, s_hi + 1, BLOCK_S):  # every block holds one attended chunk or more
            split = s0 + b
            ok = split <= s_hi
            row = base + split * G  # [BLOCK_S]
            m = tl.load(ml_ptr + row, mask=ok, other=float("-inf"))
            l_s = tl.load(ml_ptr + num_rows + row, mask=ok, other=0.0)
            a = tl.load(acc_ptr + row[:, None] * HD + d[None, :],
                        mask=ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_S, HDP]
            m_new = tl.maximum(m_all, tl.max(m, axis=0))
            alpha = _exp(m_all - m_new, INTERPRETED)
            w = _exp(m - m_new, INTERPRETED)  # [BLOCK_S], 0 where masked
            l_all = l_all * alpha + tl.sum(w * l_s, axis=0)
            acc = acc * alpha + tl.sum(w[:, None] * a, axis=0)
            m_all = m_new
        out = tl.math.div_rn(acc, tl.zeros([HDP], dtype=tl.float32) + l_all)
        tl.store(out_ptr + h * HD + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def _rows(x: torch.Tensor):
    """x [..., D] as rows [N, D] with a row stride (no copy when the rows are evenly spaced)."""
    if x.dim() == 2 and x.stride(-1) == 1:
        return x
    return x.reshape(-1, x.shape[-1]) if x.stride(-1) == 1 else x.contiguous().view(-1, x.shape[-1])


def _warps(block: int) -> int:
    return max(1, min(8, block // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers.RMSNorm.forward in one kernel: x [..., D], weight [D] of x's dtype -> [..., D]."""
    D = x.shape[-1]
    rows = _rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(D)
        _rms_norm[(rows.shape[0],)](rows, rows, weight, y, y, rows.stride(0), 0, eps, D=D,
                                    BLOCK=block, HAS_RES=False, num_warps=_warps(block),
                                    enable_fp_fusion=False)
    return y


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(h + delta, rms_norm(h + delta)) in one kernel: h, delta [N, D] of one dtype, weight [D]."""
    D = h.shape[-1]
    a, b = _rows(h), _rows(delta)
    out = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    y = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    if a.shape[0]:
        block = triton.next_power_of_2(D)
        _rms_norm[(a.shape[0],)](a, b, weight, out, y, a.stride(0), b.stride(0), eps, D=D,
                                 BLOCK=block, HAS_RES=True, num_warps=_warps(block),
                                 enable_fp_fusion=False)
    return out, y


def _heads(x: torch.Tensor, hd: int) -> torch.Tensor:
    """q or k as [T, heads * hd] rows whose heads lie back to back (a view when they do)."""
    T = x.shape[0]
    flat = x.reshape(T, -1) if x.dim() == 3 and x.stride(-2) == hd else x
    if flat.dim() != 2 or flat.stride(-1) != 1:
        flat = x.contiguous().view(T, -1)
    return flat


def qk_rope(q, k, cos, sin, head_dim: int, q_norm=None, k_norm=None):
    """Per-head RMSNorm (when q_norm, k_norm = (weight [hd], eps) are given) and then
    rope.apply_rotary for q [T, H*hd] (or [T, H, hd]) and k [T, KV*hd] in one launch.
    cos, sin [T, 1, hd] from Rotary.cos_sin in q's dtype. -> q [T, H, hd], k [T, KV, hd]."""
    T, hd = q.shape[0], head_dim
    q2, k2 = _heads(q, hd), _heads(k, hd)
    assert hd % 2 == 0 and q2.shape[1] % hd == 0 and k2.shape[1] % hd == 0, (q.shape, k.shape, hd)
    H, KV = q2.shape[1] // hd, k2.shape[1] // hd
    qo = torch.empty((T, H, hd), dtype=q.dtype, device=q.device)
    ko = torch.empty((T, KV, hd), dtype=k.dtype, device=k.device)
    cos2, sin2 = _rows(cos), _rows(sin)  # [T, hd]
    assert cos2.stride(0) == sin2.stride(0), "cos and sin come from one Rotary.cos_sin"
    has_norm = q_norm is not None
    qw, q_eps = q_norm if has_norm else (q2, 0.0)
    kw, k_eps = k_norm if has_norm else (k2, 0.0)
    if T:
        block = triton.next_power_of_2(hd // 2)
        _qk_rope[(T, H + KV)](q2, k2, qo, ko, cos2, sin2, qw, kw, q2.stride(0), k2.stride(0),
                              cos2.stride(0), q_eps, k_eps, H=H, KV=KV, HALF=hd // 2,
                              BLOCK=block, HAS_NORM=has_norm, num_warps=1,
                              enable_fp_fusion=False)
    return qo, ko


def softmax_topk(router_logits: torch.Tensor, k: int, renormalize: bool):
    """moe.softmax_topk in one kernel: router_logits [..., E] of a float dtype ->
    (expert_ids [..., K] int64, weights [..., K] fp32), the weights in descending order, ties to
    the lower expert id. Nothing the host waits on, so a CUDA graph can capture it."""
    E = router_logits.shape[-1]
    if not 0 <= k <= E:
        raise ValueError(f"softmax_topk: k={k} experts per token out of range for {E} experts")
    rows = _rows(router_logits)
    T = rows.shape[0]
    ids = torch.empty((T, k), dtype=torch.int64, device=router_logits.device)
    weights = torch.empty((T, k), dtype=torch.float32, device=router_logits.device)
    if T and k:
        block = triton.next_power_of_2(E)
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        _softmax_topk[(T,)](rows, ids, weights, rows.stride(0), E=E, K=k, BLOCK=block,
                            KBLOCK=triton.next_power_of_2(k), RENORM=bool(renormalize),
                            LIBDEVICE=not interpreted, num_warps=max(1, min(4, block // 512)),
                            enable_fp_fusion=False)
    lead = router_logits.shape[:-1]
    return ids.view(*lead, k), weights.view(*lead, k)


DECODE_BLOCK_N = 64  # slots per tile of _decode_split (the dots' N)
DECODE_PROGRAMS = 512  # _decode_split programs a long span is cut into at most (~4 per SM)


def decode_chunk(span: int, num_kv_heads: int) -> int:
    """Slots per _decode_split program: DECODE_BLOCK_N, doubled (up to 1024) while the span
    would need more than DECODE_PROGRAMS programs: short spans get many programs, long ones
    partials that stay small (G * hd * 4 bytes written and read again per chunk, against
    CHUNK * hd * 4 bytes of bf16 K and V read). Not yet tuned on a GPU (see
    tools/bench_decode_attention.py --chunks)."""
    chunk = DECODE_BLOCK_N
    while chunk < 1024 and num_kv_heads * triton.cdiv(span, chunk) > DECODE_PROGRAMS:
        chunk *= 2
    return chunk


def decode_attention(q, k_cache, v_cache, pos, span: int, scale: float, sliding_window=None,
                     chunk=None) -> torch.Tensor:
    """One new token's attention over the cache slots it may see, reading only those:
    q [1, H, hd] (any float dtype), k_cache, v_cache [KV, >= span, hd] (a layer's cache or a
    view of it, unit stride in hd; query head h reads kv head h // G), pos [1] int64 on the
    device (the token's slot, already written, < span) -> out [1, H * hd] in q's dtype:
    softmax(q k^T * scale) v over slots [lo, pos], lo = 0, or pos - sliding_window + 1
    clamped at 0 (exactly StaticKV.attention_mask). Slots >= span are never read.

    Shapes, grid and scratch depend on span only, never on pos (read on the device): one
    launch captured in a CUDA graph serves every position < span. Two launches, no host sync;
    scratch from torch.empty. chunk: slots per split (a power of two >= 16; decode_chunk's
    when None). Example, span 256, chunk 64, pos 100, window 30: lo = 71; chunks 0, 2 and 3
    write neutral partials, chunk 1 scores slots 71..100 (its one tile 64..127, masked), and
    the combine reads chunk 1 only."""
    _, H, hd = q.shape
    KV, slots, k_hd = k_cache.shape
    assert q.shape[0] == 1 and k_hd == hd and v_cache.shape == k_cache.shape, \
        (q.shape, k_cache.shape, v_cache.shape)
    assert H % KV == 0 and 0 < span <= slots, (H, KV, span, slots)
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "the cache's hd must be unit stride"
    assert pos.numel() == 1 and not pos.dtype.is_floating_point and pos.device == q.device
    chunk = chunk or decode_chunk(span, KV)
    assert chunk >= 16 and chunk & (chunk - 1) == 0, chunk
    if q.stride(-1) != 1:
        q = q.contiguous()
    G, num_splits = H // KV, triton.cdiv(span, chunk)
    num_rows = KV * num_splits * G
    f32 = dict(dtype=torch.float32, device=q.device)
    acc = torch.empty((num_rows, hd), **f32)  # [KV, NSPLIT, G, hd] unnormalised sums of v
    ml = torch.empty((2, num_rows), **f32)  # max, sum of exp per (KV, NSPLIT, G)
    out = torch.empty((1, H * hd), dtype=q.dtype, device=q.device)
    lowp = q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in (torch.bfloat16, torch.float16)
    hdp = max(16, triton.next_power_of_2(hd))
    window = 0 if sliding_window is None else int(sliding_window)
    common = dict(G=G, HD=hd, HDP=hdp, CHUNK=chunk, HAS_WINDOW=sliding_window is not None,
                  INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1", enable_fp_fusion=False)
    _decode_split[(KV, num_splits)](
        q, k_cache, v_cache, pos, acc, ml, q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), span, window, num_rows, float(scale),
        GP=max(16, triton.next_power_of_2(G)), BLOCK_N=min(DECODE_BLOCK_N, chunk),
        IEEE=not lowp, num_warps=4, num_stages=2, **common)
    _decode_combine[(H,)](
        acc, ml, pos, out, span, window, num_splits, num_rows,
        BLOCK_S=min(64, max(16, triton.next_power_of_2(num_splits))), num_warps=8, **common)
    return out


def can_fuse_qkv(*linears) -> bool:
    """Whether q/k/v projections can share one matmul: one dtype and device, biases alike."""
    ws = [m.weight for m in linears]
    has_bias = {m.bias is not None for m in linears}
    return (len({(w.dtype, w.device, w.shape[1]) for w in ws}) == 1 and len(has_bias) == 1)


def fuse_qkv(*linears):
    """Concatenates the weights (and biases) of the given Linear modules into one tensor and
    re-points each module's parameter at its rows of it (views), so the memory is not doubled
    and a later in-place load into a module lands in the fused tensor too. -> (weight, bias)."""
    with torch.inference_mode(False), torch.no_grad():
        weight = torch.cat([m.weight for m in linears])  # [sum of outs, D]
        bias = torch.cat([m.bias for m in linears]) if linears[0].bias is not None else None
        at = 0
        for m in linears:
            n = m.weight.shape[0]
            m.weight.data = weight[at:at + n]
            if bias is not None:
                m.bias.data = bias[at:at + n]
            at += n
    return weight, bias
