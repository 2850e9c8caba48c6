"""The captured decode step's attention as a split-K Triton kernel (cuda): one new token's
attention over the cache slots it may see, reading only those, where SDPA over the step's fixed
span with a mask reads all of it (docs/MEASUREMENTS.md#decode-attention). layers.py takes it on cuda (_triton_decode_attention).

  decode_attention               one token's attention over cache slots [lo, pos], split-K:
    _decode_split grid (KV, NSPLIT): a kv head's G queries over one chunk of CHUNK slots ->
                                 fp32 partials (max, sum of exp, unnormalised sum of v)
    _decode_combine grid (H,):   a query head's partials rescaled to one max, summed, divided

It is not an op-for-op copy of torch's: fp32 math with libdevice's expf and div_rn, scores and
weighted sums accumulated per chunk and combined, so with fp32 inputs it matches
softmax(q k^T) v within ~1e-6 of the largest output. With bf16/fp16 caches the products q.k
are exact (tensor-core dots accumulate in fp32) and each weight p is split into two bf16
halves (p_hi + p_lo) for the p.v dots, so p keeps ~16 bits where a flash kernel rounds it to
bf16.

Shape legend: H query heads, KV kv heads, G = H / KV query heads per kv head, hd head dim,
S the captured span of cache slots.
"""
import torch

from ..config import triton_interpreted

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs: layers.py keeps SDPA
    triton = None


if triton is not None:
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
    def _decode_split(q_ptr, k_ptr, v_ptr, pos_ptr, pt_ptr, acc_ptr, ml_ptr, q_stride,
                      k_stride0, k_stride1, v_stride0, v_stride1, span, window, num_rows, scale,
                      G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr,
                      CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                      PAGE: tl.constexpr, IEEE: tl.constexpr, INTERPRETED: tl.constexpr):
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
            row = slot  # the storage row of each position: through the page table when paged
            if PAGE > 0:
                page = tl.load(pt_ptr + slot // PAGE, mask=ok, other=0)
                row = page * PAGE + slot % PAGE
            k = tl.load(k_base + row[:, None] * k_stride1 + d[None, :], mask=kv_ok, other=0.0)
            v = tl.load(v_base + row[:, None] * v_stride1 + d[None, :], mask=kv_ok, other=0.0)
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


def combine_block(num_splits: int) -> int:
    """_decode_combine's BLOCK_S for num_splits partials (a compile-time block size)."""
    return min(64, max(16, triton.next_power_of_2(num_splits)))


def decode_variant(span: int, num_kv_heads: int) -> tuple:
    """The compile-time block sizes decode_attention takes at span (chunk, BLOCK_S): one
    compiled variant each (graphs.DecodeGraphs.warm_spans)."""
    chunk = decode_chunk(span, num_kv_heads)
    return chunk, combine_block(triton.cdiv(span, chunk))


def decode_attention(q, k_cache, v_cache, pos, span: int, scale: float, sliding_window=None,
                     chunk=None, pages=None) -> torch.Tensor:
    """One new token's attention over the cache slots it may see, reading only those:
    q [1, H, hd] (any float dtype), k_cache, v_cache [KV, >= span, hd] (a layer's cache or a
    view of it, unit stride in hd; query head h reads kv head h // G), pos [1] int64 on the
    device (the token's slot, already written, < span) -> out [1, H * hd] in q's dtype:
    softmax(q k^T * scale) v over slots [lo, pos], lo = 0, or pos - sliding_window + 1
    clamped at 0 (exactly StaticKV.attention_mask). Slots >= span are never read.
    pages = (page_table [>= span / P] int64 on the device, P): slots are positions, position
    s read from storage row page_table[s // P] * P + s % P of k_cache, v_cache (kv_cache.py).

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
    page_table, page_size = pages if pages is not None else (pos, 0)
    if pages is not None:
        assert page_size > 0 and page_table.numel() * page_size >= span, (page_table.shape, span)
        assert page_table.dtype == torch.int64 and page_table.device == q.device
    assert H % KV == 0 and 0 < span and (pages is not None or span <= slots), (H, KV, span, slots)
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
                  INTERPRETED=triton_interpreted(), enable_fp_fusion=False)
    _decode_split[(KV, num_splits)](
        q, k_cache, v_cache, pos, page_table, acc, ml, q.stride(1), k_cache.stride(0),
        k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), span, window, num_rows,
        float(scale), GP=max(16, triton.next_power_of_2(G)), BLOCK_N=min(DECODE_BLOCK_N, chunk),
        PAGE=page_size, IEEE=not lowp, num_warps=4, num_stages=2, **common)
    _decode_combine[(H,)](
        acc, ml, pos, out, span, window, num_splits, num_rows,
        BLOCK_S=combine_block(num_splits), num_warps=8, **common)
    return out
