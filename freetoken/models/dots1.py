"""dots1 (dots.llm1): qwen3_moe's attention (per-head q/k RMSNorm, full rotary, q/k/v/o biases
when attention_bias is set) with glm4_moe's MoE block: sigmoid routing with a correction bias in
expert groups, the router in fp32, routed_scaling_factor, ungated shared experts, dense MLP
layers first (moe_layers)."""
from .glm4_moe import Glm4MoeBlock
from .transformer import MoETransformer


class Dots1Model(MoETransformer):
    moe_block = Glm4MoeBlock
