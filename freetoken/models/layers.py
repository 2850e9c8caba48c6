"""Shared blocks of the decoder: RMSNorm, GQA attention over the KV cache (+ q/k norm variants,
clip_qkv), dense SwiGLU MLP; rotary embeddings are in rope.py.
Module attribute names are the canonical FTW suffixes (attn_q, ffn_up, ...): see loader.py.
On cuda with Triton the norms, q/k/v and the q/k norm + rotary run as fused kernels (fused.py),
and one token's linear layers as a GEMV (fused_gemv.py); the torch code here is the reference
and the cpu path.
The captured decode step's attention on cuda is split_attention.decode_attention (split-K over
the attended slots only); elsewhere SDPA over the whole span with a mask (the cpu path's, and
the reference). That step's q/k norm + rotary kernel also stores the token's k and v into the KV
cache (_fused_kv_store; elsewhere StaticKV.store after it).

Shape legend: T tokens of this forward, S cached + new tokens, D hidden, H heads, KV kv heads,
hd head dim, I dense MLP width.
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import ModelError
from . import fused, fused_gemv, split_attention
from .rope import apply_partial_rotary


class Linear(nn.Linear):
    """nn.Linear without the random init: every weight is loaded (loader.py). On the meta
    device the init ops would import torch._dynamo (~1.5 s of a model's load time). One token's
    row on cuda goes through fused_gemv (faster than cuBLAS at one row)."""

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_gemv.linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding without the random init (see Linear)."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    """x / rms(x) * weight; the statistics in fp32, the weight multiply in x's dtype (as HF)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused(x):
            return fused.rms_norm(x, self.weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)  # one op, not five
        return self.weight * normed.to(x.dtype)

    def add_forward(self, h: torch.Tensor, delta):
        """(h + delta, self(h + delta)), one kernel on cuda; delta None: (h, self(h))."""
        if delta is None:
            return h, self(h)
        if self._fused(h) and delta.dtype == h.dtype:
            return fused.add_rms_norm(h, delta, self.weight, self.eps)
        h = h + delta
        return h, self(h)

    def _fused(self, x: torch.Tensor) -> bool:
        return fused.enabled(x) and self.weight.dtype == x.dtype


class Attention(nn.Module):
    """GQA attention. qk_norm: `per_head` = RMSNorm over hd after the head split (qwen3_moe),
    `full` = RMSNorm over the whole projection before the split (olmoe); clip_qkv clamps q/k/v
    after the norms (olmoe). Partial rotary (glm4_moe): only the first rotary_dim dims of each
    head rotate; the fused q/k norm + rotary kernel assumes full rotary, so those layers take
    the torch code for it (the fused q/k/v matmul and the decode attention stay). So do rotary
    on interleaved pairs (ernie4_5_moe: each head's even dims then its odd ones, rotated by
    halves; q and k alike, so their products are unchanged) and the per-head norm after the
    rotary (hunyuan_v1_moe: qk_norm_after_rope)."""

    def __init__(self, config, output_bias: bool = False, window=None, sinks: bool = False,
                 chunk=None):
        """window: this layer's sliding window (tokens, self included) when it differs from
        the step's mask (gpt_oss's sliding layers); sinks: a learned logit per head in the
        softmax's denominator (attn_sinks [H], gpt_oss); chunk: a token attends only to the
        tokens of its own chunk of `chunk` positions (llama4_text's chunked layers). Each takes
        _masked_attention (a chunk only once the tokens span two chunks)."""
        super().__init__()
        c = config
        if c.attn_output_gate:
            raise ModelError("the attention output gate needs the family's own attention "
                             "(gated_attention.GatedAttention)")
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        # the softmax's scale: 1/sqrt(hd), or the config's (granitemoe's attention_multiplier)
        self.scale = c.head_dim ** -0.5 if c.attention_multiplier is None else c.attention_multiplier
        self.is_partial_rotary = c.rotary_dim != c.head_dim
        self.is_interleaved, self.is_norm_after_rope = c.rope_interleaved, c.qk_norm_after_rope
        if self.is_interleaved and self.is_partial_rotary:
            raise ModelError("rotary on interleaved pairs is supported for full rotary only")
        self.qk_norm, self.clip_qkv = c.qk_norm, c.clip_qkv
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.attn_q = Linear(c.hidden_size, q_dim, bias=c.attention_bias)
        self.attn_k = Linear(c.hidden_size, kv_dim, bias=c.attention_bias)
        self.attn_v = Linear(c.hidden_size, kv_dim, bias=c.attention_bias)
        self.attn_output = Linear(q_dim, c.hidden_size, bias=output_bias)
        if c.qk_norm == "per_head":
            self.attn_q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.attn_k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        elif c.qk_norm == "full":
            self.attn_q_norm = RMSNorm(q_dim, c.rms_norm_eps)
            self.attn_k_norm = RMSNorm(kv_dim, c.rms_norm_eps)
        elif c.qk_norm != "none":
            raise ModelError(f"qk_norm {c.qk_norm!r} is not supported (none, per_head, full)")
        self._qkv = None  # cuda: (weights' data_ptrs, fused weight, fused bias), see _fused_qkv
        self.window, self.has_sinks, self.chunk = window, sinks, chunk
        if sinks:
            self.attn_sinks = nn.Parameter(torch.zeros(c.num_heads))  # [H]

    def forward(self, x: torch.Tensor, layer: int, step) -> torch.Tensor:
        """x [T, D] -> [T, D]; writes this layer's k/v for the T tokens into step.kv_cache.
        On cuda (fused.enabled) q/k/v are one matmul and the q/k norm + rotary one kernel."""
        T = x.shape[0]
        q, k, v, is_fused = self._project(x)
        decode = T == 1 and isinstance(step.mask, torch.Tensor)  # captured: fixed span, masked
        static = decode and torch.is_tensor(step.start)  # StaticKV's step (graphs.py)
        kv_in_kernel = False  # whether qk_rope also stores k and v (_fused_kv_store)
        if is_fused and self._fusable_qk(q, step):
            kv_in_kernel = static and _fused_kv_store(q)
            if kv_in_kernel:  # k and v go to the new token's slot in the same launch
                keys, values = step.kv_cache.views(layer)  # [KV, slots, hd] x2
                q, _ = self._fused_qk_rotary(q, k, step, (keys, values, step.kv_cache.slot, v))
            else:
                q, k = self._fused_qk_rotary(q, k, step)  # [T, H, hd], [T, KV, hd]
        else:
            q, k = self._rotate(q, k, step)
        if kv_in_kernel:
            return self.attn_output(self._attend_stored(q, keys, values, step))
        return self.attn_output(self._store_attend(q, k, v, layer, step))

    def forward_rows(self, x: torch.Tensor, layer: int, step) -> torch.Tensor:
        """A batched decode step (transformer.BatchStep): x [B, D], row b one token of sequence
        b -> [B, D]. The projections, norms and rotary run on the B rows at once; the K/V store
        and the attention per row, on that row's sequence (step.rows[b]: its KV and mask)."""
        q, k, v, is_fused = self._project(x)
        if is_fused and self._fusable_qk(q, step):
            q, k = self._fused_qk_rotary(q, k, step)  # [B, H, hd], [B, KV, hd]
        else:
            q, k = self._rotate(q, k, step)
        outs = [self._store_attend(q[b:b + 1], k[b:b + 1], v[b:b + 1], layer, row)
                for b, row in enumerate(step.rows)]
        return self.attn_output(torch.cat(outs))

    def _store_attend(self, q, k, v, layer: int, step) -> torch.Tensor:
        """k, v [T, KV, hd] stored into step.kv_cache, then q [T, H, hd] attends -> [T, H*hd]."""
        keys, values = step.kv_cache.store(layer, step.start, k, v)  # [KV, S, hd] x2
        return self._attend_stored(q, keys, values, step)

    def _attend_stored(self, q, keys, values, step) -> torch.Tensor:
        """q [T, H, hd] over the keys, values step.kv_cache returned -> [T, H*hd]: a window or
        sinks take _masked_attention; one token over a fixed span _decode_attend; else _attend."""
        if self.window is not None or self.has_sinks or self._is_chunk_cut(q, step):
            return self._masked_attention(q, keys, values, step)
        if q.shape[0] == 1 and isinstance(step.mask, torch.Tensor):  # captured: a fixed span
            return self._decode_attend(q, keys, values, step)
        return self._attend(q, keys, values, step.mask)

    def _is_chunk_cut(self, q, step) -> bool:
        """Whether this layer's chunks cut the attended span (a captured step: always)."""
        if self.chunk is None:
            return False
        return torch.is_tensor(step.start) or step.start + q.shape[0] > self.chunk

    def _decode_attend(self, q, keys, values, step) -> torch.Tensor:
        """One token q [1, H, hd] over a fixed span with a mask (graphs.StaticKV: keys, values
        are the whole storage, read through its page table) -> [1, H*hd]."""
        kv = step.kv_cache
        static = torch.is_tensor(step.start)
        if static and _triton_decode_attention(q):
            return split_attention.decode_attention(
                q, keys, values, step.start, kv.span, self.scale,
                kv.sliding_window, pages=(kv.page_table, kv.page_size))
        if static:
            keys, values = kv.gather(keys, values)  # [KV, span, hd] x2
        return _grouped_decode_attention(q, keys, values, step.mask, self.scale)

    def _project(self, x: torch.Tensor):
        """(q [T, H*hd], k [T, KV*hd], v [T, KV, hd], fused): the projections with the `full`
        norm and clip_qkv applied; fused: on cuda's fused kernels (one q/k/v matmul)."""
        T = x.shape[0]
        is_fused = fused.enabled(x)
        if is_fused:
            q, k, v = self._fused_qkv(x)  # views of one [T, (H + 2 KV) hd] output
        else:
            q, k, v = self.attn_q(x), self.attn_k(x), self.attn_v(x)  # [T, H*hd], [T, KV*hd] x2
        if self.qk_norm == "full":
            q, k = self.attn_q_norm(q), self.attn_k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        return q, k, v.view(T, self.num_kv_heads, self.head_dim), is_fused

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, step):
        """The torch q/k per-head norm + (partial) rotary: q [T, H, hd], k [T, KV, hd]."""
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "per_head" and not self.is_norm_after_rope:
            q, k = self.attn_q_norm(q), self.attn_k_norm(k)
        if self.is_interleaved:
            q = torch.cat((q[..., 0::2], q[..., 1::2]), dim=-1)
            k = torch.cat((k[..., 0::2], k[..., 1::2]), dim=-1)
        q, k = apply_partial_rotary(q, step.cos, step.sin), apply_partial_rotary(k, step.cos, step.sin)
        if self.qk_norm == "per_head" and self.is_norm_after_rope:
            q, k = self.attn_q_norm(q), self.attn_k_norm(k)
        return q, k

    def _attend(self, q: torch.Tensor, keys, values, mask) -> torch.Tensor:
        """SDPA of q [T, H, hd] over keys, values [KV, S, hd] -> [T, H*hd]; mask as
        attention_mask gives it ("causal", [T, S] bool or None)."""
        T = q.shape[0]
        return sdpa(q, keys, values, mask, self.scale).transpose(0, 1).reshape(T, -1)

    def _masked_attention(self, q, keys, values, step) -> torch.Tensor:
        """q [T, H, hd] over keys, values [KV, S, hd] (a StaticKV step: the whole storage) ->
        [T, H*hd]: causal, within self.window and self.chunk, with the sinks as one more key
        per head whose logit is attn_sinks[h] and whose value is 0 (softmax over [q.k * scale,
        sink], the sink's share dropped). SDPA with a float mask on every device (no split-K
        kernel)."""
        T, H, hd = q.shape
        if torch.is_tensor(step.start):  # StaticKV: the step's mask [1, S] over the gathered span
            keys, values = step.kv_cache.gather(keys, values)  # [KV, span, hd] x2
            allowed = step.mask
            slot = torch.arange(keys.shape[1], device=q.device)  # the span's slots
            if self.window is not None:
                allowed = allowed & (slot > step.start - self.window)
            if self.chunk is not None:
                allowed = allowed & (slot // self.chunk == step.start // self.chunk)
        else:
            allowed = _causal_mask(step.start, T, self.window, q.device, self.chunk)  # [T, S]
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
        bias = bias.masked_fill(~allowed, float("-inf"))[None].expand(H, -1, -1)  # [H, T, S]
        if self.has_sinks:
            zero = keys.new_zeros(keys.shape[0], 1, hd)
            keys, values = torch.cat((keys, zero), 1), torch.cat((values, zero), 1)  # S + 1
            sink = self.attn_sinks.to(q.dtype)[:, None, None].expand(H, T, 1)  # [H, T, 1]
            bias = torch.cat((bias, sink), dim=-1)  # [H, T, S + 1]
        with sdpa_kernel(SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys[None], values[None], attn_mask=bias[None],
                scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        return out[0].transpose(0, 1).reshape(T, -1)  # [T, H*hd]

    def _fused_qkv(self, x: torch.Tensor):
        """q [T, H*hd], k, v [T, KV*hd] as views of one matmul over the concatenated weights,
        concatenated on the first call (never while a CUDA graph is captured: the engine runs
        every captured step once inline first) and again if the weights were replaced."""
        lin = (self.attn_q, self.attn_k, self.attn_v)
        if self._qkv is None or self._qkv[0] != tuple(m.weight.data_ptr() for m in lin):
            capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
            if capturing or not fused.can_fuse_qkv(*lin):
                return tuple(m(x) for m in lin)
            weight, bias = fused.fuse_qkv(*lin)
            self._qkv = (tuple(m.weight.data_ptr() for m in lin), weight, bias)
        _, weight, bias = self._qkv
        sizes = [m.weight.shape[0] for m in lin]
        return fused_gemv.linear(x, weight, bias).split(sizes, dim=-1)

    def _fusable_qk(self, q: torch.Tensor, step) -> bool:
        """Whether fused.qk_rope computes what the torch code does: full rotary, all in q's dtype."""
        if self.is_partial_rotary or self.is_interleaved or self.is_norm_after_rope:
            return False
        ts = [step.cos, step.sin]
        if self.qk_norm == "per_head":
            ts += [self.attn_q_norm.weight, self.attn_k_norm.weight]
        return all(t.dtype == q.dtype for t in ts)

    def _fused_qk_rotary(self, q: torch.Tensor, k: torch.Tensor, step, cache=None):
        """fused.qk_rope with this layer's norms; cache = (keys, values, slot, v): k and v
        stored there too, and k not returned (None)."""
        norms = (None, None)
        if self.qk_norm == "per_head":
            qn, kn = self.attn_q_norm, self.attn_k_norm
            norms = ((qn.weight, qn.eps), (kn.weight, kn.eps))
        return fused.qk_rope(q, k, step.cos, step.sin, self.head_dim, *norms, cache=cache,
                             need_k=cache is None)


def _grouped_decode_attention(q, keys, values, mask, scale: float):
    """One query token over a fixed span of S cache slots (graphs.StaticKV): q [1, H, hd], keys
    and values [KV, S, hd], mask [1, S] bool, the softmax's scale -> [1, H*hd]. The G = H/KV query heads that share
    a kv head are that head's G queries (head h reads kv head h // G), so no key is repeated
    and the masked kernel needs no GQA support."""
    _, H, hd = q.shape
    KV = keys.shape[0]
    with sdpa_kernel(SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(
            q.view(KV, H // KV, hd)[None], keys[None], values[None], attn_mask=mask,
            scale=scale)  # [1, KV, G, hd]
    return out.reshape(1, H * hd)


def _triton_decode_attention(q) -> bool:
    """Whether the captured decode step takes split_attention.decode_attention: cuda with
    Triton (fused.enabled), where SDPA would read the whole span
    (docs/MEASUREMENTS.md#decode-attention). Tests patch it for SDPA."""
    return fused.enabled(q)


def _fused_kv_store(q) -> bool:
    """Whether the captured decode step's q/k norm + rotary kernel also writes the token's k
    and v into the KV cache (fused.qk_rope's cache argument) instead of StaticKV.store's two
    index_copy_ launches after it: on cuda with Triton (fused.enabled), one launch less per
    layer (docs/MEASUREMENTS.md#decode-attention). Tests patch it for the separate store."""
    return fused.enabled(q)


# Not cuDNN: its SDPA plans anew for every new KV length, i.e. every decode step, at a host cost
# larger than the step's own (tools/profile_decode.py; docs/MEASUREMENTS.md#decode-attention).
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask, scale: float):
    """q [T, H, hd] over keys, values [KV, S, hd] (H a multiple of KV) -> [H, T, hd]; mask as
    attention_mask gives it. A [T, S] mask on cuda with grouped heads repeats the KV heads
    first: SDPA's grouped form takes no memory-efficient kernel with a mask and falls back to
    materialising the scores (tens of GB for an 8K chunk over a 32K context)."""
    H, KV = q.shape[1], keys.shape[0]
    is_causal = isinstance(mask, str)
    if H != KV and q.is_cuda and isinstance(mask, torch.Tensor) and q.shape[0] > 1:
        keys, values = (x.repeat_interleave(H // KV, dim=0) for x in (keys, values))
    with sdpa_kernel(SDPA_BACKENDS):
        return F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys[None], values[None],
            attn_mask=None if is_causal else mask, is_causal=is_causal, scale=scale,
            enable_gqa=H != keys.shape[0])[0]


def attention_mask(start: int, num_new: int, sliding_window, device):
    """Bool mask [T, S] (True = attend) for tokens at cache slots [start, start + T) over slots
    [0, start + T): causal, and within `sliding_window` tokens (self included) when set.
    None when every query may see every key (a single token), "causal" when the mask is the
    plain square causal one (a first chunk that the window does not cut)."""
    end = start + num_new
    if num_new == 1 and (sliding_window is None or end <= sliding_window):
        return None
    if start == 0 and (sliding_window is None or end <= sliding_window):
        return "causal"  # the square causal case: SDPA's is_causal, which can use flash kernels
    return _causal_mask(start, num_new, sliding_window, device)


def _causal_mask(start: int, num_new: int, window, device, chunk=None) -> torch.Tensor:
    """attention_mask's [T, S] bool mask, always as a tensor (no None, no "causal"); with chunk,
    also only the slots of the query's own chunk of `chunk` slots."""
    q_slot = torch.arange(start, start + num_new, device=device)[:, None]  # [T, 1]
    k_slot = torch.arange(start + num_new, device=device)[None, :]  # [1, S]
    mask = k_slot <= q_slot
    if window is not None:
        mask &= k_slot > q_slot - window
    if chunk is not None:
        mask &= k_slot // chunk == q_slot // chunk
    return mask


class DenseMLP(nn.Module):
    """SwiGLU MLP of the non-MoE layers: ffn_down(silu(ffn_gate x) * ffn_up x)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.ffn_gate = Linear(hidden, inter, bias=False)
        self.ffn_up = Linear(hidden, inter, bias=False)
        self.ffn_down = Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor, layer: int, step) -> torch.Tensor:
        return self.ffn_down(F.silu(self.ffn_gate(x)) * self.ffn_up(x))
