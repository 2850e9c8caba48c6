"""mixtral: softmax over all experts in fp32, top-k, always renormalised; the weights stay fp32
(unlike qwen3_moe, not rounded to the hidden dtype). No q/k norm, no shared expert."""
from .moe import MoEBlock, softmax_topk
from .transformer import MoETransformer


class MixtralMoeBlock(MoEBlock):
    def route(self, router_logits):
        return softmax_topk(router_logits, self.config.num_experts_per_tok, renormalize=True)


class MixtralModel(MoETransformer):
    moe_block = MixtralMoeBlock
