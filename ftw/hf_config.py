"""Normalise a Hugging Face config.json into the FTW `model.config` (docs/INTERFACES.md §1).

Both config styles are accepted: top-level `rope_theta`/`rope_scaling`/`torch_dtype` and
nested `rope_parameters`/`dtype`; `num_experts` and `num_local_experts`. Semantics follow the
transformers 5 configuration_*/modeling_* code of each family (read, not copied).
"""
from __future__ import annotations

from .errors import NotMoEModelError, UnknownArchitectureError, UnsupportedConfigError
from .names import FAMILIES, Family, supported_families

# default rope_theta when a config gives none (transformers `default_theta`)
_DEFAULT_THETA = {"mixtral": 1e6, "gpt_oss": 150000.0, "ernie4_5_moe": 500000.0,
                  "minimax_m2": 5e6, "phimoe": 1e6, "llama4_text": 500000.0}
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# top-k keys: ernie4_5_moe `moe_k`, hunyuan_v1_moe `moe_topk`
_TOPK_KEYS = ("num_experts_per_tok", "moe_k", "moe_topk")
# dense MLP layers before the first MoE layer when the config gives no first_k_dense_replace
_FIRST_DENSE_DEFAULT = {"glm4_moe": 1, "deepseek_v3": 3, "deepseek_v2": 0, "dots1": 0}
_ROPE_WITH_ORIGINAL_MAX = ("llama3", "yarn", "longrope")


# hybrid families: Gated DeltaNet layers between output-gated attention layers
_HYBRID = ("qwen3_next", "qwen3_5_moe_text")
_LAYER_TYPES = ("full_attention", "linear_attention")
_LINEAR_KEYS = ("linear_conv_kernel_dim", "linear_num_key_heads", "linear_num_value_heads",
                "linear_key_head_dim", "linear_value_head_dim")
# VLM configs whose language model is a supported family: model_type -> the text part's type
_VLM_TEXT = {"qwen3_5_moe": "qwen3_5_moe_text", "qwen3_vl_moe": "qwen3_vl_moe_text",
             "llama4": "llama4_text"}
# families of multi-head latent attention (MLA)
_MLA = ("deepseek_v3", "deepseek_v2")
# MLA models whose attention also picks, per query, the keys it reads (a lightning indexer):
# (model_type, architecture) -> the models. Refused: as deepseek_v3 they would convert and run wrong
_SPARSE_ATTENTION = {("deepseek_v32", "DeepseekV32ForCausalLM"): "DeepSeek-V3.2",
                     ("deepseek_v4", "DeepseekV4ForCausalLM"): "DeepSeek-V4",
                     ("glm_moe_dsa", "GlmMoeDsaForCausalLM"): "GLM-5"}


def text_part(cfg: dict) -> dict:
    """The language model's config: `text_config` of a supported VLM config (Qwen3.5/3.6 MoE,
    Qwen3-VL MoE),
    with the top level's token ids and embedding tying where the text part has none; any other
    config unchanged."""
    text = cfg.get("text_config")
    if cfg.get("model_type") not in _VLM_TEXT or not isinstance(text, dict):
        return cfg
    out = dict(text)
    out.setdefault("model_type", _VLM_TEXT[cfg["model_type"]])
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id"):
        if cfg.get(key) is not None and (key == "tie_word_embeddings" or out.get(key) is None):
            out[key] = cfg[key]  # the VLM ties its lm_head by the top-level flag
    return out


def detect_family(cfg: dict) -> Family:
    """The Family of a config.json: by `model_type`, else by `architectures`."""
    archs = cfg.get("architectures") or []
    cfg = text_part(cfg)
    model_type = cfg.get("model_type")
    for (sparse_type, sparse_arch), models in _SPARSE_ATTENTION.items():
        if model_type == sparse_type or sparse_arch in archs:
            raise UnknownArchitectureError(
                f"{sparse_type} ({models}) uses sparse attention (an indexer picks the keys each "
                "query attends to), which freetoken cannot run yet: it is refused rather than "
                "converted into a dense model that would run it wrong; supported: "
                f"{', '.join(supported_families())}")
    for fam in FAMILIES.values():
        if model_type in fam.model_types:
            return fam
    for fam in FAMILIES.values():
        if any(a in fam.architectures for a in archs):
            return fam
    what = model_type or (archs[0] if archs else "unknown")
    if not any(cfg.get(k) for k in _EXPERT_COUNT_KEYS):
        raise NotMoEModelError(
            f"{what} is a dense model (config.json has no experts); freetoken runs Mixture-of-"
            f"Experts models: {', '.join(supported_families())}")
    raise UnknownArchitectureError(
        f"unknown architecture {what!r}; supported: {', '.join(supported_families())}")


def normalise(cfg: dict, family: Family, generation_cfg: dict | None = None) -> dict:
    """The normalised model config (without `source_dtype`, which comes from the tensors)."""
    cfg = text_part(cfg)
    name = family.name
    get = cfg.get
    hidden, heads, layers = get("hidden_size"), get("num_attention_heads"), get("num_hidden_layers")
    for key, value in (("hidden_size", hidden), ("num_attention_heads", heads),
                       ("num_hidden_layers", layers), ("vocab_size", get("vocab_size"))):
        if not isinstance(value, int) or value < 1:
            raise UnsupportedConfigError(f"config.json: {key} is {value!r}, expected a positive integer")
    num_experts = _per_layer_scalar(cfg, next((k for k in _EXPERT_COUNT_KEYS
                                               if get(k) is not None), None), 0)
    top_k = _per_layer_scalar(cfg, next((k for k in _TOPK_KEYS if get(k) is not None), None), None)
    act = get("hidden_act", "silu")
    if act != "silu" and name != "gpt_oss":  # gpt_oss's experts ignore it (clamped SwiGLU)
        raise UnsupportedConfigError(f"hidden_act {act!r} is not supported (only silu)")
    rope_theta, rope_scaling = _rope(cfg, _DEFAULT_THETA.get(name, 10000.0))

    if name in ("qwen3_moe", "qwen2_moe", "qwen3_next", "qwen3_vl_moe"):
        mlp_only = set(get("mlp_only_layers") or [])
        step = get("decoder_sparse_step", 1) or 1
        moe_layers = [i for i in range(layers)
                      if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0]
        moe_inter = get("moe_intermediate_size")
    elif name in ("glm4_moe", "dots1", *_MLA):  # dense MLP layers first, then every layer sparse
        first_dense = get("first_k_dense_replace", _FIRST_DENSE_DEFAULT[name])
        moe_layers = [i for i in range(layers) if i >= first_dense] if num_experts > 0 else []
        moe_inter = get("moe_intermediate_size")
    elif name == "ernie4_5_moe":  # every interval-th layer within [start, end] is sparse
        start, end = get("moe_layer_start_index", 1), get("moe_layer_end_index", -1)
        end = layers - 1 if end == -1 else end
        interval = get("moe_layer_interval", 1) or 1
        moe_layers = [i for i in range(layers) if (i + 1) % interval == 0 and start <= i <= end
                      and num_experts > 0]
        moe_inter = get("moe_intermediate_size")
    elif name == "llama4_text":  # moe_layers, else every interleave_moe_layer_step-th layer
        step = get("interleave_moe_layer_step", 1) or 1
        listed = get("moe_layers")
        moe_layers = [i for i in range(layers) if (i in listed if listed is not None
                                                   else (i + 1) % step == 0)] if num_experts > 0 else []
        moe_inter = get("intermediate_size")
    elif name == "qwen3_5_moe_text":  # every layer is sparse (no mlp_only_layers)
        moe_layers = list(range(layers)) if num_experts > 0 else []
        moe_inter = get("moe_intermediate_size")
    else:  # mixtral, olmoe, gpt_oss, hunyuan_v1_moe, minimax_m2, granitemoe, phimoe: every
        # layer sparse, experts of the full FFN width
        moe_layers = list(range(layers)) if num_experts > 0 else []
        moe_inter = get("intermediate_size")
    if not moe_layers:
        raise NotMoEModelError(f"this {name} config has no MoE layers (num_experts={num_experts}); "
                               "freetoken runs Mixture-of-Experts models only")

    out = {
        "family": name,
        "vocab_size": get("vocab_size"),
        "hidden_size": hidden,
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": get("num_key_value_heads") or heads,
        "head_dim": get("head_dim") or hidden // heads,
        "rms_norm_eps": float(get("rms_norm_eps", 1e-5 if name in ("gpt_oss", "phimoe", "llama4_text")
                                  else 1e-6)),
        "rope_theta": float(rope_theta),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": get("max_position_embeddings"),
        "tie_word_embeddings": bool(get("tie_word_embeddings", False)),
        "attention_bias": bool(get("qkv_bias", True)) if name == "qwen2_moe"
        else bool(get("attention_bias", name == "gpt_oss")),
        "qk_norm": {"qwen3_moe": "per_head", "olmoe": "full", "qwen3_next": "per_head",
                    "qwen3_5_moe_text": "per_head", "qwen3_vl_moe": "per_head", "dots1": "per_head",
                    "glm4_moe": "per_head" if get("use_qk_norm") else "none",
                    "hunyuan_v1_moe": "per_head", "minimax_m2": "full"}.get(name, "none"),
        "clip_qkv": float(get("clip_qkv")) if name == "olmoe" and get("clip_qkv") is not None else None,
        "sliding_window": _sliding_window(cfg, name),
        "hidden_act": "silu",
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": moe_inter,
        "norm_topk_prob": _norm_topk_prob(cfg, name),
        "router_scoring": "softmax",
        "moe_layers": moe_layers,
        "intermediate_size": get("intermediate_size") or 0,
        "shared_expert_intermediate_size": get("shared_expert_intermediate_size", 0)
        if name in ("qwen2_moe", *_HYBRID) else 0,
        "shared_expert_gate": name in ("qwen2_moe", *_HYBRID),
        "bos_token_id": get("bos_token_id"),
        "eos_token_ids": _eos_ids(cfg, generation_cfg or {}),
    }
    if name in _HYBRID:
        out.update(_hybrid_fields(cfg, name, layers))
    elif name == "glm4_moe":
        out.update(_glm4_moe_fields(cfg, out))
    elif name == "gpt_oss":
        out.update(_gpt_oss_fields(cfg, layers))
    elif name in _MLA:
        out.update(_mla_fields(cfg, name, out))
    elif name == "dots1":
        out.update(_dots1_fields(cfg, out))
    elif name == "ernie4_5_moe":
        out.update(_ernie_fields(cfg, out))
    elif name == "hunyuan_v1_moe":
        out.update(_hunyuan_fields(cfg, out))
    elif name == "minimax_m2":
        out.update(_minimax_m2_fields(cfg, out))
    elif name == "granitemoe":
        out.update(_granitemoe_fields(cfg))
    elif name == "phimoe":
        out.update(_phimoe_fields(cfg, out))
    elif name == "llama4_text":
        out.update(_llama4_fields(cfg, out))
    elif _partial_rotary_factor(cfg, 1.0) != 1.0:
        raise UnsupportedConfigError(f"partial rotary (partial_rotary_factor) is not supported for {name}")
    for key in ("num_experts_per_tok", "moe_intermediate_size", "max_position_embeddings"):
        if not isinstance(out[key], int) or out[key] < 1:
            raise UnsupportedConfigError(f"config.json: {key} is {out[key]!r}, expected a positive integer")
    return out


def _norm_topk_prob(cfg: dict, name: str) -> bool:
    """Whether the top-k routing weights are renormalised to sum 1."""
    # their routers always divide by the sum
    if name in ("mixtral", "qwen3_5_moe_text", "qwen3_vl_moe", "ernie4_5_moe", "hunyuan_v1_moe",
                "minimax_m2"):
        return True
    # Qwen3NextConfig, Glm4MoeConfig and DeepseekV3Config default to true; the others to false
    return bool(cfg.get("norm_topk_prob", name in ("qwen3_next", "glm4_moe", "deepseek_v3")))


def _glm4_moe_fields(cfg: dict, out: dict) -> dict:
    """Sigmoid routing with expert groups, the ungated shared experts (n_shared_experts x
    moe_intermediate_size wide), partial rotary (transformers' default 0.5) and the number of
    multi-token-prediction layers the checkpoint appends (skipped by convert)."""
    groups, topk_groups = cfg.get("n_group") or 1, cfg.get("topk_group") or 1
    _check_groups(out, groups, topk_groups)
    partial = _partial_rotary_factor(cfg, 0.5)
    rotary_dim = int(out["head_dim"] * partial)  # as transformers rounds it
    if rotary_dim < 2 or rotary_dim % 2:
        raise UnsupportedConfigError(f"config.json: partial_rotary_factor {partial} of head_dim "
                                     f"{out['head_dim']} rotates {rotary_dim} dims; rotary needs pairs")
    shared = cfg.get("n_shared_experts", 1) or 0
    mtp = _num_mtp_layers(cfg)
    return {"router_scoring": "sigmoid", "num_expert_groups": groups, "num_topk_groups": topk_groups,
            "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0)),
            "shared_expert_intermediate_size": shared * (out["moe_intermediate_size"] or 0),
            "partial_rotary_factor": partial, "num_mtp_layers": mtp}


def _dots1_fields(cfg: dict, out: dict) -> dict:
    """glm4_moe's routing (sigmoid in groups, correction bias, routed_scaling_factor) and ungated
    shared experts, with Dots1Config's defaults (one group, no shared expert, scale 1); full
    rotary. Sliding-window layers (layer i >= max_window_layers when sliding_window is set) are
    refused: the published config has none."""
    groups, topk_groups = cfg.get("n_group") or 1, cfg.get("topk_group") or 1
    _check_groups(out, groups, topk_groups)
    if _partial_rotary_factor(cfg, 1.0) != 1.0:
        raise UnsupportedConfigError("partial rotary (partial_rotary_factor) is not supported for dots1")
    # Dots1Config's defaults: a window of 4096 on the layers from max_window_layers (62) on
    window, last_full = cfg.get("sliding_window", 4096), cfg.get("max_window_layers", 62)
    types = cfg.get("layer_types") or [
        "sliding_attention" if window is not None and i >= last_full else "full_attention"
        for i in range(out["num_layers"])]
    if "sliding_attention" in types:
        raise UnsupportedConfigError(
            "dots1 with sliding-window layers (sliding_window set and max_window_layers below "
            "num_hidden_layers, or sliding_attention in layer_types) is not supported yet; set "
            "max_window_layers to num_hidden_layers if the model was trained without them")
    shared = cfg.get("n_shared_experts") or 0
    return {"router_scoring": "sigmoid", "num_expert_groups": groups, "num_topk_groups": topk_groups,
            "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0)),
            "shared_expert_intermediate_size": shared * (out["moe_intermediate_size"] or 0)}
def _per_layer_scalar(cfg: dict, key, default):
    """cfg[key], where a per-layer list (Hunyuan's num_experts / moe_topk may be one) must hold
    one value: freetoken runs the same expert count and top-k in every MoE layer."""
    if key is None:
        return default
    value = cfg[key]
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise UnsupportedConfigError(f"config.json: {key} {value!r} differs between layers; "
                                         "freetoken runs one value in every MoE layer")
        return value[0]
    return value


def _ernie_fields(cfg: dict, out: dict) -> dict:
    """Softmax routing chosen with the correction bias, divided by max(sum, moe_norm_min);
    ungated shared experts (moe_num_shared_experts x moe_intermediate_size); rotary on
    interleaved pairs. Biases on the projections (use_bias) are refused."""
    if cfg.get("use_bias"):
        raise UnsupportedConfigError("ernie4_5_moe with use_bias (biases on every projection) is "
                                     "not supported; the released ERNIE-4.5 MoE models have none")
    if _partial_rotary_factor(cfg, 1.0) != 1.0:
        raise UnsupportedConfigError("partial rotary (partial_rotary_factor) is not supported for "
                                     "ernie4_5_moe")
    shared = cfg.get("moe_num_shared_experts", 2) or 0
    norm_min = cfg.get("moe_norm_min", 1e-12)
    return {"router_scoring": "softmax_bias", "moe_norm_min": float(norm_min),
            "shared_expert_intermediate_size": shared * (out["moe_intermediate_size"] or 0),
            "rope_interleaved": True, "attention_bias": False}


def _hunyuan_fields(cfg: dict, out: dict) -> dict:
    """One ungated shared MLP of the experts' width (intermediate_size) in every layer, q/k
    norms after the rotary, rope `dynamic` with `alpha` as a fixed base (transformers'
    ntk_alpha). Cross-layer attention (use_cla) is refused."""
    if cfg.get("use_cla"):
        raise UnsupportedConfigError("hunyuan_v1_moe with use_cla (KV shared across layers) is "
                                     "not supported")
    if _partial_rotary_factor(cfg, 1.0) != 1.0:
        raise UnsupportedConfigError("partial rotary (partial_rotary_factor) is not supported for "
                                     "hunyuan_v1_moe")
    fields = {"shared_expert_intermediate_size": out["moe_intermediate_size"],
              "qk_norm_after_rope": True}
    scaling = out["rope_scaling"] or {}
    if scaling.get("rope_type") == "dynamic" and scaling.get("alpha"):
        # transformers' ntk_alpha (the hub labels it dynamic): a fixed larger base, plain RoPE
        hd = out["head_dim"]
        fields.update(rope_theta=out["rope_theta"] * float(scaling["alpha"]) ** (hd / (hd - 2)),
                      rope_scaling=None)
    return fields


def _minimax_m2_fields(cfg: dict, out: dict) -> dict:
    """Sigmoid routing whose expert choice adds the correction bias, always renormalised, no
    groups (transformers hard-codes it; the hub's scoring_func / use_routing_bias say so); q/k
    RMSNorm over the whole projection; rotary on the first rotary_dim dims of a head (the hub's
    `rotary_dim`, transformers 5's partial_rotary_factor); the multi-token-prediction layers the
    checkpoint may append (num_mtp_modules), skipped by convert. FP8 weights (block scales in
    *.weight_scale_inv) are read as convert reads any FP8 checkpoint (ftw/convert.py)."""
    for key, want in (("scoring_func", "sigmoid"), ("use_routing_bias", True),
                      ("use_qk_norm", True), ("qk_norm_type", "per_layer")):
        if cfg.get(key, want) != want:
            raise UnsupportedConfigError(f"minimax_m2 with {key} {cfg[key]!r} is not supported "
                                         f"(only {want!r}, as MiniMax-M2 and transformers)")
    rotary_dim = cfg.get("rotary_dim")
    partial = (rotary_dim / out["head_dim"] if isinstance(rotary_dim, int)
               else _partial_rotary_factor(cfg, 1.0))
    _check_rotary_dim(out["head_dim"], partial)
    return {"router_scoring": "sigmoid", "num_expert_groups": 1, "num_topk_groups": 1,
            "routed_scaling_factor": 1.0, "partial_rotary_factor": partial,
            "num_mtp_layers": cfg.get("num_mtp_modules") or 0}


def _granitemoe_fields(cfg: dict) -> dict:
    """The top-k of the router's logits weighted by the softmax over those k; the four scalar
    multipliers (GraniteMoeConfig's defaults 1.0), each a positive number."""
    out = {"router_scoring": "softmax_of_topk"}
    for key in ("attention_multiplier", "embedding_multiplier", "residual_multiplier",
                "logits_scaling"):
        value = cfg.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise UnsupportedConfigError(f"config.json: {key} is {value!r}, expected a positive number")
        out[key] = float(value)
    return out


def _phimoe_fields(cfg: dict, out: dict) -> dict:
    """The sparsemixer route (transformers picks exactly 2 experts, one at a time, each weighted
    within the experts whose logits lie within 2 x router_jitter_noise of its own, relative:
    PhimoeConfig's default 0.01), LayerNorms with biases, the output head's bias (lm_head_bias).
    Refused: another top-k, a rope scaling other than longrope (Phi-3.5-MoE's), an output bias
    with tied embeddings."""
    if out["num_experts_per_tok"] != 2:
        raise UnsupportedConfigError(f"phimoe with num_experts_per_tok {out['num_experts_per_tok']} "
                                     "is not supported: its sparsemixer routing takes exactly 2 "
                                     "experts (as transformers runs it)")
    jitter = cfg.get("router_jitter_noise", 0.01)
    if isinstance(jitter, bool) or not isinstance(jitter, (int, float)) or jitter < 0:
        raise UnsupportedConfigError(f"config.json: router_jitter_noise is {jitter!r}, expected a "
                                     "number >= 0")
    scaling = out["rope_scaling"]
    if scaling is not None:
        _check_phimoe_longrope(scaling, out["head_dim"])
    output_bias = bool(cfg.get("lm_head_bias", False))
    if output_bias and out["tie_word_embeddings"]:
        raise UnsupportedConfigError("phimoe with lm_head_bias and tie_word_embeddings is not "
                                     "supported (a tied head with a bias of its own)")
    if _partial_rotary_factor(cfg, 1.0) != 1.0:
        raise UnsupportedConfigError("partial rotary (partial_rotary_factor) is not supported for phimoe")
    return {"router_scoring": "sparsemixer", "router_jitter_noise": float(jitter),
            "layer_norm": True, "output_bias": output_bias}


def _llama4_fields(cfg: dict, out: dict) -> dict:
    """Top-1 routing on the expert's input (sigmoid of the logit), one ungated shared expert of
    the experts' width, dense layers intermediate_size_mlp wide; rotary on interleaved pairs;
    the layers without rotary (no_rope_layers, else every no_rope_layer_interval-th), the
    chunked layers (layer_types, else the rotary ones when attention_chunk_size is set), the q/k
    norm and the temperature, with Llama4TextConfig's defaults. Refused: top-k above 1, a
    quantized checkpoint, layer types other than full and chunked attention."""
    get, layers = cfg.get, out["num_layers"]
    quant = get("quantization_config") or {}
    if quant:
        raise UnsupportedConfigError(
            f"this llama4 checkpoint is quantized ({quant.get('quant_method', quant)!r}), which "
            "convert does not take; convert its bf16 release")
    if out["num_experts_per_tok"] != 1:
        raise UnsupportedConfigError(
            f"llama4_text with num_experts_per_tok {out['num_experts_per_tok']} is not supported: "
            "freetoken runs Llama 4's routing (the expert's input scaled by its score) for top-1 "
            "only, as the released Llama 4 models use")
    if _partial_rotary_factor(cfg, 1.0) != 1.0:
        raise UnsupportedConfigError("partial rotary (partial_rotary_factor) is not supported for llama4_text")
    uses_rope = get("no_rope_layers") or [int((i + 1) % (get("no_rope_layer_interval", 4) or 4) != 0)
                                          for i in range(layers)]
    if len(uses_rope) < layers or any(v not in (0, 1) for v in uses_rope[:layers]):
        raise UnsupportedConfigError(f"config.json: no_rope_layers must list 0 or 1 for each of the "
                                     f"{layers} layers; got {uses_rope!r}")
    chunk = get("attention_chunk_size", 8192)
    types = get("layer_types") or ["chunked_attention" if use and chunk is not None else "full_attention"
                                   for use in uses_rope[:layers]]
    allowed = ("full_attention", "chunked_attention")
    if len(types) != layers or any(t not in allowed for t in types):
        raise UnsupportedConfigError(f"config.json: layer_types must list {layers} entries, each one "
                                     f"of {', '.join(allowed)}; got {types!r}")
    if "chunked_attention" in types and (not isinstance(chunk, int) or chunk < 1):
        raise UnsupportedConfigError(f"config.json: attention_chunk_size is {chunk!r}, expected a "
                                     "positive integer (the chunked_attention layers' chunk)")
    head_dim = get("head_dim", 128) or out["hidden_size"] // out["num_heads"]  # the config's default
    return {"router_scoring": "sigmoid_input", "norm_topk_prob": False,
            "intermediate_size": get("intermediate_size_mlp", 16384),
            "shared_expert_intermediate_size": out["moe_intermediate_size"],
            "head_dim": head_dim, "rope_interleaved": True,
            "no_rope_layers": [i for i in range(layers) if not uses_rope[i]],
            "layer_types": list(types),
            "attention_chunk_size": chunk if "chunked_attention" in types else None,
            "qk_l2_norm": bool(get("use_qk_norm", True)),
            "attn_temperature_tuning": bool(get("attn_temperature_tuning", True)),
            "floor_scale": int(get("floor_scale", 8192)), "attn_scale": float(get("attn_scale", 0.1))}


def _check_phimoe_longrope(scaling: dict, head_dim: int) -> None:
    """UnsupportedConfigError unless phimoe's rope scaling is longrope with a short and a long
    factor per rotary frequency and both mscales: transformers' phimoe scales the cos/sin of
    any other rope type by them too, which freetoken does not run."""
    if scaling.get("rope_type") != "longrope":
        raise UnsupportedConfigError(
            f"phimoe with rope_scaling {scaling.get('rope_type')!r} is not supported; freetoken "
            "runs phimoe with plain rope or longrope (Phi-3.5-MoE's)")
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if (not isinstance(factors, list) or len(factors) != head_dim // 2
                or not all(isinstance(f, (int, float)) and f > 0 for f in factors)):
            raise UnsupportedConfigError(f"config.json: rope_scaling {key} must list {head_dim // 2} "
                                         f"positive numbers (one per rotary frequency); got {factors!r}")
    for key in ("short_mscale", "long_mscale"):
        if isinstance(scaling.get(key), bool) or not isinstance(scaling.get(key), (int, float)):
            raise UnsupportedConfigError(f"config.json: rope_scaling {key} is {scaling.get(key)!r}, "
                                         "expected a number")


def _check_rotary_dim(head_dim: int, partial: float) -> None:
    """UnsupportedConfigError unless head_dim * partial (as transformers rounds it) is a whole
    positive number of pairs within the head."""
    rotary_dim = int(head_dim * partial)
    if rotary_dim < 2 or rotary_dim % 2 or not 0 < partial <= 1:
        raise UnsupportedConfigError(f"config.json: partial rotary {partial} of head_dim "
                                     f"{head_dim} rotates {rotary_dim} dims; rotary needs pairs")


def _gpt_oss_fields(cfg: dict, num_layers: int) -> dict:
    """Attention sinks; sliding-window layers between full ones (layer_types, else transformers'
    default: even layers slide); the router's bias, softmax over its top-k logits; experts with
    biases and the clamped SwiGLU (swiglu_alpha, swiglu_limit). The hub's MXFP4 experts
    (quant_method mxfp4) are taken as published (convert copies them into mxfp4 banks); other
    quantizations are refused."""
    quant = cfg.get("quantization_config") or {}
    if quant and quant.get("quant_method") != "mxfp4":
        raise UnsupportedConfigError(
            f"this gpt_oss checkpoint is quantized as {quant.get('quant_method', quant)!r}, which "
            "convert does not read; convert the hub's MXFP4 release or a bf16 checkpoint of the model")
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                       for i in range(num_layers)]
    allowed = ("sliding_attention", "full_attention")
    if len(types) != num_layers or any(t not in allowed for t in types):
        raise UnsupportedConfigError(f"config.json: layer_types must list {num_layers} entries, "
                                     f"each one of {', '.join(allowed)}; got {types!r}")
    window = cfg.get("sliding_window")
    if "sliding_attention" in types and (not isinstance(window, int) or window < 1):
        raise UnsupportedConfigError(f"config.json: sliding_window is {window!r}, expected a "
                                     "positive integer (the sliding_attention layers' window)")
    out = {}
    if not (cfg.get("rope_scaling") or cfg.get("rope_parameters")):  # GptOssConfig's default
        out["rope_scaling"] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False,
                               "original_max_position_embeddings": 4096}
    return {**out, "layer_types": list(types),
            "layer_window": window if "sliding_attention" in types else None,
            "attn_sinks": True, "router_scoring": "softmax_of_topk", "router_bias": True,
            "expert_bias": True, "expert_act": "clamped_swiglu",
            "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)),
            "swiglu_limit": float(cfg.get("swiglu_limit", 7.0))}


def _check_groups(out: dict, groups, topk_groups) -> None:
    """UnsupportedConfigError unless n_group / topk_group split the experts into equal groups of
    2 or more, and num_experts_per_tok fits in topk_group groups."""
    E, k = out["num_experts"], out["num_experts_per_tok"]
    if (not isinstance(groups, int) or not isinstance(topk_groups, int) or E % groups
            or E // groups < 2 or not 1 <= topk_groups <= groups):
        raise UnsupportedConfigError(
            f"config.json: n_group {groups!r} / topk_group {topk_groups!r} do not fit "
            f"{E} experts (n_group must divide them into groups of 2 or more, and "
            "1 <= topk_group <= n_group)")
    if isinstance(k, int) and k > topk_groups * (E // groups):
        raise UnsupportedConfigError(f"config.json: num_experts_per_tok {k} is more than the "
                                     f"{topk_groups * (E // groups)} experts of topk_group groups")


def _num_mtp_layers(cfg: dict) -> int:
    """The multi-token-prediction layers appended after the decoder's (HF
    num_nextn_predict_layers; transformers 5 also writes num_mtp_layers)."""
    return cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0)) or 0


def _mla_fields(cfg: dict, name: str, out: dict) -> dict:
    """Multi-head latent attention's shapes (head_dim = the rope dims, as transformers), the
    routing (deepseek_v3: glm4_moe's sigmoid groups; deepseek_v2: softmax, greedy or
    group_limited_greedy, never renormalised, as transformers), the ungated shared experts
    (n_shared_experts x moe_intermediate_size) and the multi-token-prediction layers the
    checkpoint appends (skipped by convert). Defaults are transformers' per family. FP8
    releases (DeepSeek-V3's) are read as convert reads any FP8 checkpoint (ftw/convert.py)."""
    get = cfg.get
    shapes = {}
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        value = get(key)
        if not isinstance(value, int) or value < 1:
            raise UnsupportedConfigError(f"config.json: {key} is {value!r}, expected a positive integer")
        shapes[key] = value
    if shapes["qk_rope_head_dim"] % 2:
        raise UnsupportedConfigError(f"config.json: qk_rope_head_dim {shapes['qk_rope_head_dim']} "
                                     "is odd; rotary needs pairs")
    q_lora = get("q_lora_rank") or 0
    if not isinstance(q_lora, int) or q_lora < 0:
        raise UnsupportedConfigError(f"config.json: q_lora_rank is {q_lora!r}, expected null or a "
                                     "positive integer")
    if get("mlp_bias"):
        raise UnsupportedConfigError(f"{name} with mlp_bias (biases on the MLP projections) is "
                                     "not supported")
    if _partial_rotary_factor(cfg, 1.0) != 1.0:
        raise UnsupportedConfigError(f"partial rotary (partial_rotary_factor) is not supported for {name}")
    is_v3 = name == "deepseek_v3"
    if is_v3:  # sigmoid routing in groups
        groups, topk_groups = get("n_group", 8) or 1, get("topk_group", 4) or 1
        routing = {"router_scoring": "sigmoid", "norm_topk_prob": out["norm_topk_prob"]}
    else:
        method = get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise UnsupportedConfigError(f"config.json: topk_method {method!r} is not supported "
                                         "for deepseek_v2 (greedy, group_limited_greedy)")
        groups, topk_groups = (1, 1) if method == "greedy" else (get("n_group"), get("topk_group"))
        routing = {"router_scoring": "softmax", "norm_topk_prob": False}  # (transformers ignores it)
    _check_groups(out, groups, topk_groups)
    shared = get("n_shared_experts", 1 if is_v3 else 2) or 0
    return {**routing, "num_expert_groups": groups, "num_topk_groups": topk_groups,
            "routed_scaling_factor": float(get("routed_scaling_factor", 2.5 if is_v3 else 1.0)),
            "shared_expert_intermediate_size": shared * (out["moe_intermediate_size"] or 0),
            "head_dim": shapes["qk_rope_head_dim"], "kv_lora_rank": shapes["kv_lora_rank"],
            "q_lora_rank": q_lora, "qk_nope_head_dim": shapes["qk_nope_head_dim"],
            "v_head_dim": shapes["v_head_dim"],
            # deepseek_v2 rotates pairs always, deepseek_v3 unless rope_interleave is false
            "rope_interleaved": not is_v3 or bool(get("rope_interleave", True)),
            "num_mtp_layers": _num_mtp_layers(cfg)}


def _hybrid_fields(cfg: dict, name: str, num_layers: int) -> dict:
    """layer_types, partial rotary, the output gate and the Gated DeltaNet shapes of a hybrid
    family. Without layer_types, every full_attention_interval-th layer is attention (the
    published Qwen3-Next configs; transformers' default interval is 4)."""
    types = cfg.get("layer_types")
    if types is None:
        interval = cfg.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(num_layers)]
    if len(types) != num_layers or any(t not in _LAYER_TYPES for t in types):
        raise UnsupportedConfigError(
            f"config.json: layer_types must list {num_layers} entries, each one of "
            f"{', '.join(_LAYER_TYPES)}; got {types!r}")
    if cfg.get("attn_output_gate", True) is not True:
        raise UnsupportedConfigError(f"{name} without the attention output gate (attn_output_gate: "
                                     f"{cfg['attn_output_gate']!r}) is not supported")
    out = {"layer_types": list(types), "attn_output_gate": True,
           "partial_rotary_factor": _partial_rotary_factor(cfg, 0.25)}
    for key in _LINEAR_KEYS:
        value = cfg.get(key)
        if not isinstance(value, int) or value < 1:
            raise UnsupportedConfigError(f"config.json: {key} is {value!r}, expected a positive integer")
        out[key] = value
    if out["linear_num_value_heads"] % out["linear_num_key_heads"]:
        raise UnsupportedConfigError("config.json: linear_num_value_heads must be a multiple of "
                                     "linear_num_key_heads")
    return out


def _partial_rotary_factor(cfg: dict, default: float) -> float:
    """partial_rotary_factor from rope_parameters / rope_scaling, else the top level (published
    configs), else the family's default (transformers sets 0.25 for the hybrid Qwen families)."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    value = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default))
    if not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise UnsupportedConfigError(f"config.json: partial_rotary_factor {value!r} is not in (0, 1]")
    return float(value)


def _rope(cfg: dict, default_theta: float):
    """(rope_theta, rope_scaling) from either style; rope_scaling is None for plain RoPE.

    Like transformers: a legacy `rope_scaling` dict wins over `rope_parameters`; a theta inside
    the dict wins over a top-level `rope_theta`; `type` is the old spelling of `rope_type`.
    """
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedConfigError("per-layer-type rope_parameters are not supported yet")
    theta = params.pop("rope_theta", None)
    params.pop("partial_rotary_factor", None)  # not a scaling: _partial_rotary_factor reads it
    # M-RoPE (Qwen3.5 VLM): a text-only sequence has the same position on its three axes, where
    # the sections' interleaving is plain RoPE
    params.pop("mrope_section", None)
    params.pop("mrope_interleaved", None)
    if theta is None:
        theta = cfg.get("rope_theta", default_theta)
    legacy_type = params.pop("type", None)
    params.setdefault("rope_type", legacy_type or "default")
    if params["rope_type"] in _ROPE_WITH_ORIGINAL_MAX:
        top = cfg.get("original_max_position_embeddings")  # Phi-style configs: it wins, as in
        if top is not None:  # transformers' standardize_rope_params
            params["original_max_position_embeddings"] = top
        params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    if params["rope_type"] == "default" and len(params) == 1:
        return theta, None
    return theta, params


def _sliding_window(cfg: dict, name: str):
    if name == "qwen3_moe":  # Qwen3MoeConfig: sliding_window only when use_sliding_window
        return cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    if name == "qwen2_moe":
        if cfg.get("use_sliding_window"):  # per-layer pattern (layer_types / max_window_layers)
            raise UnsupportedConfigError("qwen2_moe with use_sliding_window=true (sliding window on "
                                         "some layers only) is not supported yet")
        return None
    if name in ("mixtral", "phimoe"):  # used on every layer whenever set
        return cfg.get("sliding_window")
    return None  # olmoe has no sliding window


def _eos_ids(cfg: dict, generation_cfg: dict) -> list:
    ids = []
    for source in (cfg.get("eos_token_id"), generation_cfg.get("eos_token_id")):
        for i in source if isinstance(source, list) else [source]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids
