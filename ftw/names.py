"""Canonical FTW tensor names (docs/INTERFACES.md §2) and one name table per HF family.

The only place Hugging Face tensor names appear. A family is a table: adding one (gpt_oss) means
adding a Family entry, plus its config rules in hf_config.py. Names match whole templates only (`{i}` layer, `{e}` expert); never substrings.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

PROJECTIONS = ("gate", "up", "down")
BIAS_PROJECTIONS = ("gate_bias", "up_bias", "down_bias")  # vectors [I], [I], [D] (gpt_oss)


@dataclass(frozen=True)
class FusedExperts:
    """One stacked source tensor holding projection(s) of every expert of a layer.

    transposed=False: [E, out, in] (nn.Linear per expert; transformers 5 `gate_up_proj`).
    transposed=True:  [E, in, out] (gpt_oss, llama4); the converter transposes each expert.
    With two projections (gate, up) the `out` axis holds gate then up (halves), or alternating
    rows gate0, up0, gate1, ... when interleaved=True (gpt_oss).
    Bias projections (BIAS_PROJECTIONS) are [E, out]: the same with no `in` axis.
    part="blocks" / "scales": one half of a published MXFP4 weight (gpt-oss, SPEC.md §9.1), uint8
    [E, out, in/32, 16] e2m1 pairs / [E, out, in/32] e8m0, whose rows are copied into mxfp4 banks.
    """
    hf: str
    projections: tuple
    transposed: bool = False
    interleaved: bool = False
    part: str = ""  # "", or "blocks" / "scales" of an MXFP4 weight

    @property
    def is_bias(self) -> bool:
        return self.projections[0] in BIAS_PROJECTIONS


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple            # config.json `model_type` values
    architectures: tuple          # config.json `architectures` fallback
    tensors: dict                 # HF template -> canonical template
    per_expert: dict              # projection -> HF template with {i} and {e}
    fused: tuple = ()             # FusedExperts
    ignore: tuple = ()            # (regex (full match), reason) of tensors inference never uses
    prefixes: tuple = ()          # (source prefix, prefix the table uses): e.g. a VLM's text model
    refuse: tuple = ()            # (regex (full match), what to do) of tensors convert cannot take yet
    _compiled: list = field(default=None, compare=False, repr=False)


# --- shared pieces of the tables ---------------------------------------------------------
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_L = "model.layers.{i}."
_ATTN = {
    _L + "input_layernorm.weight": "blk.{i}.attn_norm.weight",
    _L + "self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    _L + "self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    _L + "self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    _L + "self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    _L + "post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
}
_ATTN_BIAS = {
    _L + "self_attn.q_proj.bias": "blk.{i}.attn_q.bias",
    _L + "self_attn.k_proj.bias": "blk.{i}.attn_k.bias",
    _L + "self_attn.v_proj.bias": "blk.{i}.attn_v.bias",
}
_O_BIAS = {_L + "self_attn.o_proj.bias": "blk.{i}.attn_output.bias"}
_QK_NORM = {
    _L + "self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    _L + "self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
}
_ROUTER = {_L + "mlp.gate.weight": "blk.{i}.ffn_gate_inp.weight"}
_DENSE_MLP = {
    _L + "mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    _L + "mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    _L + "mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}
_SHARED_EXPERT = {
    _L + "mlp.shared_expert.gate_proj.weight": "blk.{i}.ffn_gate_shexp.weight",
    _L + "mlp.shared_expert.up_proj.weight": "blk.{i}.ffn_up_shexp.weight",
    _L + "mlp.shared_expert.down_proj.weight": "blk.{i}.ffn_down_shexp.weight",
    _L + "mlp.shared_expert_gate.weight": "blk.{i}.ffn_gate_inp_shexp.weight",
}
_EXPERTS = {
    "gate": _L + "mlp.experts.{e}.gate_proj.weight",
    "up": _L + "mlp.experts.{e}.up_proj.weight",
    "down": _L + "mlp.experts.{e}.down_proj.weight",
}
# transformers 5 in-memory layout (save_original_format=False): gate rows first, then up
_FUSED = (
    FusedExperts(_L + "mlp.experts.gate_up_proj", ("gate", "up")),
    FusedExperts(_L + "mlp.experts.down_proj", ("down",)),
)
_UNUSED = (
    (r"mtp\..*", "multi-token-prediction head (speculative decoding; not used)"),
    (r"model\.mtp\..*", "multi-token-prediction head (speculative decoding; not used)"),
    (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", "recomputed from rope_theta"),
)
# qwen3_next / qwen3_5_moe_text: full-attention layers (q_proj is 2x wide: per head, q then its
# output gate; q/k norms store w of x * (1 + w)) and Gated DeltaNet layers.
_LINEAR_ATTN = {
    _L + "linear_attn.conv1d.weight": "blk.{i}.ssm_conv1d.weight",
    _L + "linear_attn.dt_bias": "blk.{i}.ssm_dt.bias",
    _L + "linear_attn.A_log": "blk.{i}.ssm_a_log",
    _L + "linear_attn.norm.weight": "blk.{i}.ssm_norm.weight",
    _L + "linear_attn.out_proj.weight": "blk.{i}.ssm_out.weight",
}
# qwen3_next: q, k, v, z (and b, a) grouped per key head, as published; the model regroups them
_QWEN3_NEXT_IN = {
    _L + "linear_attn.in_proj_qkvz.weight": "blk.{i}.ssm_in_qkvz.weight",
    _L + "linear_attn.in_proj_ba.weight": "blk.{i}.ssm_in_ba.weight",
}
_QWEN3_5_IN = {
    _L + "linear_attn.in_proj_qkv.weight": "blk.{i}.ssm_in_qkv.weight",
    _L + "linear_attn.in_proj_z.weight": "blk.{i}.ssm_in_z.weight",
    _L + "linear_attn.in_proj_b.weight": "blk.{i}.ssm_in_b.weight",
    _L + "linear_attn.in_proj_a.weight": "blk.{i}.ssm_in_a.weight",
}
_HYBRID = {**_GLOBAL, **_ATTN, **_ATTN_BIAS, **_O_BIAS, **_QK_NORM, **_ROUTER, **_SHARED_EXPERT,
           **_LINEAR_ATTN}
_VISION = ((r"model\.visual\..*", "vision tower (freetoken runs the text model)"),)
# glm4_moe: ungated shared experts, the router's correction bias; its multi-token-prediction
# layers (model.layers.{num_hidden_layers + j}) are skipped by tensor_map.py from the config
_SHARED_EXPERTS = {
    _L + "mlp.shared_experts.gate_proj.weight": "blk.{i}.ffn_gate_shexp.weight",
    _L + "mlp.shared_experts.up_proj.weight": "blk.{i}.ffn_up_shexp.weight",
    _L + "mlp.shared_experts.down_proj.weight": "blk.{i}.ffn_down_shexp.weight",
}
_CORRECTION_BIAS = {_L + "mlp.gate.e_score_correction_bias": "blk.{i}.exp_probs_b"}
# deepseek_v2 / deepseek_v3: multi-head latent attention (q through q_a -> norm -> q_b, or one
# q_proj when q_lora_rank is null), ungated shared experts, dense layers first; the hub's
# multi-token-prediction layer (DeepSeek-V3: model.layers.61) is skipped by tensor_map.py
_MLA = {
    _L + "input_layernorm.weight": "blk.{i}.attn_norm.weight",
    _L + "self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    _L + "self_attn.q_a_proj.weight": "blk.{i}.attn_q_a.weight",
    _L + "self_attn.q_a_proj.bias": "blk.{i}.attn_q_a.bias",
    _L + "self_attn.q_a_layernorm.weight": "blk.{i}.attn_q_a_norm.weight",
    _L + "self_attn.q_b_proj.weight": "blk.{i}.attn_q_b.weight",
    _L + "self_attn.kv_a_proj_with_mqa.weight": "blk.{i}.attn_kv_a_mqa.weight",
    _L + "self_attn.kv_a_proj_with_mqa.bias": "blk.{i}.attn_kv_a_mqa.bias",
    _L + "self_attn.kv_a_layernorm.weight": "blk.{i}.attn_kv_a_norm.weight",
    _L + "self_attn.kv_b_proj.weight": "blk.{i}.attn_kv_b.weight",
    _L + "self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    _L + "self_attn.o_proj.bias": "blk.{i}.attn_output.bias",
    _L + "post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
}
_DEEPSEEK = {**_GLOBAL, **_MLA, **_ROUTER, **_DENSE_MLP, **_SHARED_EXPERTS}

# gpt_oss: attention sinks, q/k/v/o biases, a router with a bias, experts fused [E, in, out] with
# gate and up interleaved and biases on both projections; or, as the hub publishes them, the
# weights in MXFP4 ([E, out, ...] blocks and scales, gate and up rows interleaved the same way)
_GPT_OSS_FUSED = (
    FusedExperts(_L + "mlp.experts.gate_up_proj", ("gate", "up"), transposed=True, interleaved=True),
    FusedExperts(_L + "mlp.experts.down_proj", ("down",), transposed=True),
    FusedExperts(_L + "mlp.experts.gate_up_proj_bias", ("gate_bias", "up_bias"), interleaved=True),
    FusedExperts(_L + "mlp.experts.down_proj_bias", ("down_bias",)),
    FusedExperts(_L + "mlp.experts.gate_up_proj_blocks", ("gate", "up"), interleaved=True, part="blocks"),
    FusedExperts(_L + "mlp.experts.gate_up_proj_scales", ("gate", "up"), interleaved=True, part="scales"),
    FusedExperts(_L + "mlp.experts.down_proj_blocks", ("down",), part="blocks"),
    FusedExperts(_L + "mlp.experts.down_proj_scales", ("down",), part="scales"),
)
# qwen3_vl_moe: the hub (and transformers' default save) stores the experts fused [E, in, out],
# gate then up along out; transformers' in-memory save [E, out, in] under the same names.
# tensor_map.py picks the orientation from the tensor's shape
_FUSED_IN_OUT = (
    FusedExperts(_L + "mlp.experts.gate_up_proj", ("gate", "up"), transposed=True),
    FusedExperts(_L + "mlp.experts.down_proj", ("down",), transposed=True),
)
_TEXT_OF_VLM = (("model.language_model.", "model."),)  # a VLM checkpoint's text model
# ernie4_5_moe: the correction bias [1, E] under moe_statics (hub and save_pretrained), or under
# gate.moe_statics (transformers 5 in-memory names); the hub's multi-token-prediction tensors
_ERNIE = {**_GLOBAL, **_ATTN, **_ROUTER, **_DENSE_MLP, **_SHARED_EXPERTS,
          _L + "mlp.moe_statics.e_score_correction_bias": "blk.{i}.exp_probs_b",
          _L + "mlp.gate.moe_statics.e_score_correction_bias": "blk.{i}.exp_probs_b"}
_ERNIE_MTP = ((r"model\.mtp_.*", "multi-token-prediction block (speculative decoding; not used)"),)
# hunyuan_v1_moe: router `gate.wg`, one ungated `shared_mlp`, q/k norms named *_layernorm
_HUNYUAN = {**_GLOBAL, **_ATTN, **_ATTN_BIAS, **_O_BIAS,
            _L + "self_attn.query_layernorm.weight": "blk.{i}.attn_q_norm.weight",
            _L + "self_attn.key_layernorm.weight": "blk.{i}.attn_k_norm.weight",
            _L + "mlp.gate.wg.weight": "blk.{i}.ffn_gate_inp.weight",
            _L + "mlp.shared_mlp.gate_proj.weight": "blk.{i}.ffn_gate_shexp.weight",
            _L + "mlp.shared_mlp.up_proj.weight": "blk.{i}.ffn_up_shexp.weight",
            _L + "mlp.shared_mlp.down_proj.weight": "blk.{i}.ffn_down_shexp.weight"}

# mixtral's per-expert names (w1 gate, w3 up, w2 down), also minimax_m2's and phimoe's
_W123_EXPERTS = {
    "gate": _L + "block_sparse_moe.experts.{e}.w1.weight",
    "up": _L + "block_sparse_moe.experts.{e}.w3.weight",
    "down": _L + "block_sparse_moe.experts.{e}.w2.weight",
}
# minimax_m2: mixtral's names (under block_sparse_moe. on the hub, mlp. in transformers 5's
# in-memory save), q/k norms over the whole projection, the correction bias of the sigmoid route
_MINIMAX_M2 = {**_GLOBAL, **_ATTN, **_QK_NORM, **_ROUTER,
               _L + "block_sparse_moe.gate.weight": "blk.{i}.ffn_gate_inp.weight",
               _L + "block_sparse_moe.e_score_correction_bias": "blk.{i}.exp_probs_b",
               _L + "mlp.e_score_correction_bias": "blk.{i}.exp_probs_b"}
# granitemoe: router and experts under block_sparse_moe.; the hub's (and save_pretrained's)
# fused legacy experts `input_linear` [E, 2I, D] (gate rows first) and `output_linear` [E, D, I],
# router `router.layer`; transformers 5's in-memory names `experts.gate_up_proj` / `down_proj`,
# router `router.weight`
_GRANITE = {**_GLOBAL, **_ATTN, **_ATTN_BIAS, **_O_BIAS,
            _L + "block_sparse_moe.router.layer.weight": "blk.{i}.ffn_gate_inp.weight",
            _L + "block_sparse_moe.router.weight": "blk.{i}.ffn_gate_inp.weight"}
_GRANITE_FUSED = (
    FusedExperts(_L + "block_sparse_moe.input_linear.weight", ("gate", "up")),
    FusedExperts(_L + "block_sparse_moe.output_linear.weight", ("down",)),
    FusedExperts(_L + "block_sparse_moe.experts.gate_up_proj", ("gate", "up")),
    FusedExperts(_L + "block_sparse_moe.experts.down_proj", ("down",)),
)
# phimoe: mixtral's per-expert names, the router `gate` (hub) or `mlp.router` (transformers 5's
# in-memory save); LayerNorms with biases, biases on q/k/v/o and the output head
_PHIMOE = {**_GLOBAL, **_ATTN, **_ATTN_BIAS, **_O_BIAS,
           _L + "input_layernorm.bias": "blk.{i}.attn_norm.bias",
           _L + "post_attention_layernorm.bias": "blk.{i}.ffn_norm.bias",
           "model.norm.bias": "output_norm.bias", "lm_head.bias": "output.bias",
           _L + "block_sparse_moe.gate.weight": "blk.{i}.ffn_gate_inp.weight",
           _L + "mlp.router.weight": "blk.{i}.ffn_gate_inp.weight"}
# llama4_text: everything under feed_forward.: the router, the experts fused [E, in, out] (gate
# then up along out; hub = transformers' save), an ungated shared expert, the dense MLP of the
# layers between; the VLM checkpoint's text model under language_model. (vision skipped)
_LLAMA4 = {**_GLOBAL, **_ATTN, **_ATTN_BIAS, **_O_BIAS,
           _L + "feed_forward.router.weight": "blk.{i}.ffn_gate_inp.weight",
           _L + "feed_forward.shared_expert.gate_proj.weight": "blk.{i}.ffn_gate_shexp.weight",
           _L + "feed_forward.shared_expert.up_proj.weight": "blk.{i}.ffn_up_shexp.weight",
           _L + "feed_forward.shared_expert.down_proj.weight": "blk.{i}.ffn_down_shexp.weight",
           _L + "feed_forward.gate_proj.weight": "blk.{i}.ffn_gate.weight",
           _L + "feed_forward.up_proj.weight": "blk.{i}.ffn_up.weight",
           _L + "feed_forward.down_proj.weight": "blk.{i}.ffn_down.weight"}
_LLAMA4_FUSED = (
    FusedExperts(_L + "feed_forward.experts.gate_up_proj", ("gate", "up"), transposed=True),
    FusedExperts(_L + "feed_forward.experts.down_proj", ("down",), transposed=True),
)
_LLAMA4_VISION = ((r"vision_model\..*", "vision tower (freetoken runs the text model)"),
                  (r"multi_modal_projector\..*", "vision projector (freetoken runs the text model)"))

FAMILIES = {
    "qwen3_moe": Family(
        "qwen3_moe", ("qwen3_moe",), ("Qwen3MoeForCausalLM",),
        {**_GLOBAL, **_ATTN, **_ATTN_BIAS, **_O_BIAS, **_QK_NORM, **_ROUTER, **_DENSE_MLP},
        _EXPERTS, _FUSED, _UNUSED),
    "qwen2_moe": Family(
        "qwen2_moe", ("qwen2_moe",), ("Qwen2MoeForCausalLM",),
        {**_GLOBAL, **_ATTN, **_ATTN_BIAS, **_ROUTER, **_DENSE_MLP, **_SHARED_EXPERT},
        _EXPERTS, _FUSED, _UNUSED),
    "mixtral": Family(
        "mixtral", ("mixtral",), ("MixtralForCausalLM",),
        {**_GLOBAL, **_ATTN, **_ROUTER,
         _L + "block_sparse_moe.gate.weight": "blk.{i}.ffn_gate_inp.weight"},
        _W123_EXPERTS, _FUSED, _UNUSED),
    "olmoe": Family(
        "olmoe", ("olmoe",), ("OlmoeForCausalLM",),
        {**_GLOBAL, **_ATTN, **_ATTN_BIAS, **_O_BIAS, **_QK_NORM, **_ROUTER},
        _EXPERTS, _FUSED, _UNUSED),
    "qwen3_next": Family(
        "qwen3_next", ("qwen3_next",), ("Qwen3NextForCausalLM",),
        {**_HYBRID, **_DENSE_MLP, **_QWEN3_NEXT_IN}, _EXPERTS, _FUSED, _UNUSED),
    # Qwen3.5/3.6 MoE: the text model alone, or the VLM checkpoint (text under
    # model.language_model., vision tower skipped)
    "qwen3_5_moe_text": Family(
        "qwen3_5_moe_text", ("qwen3_5_moe_text", "qwen3_5_moe"),
        ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
        {**_HYBRID, **_QWEN3_5_IN}, _EXPERTS, _FUSED, _UNUSED + _VISION,
        prefixes=_TEXT_OF_VLM),
    "glm4_moe": Family(
        "glm4_moe", ("glm4_moe",), ("Glm4MoeForCausalLM",),
        {**_GLOBAL, **_ATTN, **_ATTN_BIAS, **_QK_NORM, **_ROUTER, **_CORRECTION_BIAS, **_DENSE_MLP,
         **_SHARED_EXPERTS}, _EXPERTS, _FUSED, _UNUSED),
    "gpt_oss": Family(
        "gpt_oss", ("gpt_oss",), ("GptOssForCausalLM",),
        {**_GLOBAL, **_ATTN, **_ATTN_BIAS, **_O_BIAS,
         _L + "self_attn.sinks": "blk.{i}.attn_sinks",
         _L + "mlp.router.weight": "blk.{i}.ffn_gate_inp.weight",
         _L + "mlp.router.bias": "blk.{i}.ffn_gate_inp.bias"},
        {}, _GPT_OSS_FUSED, _UNUSED),
    "deepseek_v3": Family(
        "deepseek_v3", ("deepseek_v3",), ("DeepseekV3ForCausalLM",),
        {**_DEEPSEEK, **_CORRECTION_BIAS}, _EXPERTS, _FUSED, _UNUSED),
    "deepseek_v2": Family(
        "deepseek_v2", ("deepseek_v2",), ("DeepseekV2ForCausalLM",), _DEEPSEEK, _EXPERTS, _FUSED,
        _UNUSED),
    # Qwen3-VL MoE: the text model of the VLM checkpoint (under model.language_model., vision
    # tower skipped); its text layers are qwen3_moe's with q/k/v/o biases when configured
    "qwen3_vl_moe": Family(
        "qwen3_vl_moe", ("qwen3_vl_moe", "qwen3_vl_moe_text"),
        ("Qwen3VLMoeForConditionalGeneration",),
        {**_GLOBAL, **_ATTN, **_ATTN_BIAS, **_O_BIAS, **_QK_NORM, **_ROUTER, **_DENSE_MLP},
        _EXPERTS, _FUSED + _FUSED_IN_OUT, _UNUSED + _VISION, prefixes=_TEXT_OF_VLM),
    # dots1 (dots.llm1): qwen3_moe's attention (per-head q/k norm, full rotary) with glm4_moe's
    # sigmoid routing in groups, correction bias, ungated shared experts, dense layers first
    "dots1": Family(
        "dots1", ("dots1",), ("Dots1ForCausalLM",),
        {**_GLOBAL, **_ATTN, **_ATTN_BIAS, **_O_BIAS, **_QK_NORM, **_ROUTER, **_CORRECTION_BIAS,
         **_DENSE_MLP, **_SHARED_EXPERTS}, _EXPERTS, _FUSED, _UNUSED),
    "ernie4_5_moe": Family(
        "ernie4_5_moe", ("ernie4_5_moe",), ("Ernie4_5_MoeForCausalLM",), _ERNIE, _EXPERTS,
        _FUSED, _UNUSED + _ERNIE_MTP),
    "hunyuan_v1_moe": Family(
        "hunyuan_v1_moe", ("hunyuan_v1_moe",), ("HunYuanMoEV1ForCausalLM",), _HUNYUAN, _EXPERTS,
        _FUSED, _UNUSED),
    "minimax_m2": Family(
        "minimax_m2", ("minimax_m2",), ("MiniMaxM2ForCausalLM",), _MINIMAX_M2, _W123_EXPERTS,
        _FUSED, _UNUSED),
    "granitemoe": Family(
        "granitemoe", ("granitemoe",), ("GraniteMoeForCausalLM",), _GRANITE, {}, _GRANITE_FUSED,
        _UNUSED),
    "phimoe": Family(
        "phimoe", ("phimoe",), ("PhimoeForCausalLM",), _PHIMOE, _W123_EXPERTS, _FUSED, _UNUSED),
    "llama4_text": Family(
        "llama4_text", ("llama4_text", "llama4"),
        ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"), _LLAMA4, {}, _LLAMA4_FUSED,
        _UNUSED + _LLAMA4_VISION, prefixes=(("language_model.", ""),)),
}
MTP_LAYER_REASON = ("multi-token-prediction layer (num_nextn_predict_layers; speculative decoding, "
                    "not used)")


def supported_families() -> list:
    return sorted(FAMILIES)


# --- matching -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Match:
    kind: str              # "tensor" | "expert" | "fused" | "ignored" | "refused"
    canonical: str = ""    # kind == "tensor"
    layer: int = -1
    expert: int = -1       # kind == "expert"
    projection: str = ""   # kind == "expert"
    fused: FusedExperts = None  # kind == "fused"
    reason: str = ""       # kind == "ignored": why inference never uses it; "refused": what to do


def _regex(template: str) -> re.Pattern:
    pattern = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)")
    return re.compile(pattern)


def _compiled(family: Family) -> list:
    if family._compiled is None:
        rules = [(_regex(hf), ("tensor", canon)) for hf, canon in family.tensors.items()]
        rules += [(_regex(hf), ("expert", proj)) for proj, hf in family.per_expert.items()]
        rules += [(_regex(f.hf), ("fused", f)) for f in family.fused]
        rules += [(re.compile(rx), ("ignored", why)) for rx, why in family.ignore]
        rules += [(re.compile(rx), ("refused", why)) for rx, why in family.refuse]
        object.__setattr__(family, "_compiled", rules)
    return family._compiled


def match(family: Family, hf_name: str):
    """The Match for one HF tensor name, or None when no table entry covers it."""
    for source, table in family.prefixes:
        if hf_name.startswith(source):
            hf_name = table + hf_name[len(source):]
            break
    for rx, (kind, what) in _compiled(family):
        m = rx.fullmatch(hf_name)
        if m is None:
            continue
        layer = int(m.group("i")) if "i" in rx.groupindex else -1
        if kind == "tensor":
            return Match("tensor", canonical=what.replace("{i}", str(layer)), layer=layer)
        if kind == "expert":
            return Match("expert", layer=layer, expert=int(m.group("e")), projection=what)
        if kind == "fused":
            return Match("fused", layer=layer, fused=what)
        return Match(kind, reason=what)
    return None
