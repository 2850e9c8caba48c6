"""minimax_m2 (MiniMax-M2): sigmoid scores in fp32, experts chosen by score + the correction
bias (`exp_probs_b`, kept fp32) but weighted by the score, always renormalised, no groups
(moe.sigmoid_group_topk with one group); the router linear in the hidden dtype, as
transformers. Attention: q/k RMSNorm over the whole projection (qk_norm=full) and rotary on the
first rotary_dim dims of each head (layers.Attention). No shared expert."""
import torch
from torch import nn

from .moe import MoEBlock, sigmoid_group_topk
from .transformer import MoETransformer


class MiniMaxM2MoeBlock(MoEBlock):
    fp32_parameters = ("exp_probs_b",)  # loader.py keeps it in fp32

    def __init__(self, config):
        super().__init__(config)
        self.exp_probs_b = nn.Parameter(torch.zeros(config.num_experts))  # correction bias [E]

    def route(self, router_logits):
        return sigmoid_group_topk(router_logits, self.exp_probs_b, self.config.num_experts_per_tok,
                                  1, 1, True, 1.0)


class MiniMaxM2Model(MoETransformer):
    moe_block = MiniMaxM2MoeBlock
