"""hunyuan_v1_moe (Hunyuan MoE): softmax over all experts in fp32, top-k, always renormalised
(moe.softmax_topk), the router kept fp32 (as transformers builds it); one ungated shared MLP as
wide as the experts in every layer; per-head q/k RMSNorm after the rotary
(qk_norm_after_rope)."""
import torch.nn.functional as F

from .moe import MoEBlock, softmax_topk
from .transformer import MoETransformer


class HunyuanV1MoeBlock(MoEBlock):
    fp32_parameters = ("ffn_gate_inp.weight",)  # loader.py keeps it in fp32

    def router_logits(self, x):
        return F.linear(x.float(), self.ffn_gate_inp.weight.float())  # [T, E] fp32

    def route(self, router_logits):
        return softmax_topk(router_logits, self.config.num_experts_per_tok, True)


class HunyuanV1MoeModel(MoETransformer):
    moe_block = HunyuanV1MoeBlock
