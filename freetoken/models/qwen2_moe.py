"""qwen2_moe: qwen3_moe's routing, plus a shared expert scaled by sigmoid(ffn_gate_inp_shexp x)
(config shared_expert_intermediate_size, shared_expert_gate); q/k/v biases (attention_bias)
but none on attn_output; no q/k norm."""
from .qwen3_moe import Qwen3MoeBlock
from .transformer import MoETransformer


class Qwen2MoeModel(MoETransformer):
    moe_block = Qwen3MoeBlock
    output_bias_with_qkv = False  # HF qkv_bias covers q/k/v only
