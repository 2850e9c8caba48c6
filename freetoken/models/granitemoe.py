"""granitemoe (Granite 3.x MoE): the top-k of the router's logits, weighted by the softmax over
those k in fp32, rounded to the hidden dtype (as transformers); the embeddings times
embedding_multiplier, each block's attention and MLP outputs times residual_multiplier, the
attention softmax scaled by attention_multiplier (layers.Attention), the logits divided by
logits_scaling. No q/k norm, no shared expert."""
import torch
import torch.nn.functional as F

from .layers import Embedding
from .moe import MoEBlock
from .qwen3_moe import round_to
from .transformer import BatchStep, Block, MoETransformer, mix_rows


class GraniteMoeBlock(MoEBlock):
    def route(self, router_logits):
        top, expert_ids = torch.topk(router_logits.float(), self.config.num_experts_per_tok, dim=-1)
        return expert_ids, round_to(torch.softmax(top, dim=-1), router_logits.dtype)  # [T, K] x2


class GraniteBlock(Block):
    """Block whose attention and MLP outputs are scaled by residual_multiplier before they join
    the residual stream."""

    def __init__(self, config, *args):
        super().__init__(config, *args)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, h, step, pending=None):
        m = self.residual_multiplier
        h, x = self.attn_norm.add_forward(h, pending)
        mixed = (mix_rows(self.attn, x, self.layer, step) if isinstance(step, BatchStep)
                 else self.attn(x, self.layer, step))
        h, x = self.ffn_norm.add_forward(h, mixed * m)
        return h, self.ffn(x, self.layer, step) * m


class ScaledEmbedding(Embedding):
    """Embedding rows times a constant (the head, when tied, reads the unscaled weight)."""

    def __init__(self, num: int, dim: int, multiplier: float):
        super().__init__(num, dim)
        self.multiplier = multiplier

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.multiplier


class GraniteMoeModel(MoETransformer):
    moe_block = GraniteMoeBlock
    block = GraniteBlock

    def __init__(self, config, expert_runtime):
        super().__init__(config, expert_runtime)
        self.token_embd = ScaledEmbedding(config.vocab_size, config.hidden_size,
                                          config.embedding_multiplier)

    def head(self, h):
        weight = self.token_embd.weight if self.config.tie_word_embeddings else self.output.weight
        return (F.linear(h, weight) / self.config.logits_scaling).float()  # [T, V]
