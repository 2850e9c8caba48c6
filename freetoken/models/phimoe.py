"""phimoe (Phi-3.5-MoE): the sparsemixer route as transformers runs it at inference, in the
router logits' dtype: 2 experts, one at a time, each weighted by its softmax share among the
experts whose logits are within 2 x router_jitter_noise (relative) of its own; every norm a
LayerNorm with a bias; biases on q/k/v/o (attention_bias) and on the output head (output_bias);
longrope as transformers' phimoe runs it (LongRotary). No q/k norm, no shared expert.

Shape legend: T tokens, E experts, D hidden, V vocabulary.
"""
import torch
import torch.nn.functional as F
from torch import nn

from .layers import Linear
from .moe import MoEBlock
from .rope import Rotary
from .transformer import MoETransformer


def sparsemixer_top2(router_logits: torch.Tensor, jitter_eps: float):
    """-> (expert_ids [T, 2] int64, weights [T, 2] fp32). Expert 1 is the top logit s1; its
    weight is its softmax share among the experts with (s1 - s) / max(|s|, s1) <= 2 jitter_eps.
    Expert 2 is the top logit s2 of the others; its weight its share among those others with
    (s2 - s) / max(|s|, s2) <= 2 jitter_eps. Example: logits [4, 3.5, 1], eps 0.1: expert 0
    with softmax([4, 3.5]) [0] = .62 (1 is 12.5% below 4, so it counts; 2 does not); expert 1
    alone within 20% of 3.5, weight 1."""
    ids, weights, scores = [], [], router_logits  # scores [T, E]
    for _ in range(2):
        top, top_id = scores.max(dim=-1, keepdim=True)  # [T, 1] x2
        far = (top - router_logits) / router_logits.abs().clamp(min=top) > 2 * jitter_eps  # [T, E]
        share = torch.softmax(scores.masked_fill(far, float("-inf")), dim=-1)  # [T, E]
        ids.append(top_id)
        weights.append(share.gather(-1, top_id))
        scores = scores.scatter(-1, top_id, float("-inf"))  # the next pick among the others
    return torch.cat(ids, dim=-1), torch.cat(weights, dim=-1).float()


class PhimoeMoeBlock(MoEBlock):
    def route(self, router_logits):
        return sparsemixer_top2(router_logits, self.config.router_jitter_noise)


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim in x's dtype (torch's
    layer_norm, as transformers' nn.LayerNorm); the residual add as RMSNorm.add_forward's."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)

    def add_forward(self, h: torch.Tensor, delta):
        """(h + delta, self(h + delta)); delta None: (h, self(h))."""
        if delta is not None:
            h = h + delta
        return h, self(h)


class LongRotary(Rotary):
    """Phi-3.5-MoE's longrope as transformers' phimoe runs it: the short factors' frequencies at
    every length, the cos/sin scaled by short_mscale, or by long_mscale in a forward whose last
    position passes original_max_position_embeddings (a batched step: each row by its own)."""

    def __init__(self, config):
        super().__init__(config)
        self.is_dynamic = True  # the scale depends on the forward's last position

    def inv_freq_scale(self, positions):
        rs, device = self.config.rope_scaling, positions.device
        if device not in self._cached:
            dim = self.config.rotary_dim
            exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim  # [hd/2]
            factors = torch.tensor(rs["short_factor"], dtype=torch.float32)
            self._cached[device] = 1.0 / (factors * self.config.rope_theta ** exponents)
        is_long = int(positions.max()) + 1 > rs["original_max_position_embeddings"]  # (a host sync)
        return self._cached[device].to(device), rs["long_mscale" if is_long else "short_mscale"]


class PhimoeModel(MoETransformer):
    moe_block = PhimoeMoeBlock
    norm = LayerNorm

    def __init__(self, config, expert_runtime):
        super().__init__(config, expert_runtime)
        if config.rope_scaling is not None:  # (convert lets longrope through only)
            self.rotary = LongRotary(config)
        if config.output_bias:  # (convert refuses it with tied embeddings)
            self.output = Linear(config.hidden_size, config.vocab_size, bias=True)

    def head(self, h):
        if not self.config.output_bias:
            return super().head(h)
        return F.linear(h, self.output.weight, self.output.bias).float()  # [T, V]
