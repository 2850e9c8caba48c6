"""Model definitions: shared layers, the generic MoE block, one file per family. This module is
the registry: family string (ModelConfig.family) -> model class, imported on first use."""
import importlib

from ..errors import ModelError

# family -> (module in this package, class name)
FAMILIES = {
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeModel"),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeModel"),
    "mixtral": ("mixtral", "MixtralModel"),
    "olmoe": ("olmoe", "OlmoeModel"),
    "qwen3_next": ("qwen3_next", "Qwen3NextModel"),
    "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen35MoeModel"),
    "glm4_moe": ("glm4_moe", "Glm4MoeModel"),
    "gpt_oss": ("gpt_oss", "GptOssModel"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3Model"),
    "deepseek_v2": ("deepseek_v2", "DeepseekV2Model"),
    "qwen3_vl_moe": ("qwen3_vl_moe", "Qwen3VLMoeModel"),
    "dots1": ("dots1", "Dots1Model"),
    "ernie4_5_moe": ("ernie4_5_moe", "Ernie45MoeModel"),
    "hunyuan_v1_moe": ("hunyuan_v1_moe", "HunyuanV1MoeModel"),
    "minimax_m2": ("minimax_m2", "MiniMaxM2Model"),
    "granitemoe": ("granitemoe", "GraniteMoeModel"),
    "phimoe": ("phimoe", "PhimoeModel"),
    "llama4_text": ("llama4_text", "Llama4TextModel"),
}


def model_class(family: str):
    """The model class of `family`; ModelError for a family this version cannot run."""
    if family not in FAMILIES:
        raise ModelError(f"model family {family!r} is not supported; supported: "
                         f"{', '.join(sorted(FAMILIES))}")
    module, name = FAMILIES[family]
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
