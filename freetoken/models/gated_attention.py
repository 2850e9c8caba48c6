"""The layers the hybrid Qwen families (qwen3_next, qwen3_5_moe_text) share besides Gated
DeltaNet (linear_attention.py): the (1 + w) RMSNorm, and full attention with an output gate and
partial rotary. Plain torch on every device (no fused kernels: they assume full rotary and no
gate), so these layers are their own reference.

Shape legend: T tokens of this forward, S cached + new tokens, D hidden, H heads, KV kv heads,
hd head dim, rd rotated dims of a head (hd * partial_rotary_factor).
"""
import torch
import torch.nn.functional as F
from torch import nn

from .layers import Linear, sdpa
from .rope import apply_partial_rotary


class OffsetRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight): the weights are stored centred on 0. As transformers: the
    statistics and the multiply in fp32, the result cast back to x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)

    def add_forward(self, h: torch.Tensor, delta):
        """(h + delta, self(h + delta)); delta None: (h, self(h)) (RMSNorm.add_forward's contract)."""
        if delta is not None:
            h = h + delta
        return h, self(h)


class GatedAttention(nn.Module):
    """GQA attention whose output is multiplied by sigmoid(gate) before attn_output. attn_q holds,
    per head, hd query rows then hd gate rows ([2 H hd, D], as published); q and k get a per-head
    OffsetRMSNorm, then rotary on their first rd dims. Biases on q/k/v/o when attention_bias."""

    def __init__(self, config):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.attn_q = Linear(c.hidden_size, 2 * q_dim, bias=c.attention_bias)
        self.attn_k = Linear(c.hidden_size, kv_dim, bias=c.attention_bias)
        self.attn_v = Linear(c.hidden_size, kv_dim, bias=c.attention_bias)
        self.attn_output = Linear(q_dim, c.hidden_size, bias=c.attention_bias)
        self.attn_q_norm = OffsetRMSNorm(c.head_dim, c.rms_norm_eps)
        self.attn_k_norm = OffsetRMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, layer: int, step) -> torch.Tensor:
        """x [T, D] -> [T, D]; writes this layer's k/v for the T tokens into step.kv_cache."""
        T, H, KV, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, gate = self.attn_q(x).view(T, H, 2 * hd).chunk(2, dim=-1)  # [T, H, hd] x2
        q = self.attn_q_norm(q)
        k = self.attn_k_norm(self.attn_k(x).view(T, KV, hd))  # [T, KV, hd]
        v = self.attn_v(x).view(T, KV, hd)
        q = apply_partial_rotary(q, step.cos, step.sin)
        k = apply_partial_rotary(k, step.cos, step.sin)
        keys, values = step.kv_cache.store(layer, step.start, k, v)  # [KV, S, hd] x2
        if torch.is_tensor(step.start):  # StaticKV: the storage, read through its page table
            keys, values = step.kv_cache.gather(keys, values)  # [KV, span, hd] x2
        out = sdpa(q, keys, values, step.mask, hd ** -0.5).transpose(0, 1).reshape(T, H * hd)
        return self.attn_output(out * torch.sigmoid(gate.reshape(T, H * hd)))
