"""ernie4_5_moe (ERNIE-4.5 MoE text models): softmax routing whose expert choice adds the
correction bias ([1, E], as published) to the probabilities, the weights divided by
max(sum, moe_norm_min) (moe.softmax_bias_topk); the router and the bias kept fp32 (as
transformers keeps them); ungated shared experts; dense MLP layers outside the MoE span
(moe_layers). Attention: GQA with rotary on interleaved pairs (rope_interleaved), no biases."""
import torch
import torch.nn.functional as F
from torch import nn

from .moe import MoEBlock, softmax_bias_topk
from .transformer import MoETransformer


class Ernie45MoeBlock(MoEBlock):
    fp32_parameters = ("ffn_gate_inp.weight", "exp_probs_b")  # loader.py keeps these in fp32

    def __init__(self, config):
        super().__init__(config)
        self.exp_probs_b = nn.Parameter(torch.zeros(1, config.num_experts))  # correction bias

    def router_logits(self, x):
        return F.linear(x.float(), self.ffn_gate_inp.weight.float())  # [T, E] fp32

    def route(self, router_logits):
        c = self.config
        return softmax_bias_topk(router_logits, self.exp_probs_b, c.num_experts_per_tok,
                                 c.moe_norm_min)


class Ernie45MoeModel(MoETransformer):
    moe_block = Ernie45MoeBlock
