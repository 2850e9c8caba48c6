"""qwen3_5_moe_text (Qwen3.5/3.6 MoE, also the text model of the VLM checkpoints): a hybrid of
Gated DeltaNet layers (linear_attention.py) and output-gated attention with partial rotary
(gated_attention.py), per config layer_types; every RMSNorm but the DeltaNet's gated one computes
x * (1 + w); qwen3_moe's routing, always renormalised; a shared expert scaled by
sigmoid(ffn_gate_inp_shexp x). The DeltaNet in projections are four: qkv, z, b, a."""
from .gated_attention import GatedAttention, OffsetRMSNorm
from .layers import Linear
from .linear_attention import GatedDeltaNet
from .qwen3_moe import Qwen3MoeBlock
from .transformer import MoETransformer


class Qwen35DeltaNet(GatedDeltaNet):
    def __init__(self, config):
        super().__init__(config)
        D = config.hidden_size
        self.ssm_in_qkv = Linear(D, 2 * self.key_dim + self.value_dim, bias=False)
        self.ssm_in_z = Linear(D, self.value_dim, bias=False)
        self.ssm_in_b = Linear(D, self.nv, bias=False)
        self.ssm_in_a = Linear(D, self.nv, bias=False)

    def project(self, x):
        z = self.ssm_in_z(x).view(x.shape[0], self.nv, self.dv)
        return self.ssm_in_qkv(x), z, self.ssm_in_b(x), self.ssm_in_a(x)


class HybridQwenModel(MoETransformer):
    """The skeleton of both hybrid Qwen families; `delta_net` is the family's DeltaNet class."""
    moe_block = Qwen3MoeBlock
    norm = OffsetRMSNorm
    delta_net = Qwen35DeltaNet

    def mixer(self, config, layer):
        return self.delta_net(config) if config.is_linear_layer(layer) else GatedAttention(config)


class Qwen35MoeModel(HybridQwenModel):
    pass
