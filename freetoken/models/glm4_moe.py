"""glm4_moe (GLM-4.5 / 4.6 / 4.7): sigmoid routing with a correction bias and expert groups
(moe.sigmoid_group_topk: num_expert_groups, num_topk_groups, norm_topk_prob,
routed_scaling_factor), the router linear, its correction bias and the scores in fp32 (kept fp32
when the model runs in bf16, as transformers keeps them); an ungated shared expert; dense MLP
layers first (moe_layers). Attention: partial rotary (layers.Attention), per-head q/k RMSNorm
when the config has it, biases on q/k/v as configured but none on attn_output."""
import torch
import torch.nn.functional as F
from torch import nn

from .moe import MoEBlock, sigmoid_group_topk
from .transformer import MoETransformer


class Glm4MoeBlock(MoEBlock):
    fp32_parameters = ("ffn_gate_inp.weight", "exp_probs_b")  # loader.py keeps these in fp32

    def __init__(self, config):
        super().__init__(config)
        self.exp_probs_b = nn.Parameter(torch.zeros(config.num_experts))  # correction bias [E]

    def router_logits(self, x):
        return F.linear(x.float(), self.ffn_gate_inp.weight.float())  # [T, E] fp32

    def route(self, router_logits):
        c = self.config
        return sigmoid_group_topk(router_logits, self.exp_probs_b, c.num_experts_per_tok,
                                  c.num_expert_groups, c.num_topk_groups, c.norm_topk_prob,
                                  c.routed_scaling_factor)


class Glm4MoeModel(MoETransformer):
    moe_block = Glm4MoeBlock
    output_bias_with_qkv = False  # attention_bias covers q/k/v only
