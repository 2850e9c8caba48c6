"""qwen3_vl_moe (Qwen3-VL MoE), its text model: qwen3_moe's layers (softmax top-k in fp32, the
weights rounded to the hidden dtype, per-head q/k RMSNorm) with the top-k weights always
renormalised (hf_config sets norm_topk_prob) and q/k/v/o biases when attention_bias is set.
A text-only sequence has the same position on M-RoPE's three axes, where it is plain RoPE; the
vision tower and DeepStack's visual features are not run."""
from .qwen3_moe import Qwen3MoeModel


class Qwen3VLMoeModel(Qwen3MoeModel):
    """Qwen3MoeModel under its own family name (the config fields differ, not the layers)."""
