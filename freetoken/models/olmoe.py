"""olmoe: qwen3_moe's routing (norm_topk_prob usually false); q/k RMSNorm over the whole
projection before the head split (qk_norm=full) and optional clip_qkv; no shared expert."""
from .qwen3_moe import Qwen3MoeBlock
from .transformer import MoETransformer


class OlmoeModel(MoETransformer):
    moe_block = Qwen3MoeBlock
