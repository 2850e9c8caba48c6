"""gpt_oss: the router has a bias and takes the top-k of its logits, weighted by the softmax
over those k alone (in the hidden dtype, as transformers); attention has biases on q/k/v/o and
a learned sink logit per head, and the layers whose layer_types entry is sliding_attention see
only the last layer_window tokens (layers.Attention: window, sinks). The experts' biases and
their clamped SwiGLU are data of the expert layer (kernel_args.ExpertAct, the bank's bias
projections), not code here. No shared expert."""
import torch

from .layers import Attention, Linear
from .moe import MoEBlock
from .transformer import MoETransformer


def softmax_of_topk(router_logits: torch.Tensor, k: int):
    """The top k logits, then the softmax over those k in the logits' dtype.
    -> (expert_ids [T, K] int64, weights [T, K] fp32)."""
    top, expert_ids = torch.topk(router_logits, k, dim=-1)  # [T, K]
    return expert_ids, torch.softmax(top, dim=-1).float()


class GptOssMoeBlock(MoEBlock):
    def __init__(self, config):
        super().__init__(config)
        self.ffn_gate_inp = Linear(config.hidden_size, config.num_experts, bias=True)  # router

    def route(self, router_logits):
        return softmax_of_topk(router_logits, self.config.num_experts_per_tok)


class GptOssModel(MoETransformer):
    moe_block = GptOssMoeBlock

    def mixer(self, config, layer: int):
        return Attention(config, config.attention_bias, window=config.attention_window(layer),
                         sinks=config.attn_sinks)
