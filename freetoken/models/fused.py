"""Fused kernels on cuda (Triton): of the attention segment RMSNorm, residual add + RMSNorm, and
per-head q/k RMSNorm + rotary for q and k (or rotary alone) in one launch; of the MoE block the
softmax -> top-k -> renormalise router (fused_router.py). layers.py and moe.py pick them when
enabled(x) holds; everywhere else (cpu, no Triton) their torch code runs, which is also the
reference the tests compare the kernels with. The captured decode step's split-K attention is
split_attention.py.

Each kernel does torch's arithmetic in torch's order: widened to fp32, rounded to x's dtype
after every op that torch rounds after (so the bf16 products and sums round alike), and no fused
multiply-add (enable_fp_fusion=False). Only the RMS statistics may differ in the last fp32 bit
(another reduction order), which can move a bf16 result by one rounding step.

  rms_norm     grid (N,):        y = w * (x * rsqrt(mean(x^2) + eps)).to(dtype)
  add_rms      grid (N,):        h = x + r; y as rms_norm of h; returns both
  qk_rope      grid (T, H + KV): q heads then k heads: [per-head RMSNorm], then
                                 out = x * cos + roll(x, hd/2) * signed sin; [each k head's
                                 out and v row also into its KV cache slot: the captured
                                 decode step's store (layers._fused_kv_store)]

Shape legend: N rows, D row width, T tokens, H query heads, KV kv heads, hd head dim.
"""
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: layers.py and moe.py keep their torch code
    triton = None

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available() -> bool:
    return triton is not None


def enabled(x: torch.Tensor) -> bool:
    """Whether the fused kernels run for x: a cuda tensor of a float dtype, Triton importable.
    Tests patch it (module attribute: every caller reads fused.enabled) to get the torch path."""
    return x.is_cuda and triton is not None and x.dtype in _DTYPES


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
                 v_ptr, kc_ptr, vc_ptr, slot_ptr, slot, v_stride, c_head, c_row,
                 H: tl.constexpr, KV: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
                 HAS_NORM: tl.constexpr, STORE_KV: tl.constexpr, SLOT_PTR: tl.constexpr,
                 WRITE_K: tl.constexpr):
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
        y1, y2 = _rope_half(x1, x2, c1, s1), _rope_half(x2, x1, c2, s2)
        out_ok = ok
        if not WRITE_K:  # the caller takes k from the cache: only q comes out
            out_ok = ok & (j < H)
        tl.store(dst + cols, y1, mask=out_ok)
        tl.store(dst + HALF + cols, y2, mask=out_ok)
        if STORE_KV:
            if j >= H:  # key head j - H: its k row and v row into cache slot `slot + t`
                if SLOT_PTR:
                    s0 = tl.load(slot_ptr)  # the captured step's pos [1], read at every replay
                else:
                    s0 = slot
                at = (j - H).to(tl.int64) * c_head + (s0 + t) * c_row
                tl.store(kc_ptr + at + cols, y1, mask=ok)
                tl.store(kc_ptr + at + HALF + cols, y2, mask=ok)
                v_src = v_ptr + t * v_stride + (j - H) * (2 * HALF)
                tl.store(vc_ptr + at + cols, tl.load(v_src + cols, mask=ok), mask=ok)
                tl.store(vc_ptr + at + HALF + cols, tl.load(v_src + HALF + cols, mask=ok),
                         mask=ok)


def rows(x: torch.Tensor):
    """x [..., D] as rows [N, D] with a row stride (no copy when the rows are evenly spaced)."""
    if x.dim() == 2 and x.stride(-1) == 1:
        return x
    return x.reshape(-1, x.shape[-1]) if x.stride(-1) == 1 else x.contiguous().view(-1, x.shape[-1])


def _warps(block: int) -> int:
    return max(1, min(8, block // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers.RMSNorm.forward in one kernel: x [..., D], weight [D] of x's dtype -> [..., D]."""
    D = x.shape[-1]
    xr = rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if xr.shape[0]:
        block = triton.next_power_of_2(D)
        _rms_norm[(xr.shape[0],)](xr, xr, weight, y, y, xr.stride(0), 0, eps, D=D,
                                  BLOCK=block, HAS_RES=False, num_warps=_warps(block),
                                  enable_fp_fusion=False)
    return y


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(h + delta, rms_norm(h + delta)) in one kernel: h, delta [N, D] of one dtype, weight [D]."""
    D = h.shape[-1]
    a, b = rows(h), rows(delta)
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


def qk_rope(q, k, cos, sin, head_dim: int, q_norm=None, k_norm=None, cache=None,
            need_k: bool = True):
    """Per-head RMSNorm (when q_norm, k_norm = (weight [hd], eps) are given) and then
    rope.apply_rotary for q [T, H*hd] (or [T, H, hd]) and k [T, KV*hd] in one launch.
    cos, sin [T, 1, hd] from Rotary.cos_sin in q's dtype. -> q [T, H, hd], k [T, KV, hd].

    cache = (keys, values, slot, v) also stores the KV cache in the same launch (what
    KVCache.store / StaticKV.store do after it): keys, values [KV, S, hd] one layer's cache
    views (each head's slot rows contiguous, as KVCache.data[layer][0], [1]), slot the slot of
    token 0 (a Python int, or an int64 tensor [1] on the device that is read by the kernel:
    the captured step's pos), v [T, KV*hd] or [T, KV, hd]. Token t's rotated k row goes to
    keys[:, slot + t] and its v row to values[:, slot + t]. need_k=False (with cache): k is
    not written out and None is returned for it."""
    T, hd = q.shape[0], head_dim
    q2, k2 = _heads(q, hd), _heads(k, hd)
    assert hd % 2 == 0 and q2.shape[1] % hd == 0 and k2.shape[1] % hd == 0, (q.shape, k.shape, hd)
    H, KV = q2.shape[1] // hd, k2.shape[1] // hd
    assert need_k or cache is not None, "need_k=False only when k goes to the cache"
    qo = torch.empty((T, H, hd), dtype=q.dtype, device=q.device)
    ko = torch.empty((T, KV, hd), dtype=k.dtype, device=k.device) if need_k else None
    cos2, sin2 = rows(cos), rows(sin)  # [T, hd]
    assert cos2.stride(0) == sin2.stride(0), "cos and sin come from one Rotary.cos_sin"
    has_norm = q_norm is not None
    qw, q_eps = q_norm if has_norm else (q2, 0.0)
    kw, k_eps = k_norm if has_norm else (k2, 0.0)
    # unused pointer arguments get k2, unused numbers 0
    v2, kc, vc, slot_ptr, slot, c_head, c_row = k2, k2, k2, k2, 0, 0, 0
    slot_on_device = False
    if cache is not None:
        kc, vc, at, v = cache
        v2 = _heads(v, hd)
        assert v2.shape == k2.shape and v.dtype == k.dtype, (v.shape, k.shape, v.dtype, k.dtype)
        assert (kc.shape == vc.shape and kc.shape[0] == KV and kc.shape[2] == hd
                and kc.stride() == vc.stride() and kc.stride(2) == 1
                and kc.dtype == vc.dtype == k.dtype), (kc.shape, kc.stride(), vc.stride())
        c_head, c_row = kc.stride(0), kc.stride(1)
        if torch.is_tensor(at):
            assert at.numel() == 1 and at.dtype == torch.int64 and at.device == k.device, at
            slot_ptr, slot_on_device = at, True
        else:
            assert 0 <= at and at + T <= kc.shape[1], (at, T, kc.shape)
            slot = int(at)
    if T:
        block = triton.next_power_of_2(hd // 2)
        _qk_rope[(T, H + KV)](q2, k2, qo, ko if need_k else qo, cos2, sin2, qw, kw,
                              q2.stride(0), k2.stride(0), cos2.stride(0), q_eps, k_eps,
                              v2, kc, vc, slot_ptr, slot, v2.stride(0), c_head, c_row,
                              H=H, KV=KV, HALF=hd // 2, BLOCK=block, HAS_NORM=has_norm,
                              STORE_KV=cache is not None, SLOT_PTR=slot_on_device,
                              WRITE_K=need_k, num_warps=1,
                              enable_fp_fusion=False)
    return qo, ko


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
