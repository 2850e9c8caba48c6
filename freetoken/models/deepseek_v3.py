"""deepseek_v3 (DeepSeek-V3 / R1 and their fine-tunes): multi-head latent attention (mla.py),
rotary on interleaved pairs unless rope_interleaved is off, YaRN with its softmax mscale; the
routing of glm4_moe (sigmoid scores, correction bias, expert groups, routed_scaling_factor; the
router kept fp32); ungated shared experts; dense MLP layers first (moe_layers)."""
from .glm4_moe import Glm4MoeBlock
from .mla import MLAttention
from .transformer import MoETransformer


class DeepseekV3Model(MoETransformer):
    moe_block = Glm4MoeBlock

    def mixer(self, config, layer):
        return MLAttention(config)
