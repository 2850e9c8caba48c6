"""llama4_text (Llama 4 Scout / Maverick, the text model): a token's top-1 expert by router
logit runs on the token times the sigmoid of that logit (its output weight 1), beside an
ungated shared expert; dense MLP layers between the MoE ones (moe_layers). Attention: rotary on
interleaved pairs with q/k RMS-normed without a weight after it (qk_l2_norm), within chunks of
attention_chunk_size positions on the chunked layers; the layers without rotary
(no_rope_layers) scale q by a temperature that grows with the position.

Shape legend: T tokens, H heads, KV kv heads, hd head dim, D hidden.
"""
import torch
import torch.nn.functional as F

from .layers import Attention
from .moe import MoEBlock
from .transformer import BatchStep, MoETransformer


class Llama4MoeBlock(MoEBlock):
    def route(self, router_logits):
        """-> (expert_ids [T, 1], scores [T, 1] in the logits' dtype): the top logit's expert
        and the sigmoid of that logit (in fp32, rounded as transformers)."""
        top, expert_ids = torch.topk(router_logits, 1, dim=-1)  # [T, 1] x2
        return expert_ids, torch.sigmoid(top.float()).to(router_logits.dtype)

    def forward(self, x, layer, step):
        """x [T, D] -> [T, D]: the routed expert on x * score with weight 1 (not score * its
        output: the expert is not linear), plus the shared expert of x."""
        expert_ids, scores = self.route(self.router_logits(x))  # [T, 1] x2
        ones = torch.ones(scores.shape, dtype=torch.float32, device=x.device)
        out = step.experts.forward(layer, x * scores, expert_ids, ones)  # [T, D]
        return out + self.ffn_down_shexp(F.silu(self.ffn_gate_shexp(x)) * self.ffn_up_shexp(x))


class Llama4Attention(Attention):
    """Rotary layers: interleaved rotary (layers.Attention, rope_interleaved), then q/k RMS-normed
    without a weight (qk_l2_norm), attention in chunks when the layer's type is chunked.
    Layers without rotary: q times the position's temperature (attn_temperature_tuning)."""

    def __init__(self, config, layer: int):
        c = config
        is_chunked = bool(c.layer_types) and c.layer_types[layer] == "chunked_attention"
        super().__init__(c, c.attention_bias, chunk=c.attention_chunk_size if is_chunked else None)
        self.has_rope = layer not in c.no_rope_layers
        self.has_l2_norm = c.qk_l2_norm and self.has_rope
        self.has_temperature = c.attn_temperature_tuning and not self.has_rope
        self.eps, self.floor_scale, self.attn_scale = c.rms_norm_eps, c.floor_scale, c.attn_scale

    def _rotate(self, q, k, step):
        T = q.shape[0]
        if self.has_rope:
            q, k = super()._rotate(q, k, step)  # [T, H, hd], [T, KV, hd]
        else:
            q, k = q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim)
        if self.has_l2_norm:
            q, k = _l2_norm(q, self.eps), _l2_norm(k, self.eps)
        if self.has_temperature:
            pos = _positions(step, T, q.device).float()  # [T]
            scale = torch.log1p(torch.floor((pos + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
            q = (q * scale[:, None, None]).to(q.dtype)
        return q, k


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over hd, in fp32, back in x's dtype (no weight)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _positions(step, T: int, device) -> torch.Tensor:
    """The positions [T] int64 of a forward's tokens: its KV slots from step.start (a batched
    decode step: each row's own)."""
    if isinstance(step, BatchStep) and step.bounds is not None:  # packed prefill chunks
        return torch.cat([row.start + torch.arange(b1 - b0, device=device)
                          for row, b0, b1 in zip(step.rows, step.bounds, step.bounds[1:])])
    if isinstance(step, BatchStep):
        starts = [row.start for row in step.rows]
        return torch.cat(starts) if torch.is_tensor(starts[0]) else torch.tensor(starts, device=device)
    return step.start + torch.arange(T, device=device)


class Llama4TextModel(MoETransformer):
    moe_block = Llama4MoeBlock

    def mixer(self, config, layer: int):
        return Llama4Attention(config, layer)
