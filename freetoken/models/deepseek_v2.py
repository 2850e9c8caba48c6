"""deepseek_v2 (DeepSeek-V2, V2-Lite, V2.5, Coder-V2): multi-head latent attention (mla.py),
rotary on interleaved pairs; softmax routing, greedy or limited to the best groups
(moe.softmax_group_topk), the weights never renormalised but times routed_scaling_factor, the
router kept fp32; ungated shared experts; dense MLP layers first (moe_layers)."""
import torch.nn.functional as F

from .mla import MLAttention
from .moe import MoEBlock, softmax_group_topk
from .transformer import MoETransformer


class DeepseekV2Block(MoEBlock):
    fp32_parameters = ("ffn_gate_inp.weight",)  # loader.py keeps it in fp32

    def router_logits(self, x):
        return F.linear(x.float(), self.ffn_gate_inp.weight.float())  # [T, E] fp32

    def route(self, router_logits):
        c = self.config
        return softmax_group_topk(router_logits, c.num_experts_per_tok, c.num_expert_groups,
                                  c.num_topk_groups, c.routed_scaling_factor)


class DeepseekV2Model(MoETransformer):
    moe_block = DeepseekV2Block

    def mixer(self, config, layer):
        return MLAttention(config)
