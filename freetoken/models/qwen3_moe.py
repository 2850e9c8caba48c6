"""qwen3_moe: softmax over all experts in fp32, top-k, renormalised when norm_topk_prob; the top-k
weights are rounded to the hidden dtype before they weight the experts. Per-head q/k RMSNorm
(config qk_norm=per_head). No shared expert."""
import torch

from .moe import MoEBlock, softmax_topk
from .transformer import MoETransformer


def round_to(weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 weights as the hidden dtype would hold them (identity in fp32)."""
    return weights.to(dtype).float()


class Qwen3MoeBlock(MoEBlock):
    def route(self, router_logits):
        expert_ids, weights = softmax_topk(router_logits, self.config.num_experts_per_tok,
                                           self.config.norm_topk_prob)
        return expert_ids, round_to(weights, router_logits.dtype)


class Qwen3MoeModel(MoETransformer):
    moe_block = Qwen3MoeBlock
