"""Multi-head latent attention (deepseek_v2, deepseek_v3). Keys and values come from one
compressed latent per token (kv_lora_rank wide, RMS-normed) and one rotated key of head_dim rope
dims that every head shares; q comes through a low-rank bottleneck or one projection. The KV
cache holds just those two per token (ModelConfig.kv_entry: [latent | rope key]), never expanded
keys and values. A forward then either expands the cached latents through attn_kv_b into
per-head keys and values, or absorbs attn_kv_b into the query and the output: each head's query
moves into latent space and attends over the cache rows themselves, one key and value shared by
all heads, so nothing per cached token is computed again. Which of the two: the one with fewer
multiply-adds (absorbs), the absorbed one for decode steps. Plain torch on every device.

Shape legend: T tokens of this forward, S cached + new tokens, D hidden, H heads, r
kv_lora_rank, dr rope dims (head_dim), dn the other q/k dims (qk_nope_head_dim), dv value dims,
rq q_lora_rank.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from .layers import SDPA_BACKENDS, Linear, RMSNorm
from .rope import apply_rotary

# the q and kv latents' RMSNorm eps: transformers builds both norms with its default, never
# with the config's rms_norm_eps
LATENT_NORM_EPS = 1e-6


def softmax_scale(config) -> float:
    """(dn + dr) ** -0.5; with a rope scaling that gives mscale_all_dim (DeepSeek's YaRN) times
    mscale(factor, mscale_all_dim) ** 2, as transformers (the rotary tables carry the other
    factor, rope.py)."""
    scale = (config.qk_nope_head_dim + config.head_dim) ** -0.5
    rs = config.rope_scaling or {}
    m_all = rs.get("mscale_all_dim")
    if rs.get("rope_type", "default") != "default" and m_all:
        factor = rs["factor"]
        mscale = 0.1 * m_all * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


def absorbs(T: int, S: int, H: int, r: int, dn: int, dr: int, dv: int) -> bool:
    """Whether T queries over S cached tokens take fewer multiply-adds absorbed than expanded:
    expanded = S r H (dn + dv) (every cached latent through attn_kv_b) + T S H (dn + dr + dv);
    absorbed = T H r (dn + dv) (the queries in, the outputs out) + T S H (2 r + dr).
    A decode step (T = 1) absorbs from its second token on (dn + dv >= 4); a first prefill chunk
    (T = S) expands."""
    expanded = S * r * H * (dn + dv) + T * S * H * (dn + dr + dv)
    absorbed = T * H * r * (dn + dv) + T * S * H * (2 * r + dr)
    return absorbed < expanded


class MLAttention(nn.Module):
    """MLA. attn_q_a -> attn_q_a_norm -> attn_q_b (q_lora_rank > 0) or attn_q: per head dn
    dims then dr rope dims; attn_kv_a_mqa: the latent [r] then the rope key [dr];
    attn_kv_b: per head dn key dims then dv value dims from the normed latent. Biases on
    attn_q_a, attn_kv_a_mqa and attn_output when attention_bias. Rotary on interleaved pairs
    (rope_interleaved) is the half-split rotation after taking the even dims, then the odd ones,
    of q and k alike: their dot products are the same."""

    def __init__(self, config):
        super().__init__()
        c = config
        self.num_heads, self.kv_lora_rank = c.num_heads, c.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.head_dim, c.v_head_dim
        self.is_interleaved, self.has_q_lora = c.rope_interleaved, c.q_lora_rank > 0
        H, D, bias = c.num_heads, c.hidden_size, c.attention_bias
        q_dim = H * (c.qk_nope_head_dim + c.head_dim)
        if c.q_lora_rank:
            self.attn_q_a = Linear(D, c.q_lora_rank, bias=bias)
            self.attn_q_a_norm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS)
            self.attn_q_b = Linear(c.q_lora_rank, q_dim, bias=False)
        else:
            self.attn_q = Linear(D, q_dim, bias=False)
        self.attn_kv_a_mqa = Linear(D, c.kv_lora_rank + c.head_dim, bias=bias)
        self.attn_kv_a_norm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS)
        self.attn_kv_b = Linear(c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.attn_output = Linear(H * c.v_head_dim, D, bias=bias)
        self.scale = softmax_scale(c)

    def forward(self, x: torch.Tensor, layer: int, step) -> torch.Tensor:
        """x [T, D] -> [T, D]; writes this layer's latents and rope keys of the T tokens into
        step.kv_cache."""
        T, H, r, dn, dr = x.shape[0], self.num_heads, self.kv_lora_rank, self.nope_dim, self.rope_dim
        if self.has_q_lora:
            q = self.attn_q_b(self.attn_q_a_norm(self.attn_q_a(x)))
        else:
            q = self.attn_q(x)
        q_nope, q_rope = q.view(T, H, dn + dr).split([dn, dr], dim=-1)  # [T, H, dn], [T, H, dr]
        latent, k_rope = self.attn_kv_a_mqa(x).split([r, dr], dim=-1)  # [T, r], [T, dr]
        q_rope = self._rotate(q_rope, step)
        k_rope = self._rotate(k_rope[:, None], step)  # [T, 1, dr]
        entry = torch.cat((self.attn_kv_a_norm(latent)[:, None], k_rope), dim=-1)  # [T, 1, r + dr]
        cached, = step.kv_cache.store(layer, step.start, entry)  # [1, S, r + dr]
        S = cached.shape[1]
        if absorbs(T, S, H, r, dn, dr, self.v_dim):
            out = self._absorbed(q_nope, q_rope, cached, step.mask)
        else:
            out = self._expanded(q_nope, q_rope, cached[0], step.mask)
        return self.attn_output(out.reshape(T, H * self.v_dim))

    def _rotate(self, x: torch.Tensor, step) -> torch.Tensor:
        if self.is_interleaved:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rotary(x, step.cos, step.sin)

    def _expanded(self, q_nope, q_rope, cached, mask):
        """Per-head keys and values of every cached token: cached [S, r + dr] -> [T, H, dv]."""
        S, H, r, dn = cached.shape[0], self.num_heads, self.kv_lora_rank, self.nope_dim
        kv = self.attn_kv_b(cached[:, :r]).view(S, H, dn + self.v_dim)
        k_nope, v = kv.split([dn, self.v_dim], dim=-1)  # [S, H, dn], [S, H, dv]
        k = torch.cat((k_nope, cached[:, None, r:].expand(S, H, self.rope_dim)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)  # [T, H, dn + dr]
        out = _attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask,
                         self.scale)  # [H, T, dv]
        return out.transpose(0, 1)

    def _absorbed(self, q_nope, q_rope, cached, mask):
        """attn_kv_b's key half folded into the queries, its value half into the output: every
        head attends over the cache rows (key [r + dr], value their latent [r]). cached
        [1, S, r + dr] -> [T, H, dv]."""
        H, r, dn = self.num_heads, self.kv_lora_rank, self.nope_dim
        w = self.attn_kv_b.weight.view(H, dn + self.v_dim, r)
        q_latent = torch.einsum("thn,hnr->htr", q_nope, w[:, :dn])  # [H, T, r]
        q = torch.cat((q_latent, q_rope.transpose(0, 1)), dim=-1)  # [H, T, r + dr]
        out = _attention(q, cached, cached[..., :r], mask, self.scale)  # [H, T, r]
        return torch.einsum("htr,hvr->thv", out, w[:, dn:])  # [T, H, dv]


def _attention(q, k, v, mask, scale):
    """SDPA: q [H, T, e], k [KV, S, e], v [KV, S, ev] with KV = H or 1 -> [H, T, ev]; mask as
    layers.attention_mask gives it (None, "causal" or [T, S] bool)."""
    is_causal = isinstance(mask, str)
    with sdpa_kernel(SDPA_BACKENDS):
        return F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=None if is_causal else mask, is_causal=is_causal,
            scale=scale, enable_gqa=k.shape[0] != q.shape[0])[0]
