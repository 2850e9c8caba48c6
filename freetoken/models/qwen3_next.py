"""qwen3_next: qwen3_5_moe_text's model (qwen3_5_moe.py) with two differences: the DeltaNet in
projections are two, ssm_in_qkvz and ssm_in_ba, grouped per key head as published (for each of
the nk key heads: q [dk], k [dk], v [g dv], z [g dv]; and b [g], a [g]; g = nv / nk), regrouped
here on the activations; and dense MLP layers where mlp_only_layers / decoder_sparse_step say so
(the skeleton's), with norm_topk_prob as configured."""
import torch

from .layers import Linear
from .linear_attention import GatedDeltaNet
from .qwen3_5_moe import HybridQwenModel


class Qwen3NextDeltaNet(GatedDeltaNet):
    def __init__(self, config):
        super().__init__(config)
        D = config.hidden_size
        self.ssm_in_qkvz = Linear(D, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.ssm_in_ba = Linear(D, 2 * self.nv, bias=False)

    def project(self, x):
        T, nk, dk, g = x.shape[0], self.nk, self.dk, self.nv // self.nk
        q, k, v, z = self.ssm_in_qkvz(x).view(T, nk, 2 * dk + 2 * g * self.dv).split(
            [dk, dk, g * self.dv, g * self.dv], dim=-1)  # [T, nk, .] each
        b, a = self.ssm_in_ba(x).view(T, nk, 2 * g).split([g, g], dim=-1)  # [T, nk, g] x2
        qkv = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1)  # [T, C]
        return qkv, z.reshape(T, self.nv, self.dv), b.reshape(T, self.nv), a.reshape(T, self.nv)


class Qwen3NextModel(HybridQwenModel):
    delta_net = Qwen3NextDeltaNet
