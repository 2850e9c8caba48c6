"""Build small random Hugging Face MoE checkpoints (weights, config.json, tokenizer) for tests.

Test-only tool: it imports transformers (never a runtime dependency) and works fully offline.
Families: qwen3_moe, qwen2_moe (shared expert + sigmoid gate), mixtral, olmoe, the hybrids
qwen3_next and qwen3_5_moe_text (Gated DeltaNet layers, 3 of every 4, between gated attention
layers; shared expert), glm4_moe (sigmoid routing with a correction bias in 4 expert groups,
a dense first layer, shared experts, partial rotary, q/k norm, q/k/v biases), gpt_oss
(attention sinks, sliding-window layers between full ones, yarn rope, biases on q/k/v/o, the
router and the experts, the clamped SwiGLU; its experts are fused [E, in, out] with gate and up
interleaved in every layout, as the hub's bf16 files have them), and the multi-head latent
attention families deepseek_v3 (q LoRA, glm4_moe's routing) and deepseek_v2 (plain q, softmax
routing limited to the best groups), each with a dense first layer and shared experts; the
text model of qwen3_vl_moe (qwen3_moe's layers with q/k/v/o biases, always written as the VLM
checkpoint with a tiny vision tower), and dots1 (qwen3_moe's attention with glm4_moe's routing,
a dense first layer and shared experts), ernie4_5_moe (softmax routing chosen with a [1, E]
correction bias, a dense first layer, shared experts, rotary on interleaved pairs, tied
embeddings), hunyuan_v1_moe (a shared MLP beside the experts in every layer, q/k norms after the
rotary, the router `gate.wg`), minimax_m2 (mixtral's names, sigmoid routing with a correction
bias, q/k norms over the whole projection, partial rotary: the hub's `rotary_dim`), granitemoe
(its four multipliers; experts fused in every layout: per_expert is the hub's
`block_sparse_moe.input_linear` [E, 2I, D] / `output_linear` [E, D, I], router `router.layer`),
phimoe (mixtral's names, LayerNorms with biases, q/k/v/o and lm_head biases, the sparsemixer
threshold router_jitter_noise raised to 0.2) and llama4_text (top-1 on the scaled input, a shared
expert, dense layers between the MoE ones, chunked attention with q/k L2 norms, a layer without
rotary whose q takes the temperature; experts fused [E, in, out] in every layout).
Layouts:

  per_expert  the original published names, one 2-D tensor per expert and projection
              (`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`; mixtral:
              `model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight`, router
              `block_sparse_moe.gate.weight`). transformers 5 `save_pretrained` default.
  fused       transformers 5 in-memory names, `mlp.experts.gate_up_proj` [E, 2I, D] and
              `mlp.experts.down_proj` [E, D, I] (`save_original_format=False`); mixtral too
              is written under `mlp.` in this layout.
  vlm         a VLM checkpoint with a tiny vision tower, in two shards with an index.
              qwen3_5_moe_text: the Qwen3.5/3.6 one (Qwen3_5MoeForConditionalGeneration): text
              under `model.language_model.`, `model.visual.*`, `lm_head.weight`, plus a
              multi-token-prediction shard (`mtp.*`) as the hub files have. llama4_text: Llama
              4's (Llama4ForConditionalGeneration, as the hub files): `language_model.model.*`,
              `language_model.lm_head.weight`, `vision_model.*`, `multi_modal_projector.*`
              (transformers' AutoModelForCausalLM loads its text model).
  qwen3_vl_moe's every layout is the VLM checkpoint (text under `model.language_model.`,
  `model.visual.*`, `lm_head.weight`, two shards); its experts are fused in both: per_expert is
  the hub layout, `mlp.experts.gate_up_proj` [E, D, 2I] and `down_proj` [E, I, D] ([in, out],
  gate then up; transformers transposes them when it loads); fused is [E, 2I, D] / [E, D, I] as
  above, which is also what transformers' save_pretrained writes for this family.
  glm4_moe's and deepseek_v3's per_expert layout also gets the hub files' multi-token-prediction
  layer: tensors of `model.layers.{num_hidden_layers}` in a shard of their own,
  num_nextn_predict_layers=1.

Config styles: "nested" is what transformers 5 writes (`rope_parameters`, `dtype`); "legacy"
rewrites config.json the way the published checkpoints read (top-level `rope_theta`,
`rope_scaling`, `torch_dtype`; `num_experts` for qwen3_moe/qwen2_moe/olmoe, `num_local_experts`
for mixtral; no `head_dim` where the published configs had none).

Weights are initialised so routing is not degenerate. With HF's init (std 0.02 everywhere) the
residual stream of a deep model is soon dominated by one direction shared by all tokens, and the
routers of the later layers send every token to the same few experts (48 layers x 128 experts,
top-8: ~20 of 128 experts hit by a 32-token prompt). Scaling a router alone cannot fix that (top-k
is scale invariant), so: (1) token embeddings get std `embed_std` (1.0), keeping each token's own
direction dominant through all layers; (2) the other weights get std 0.64/sqrt(D) (0.08 at D=64),
so each layer still changes the residual by ~30% and oracle tests see every block; (3) each router
is re-drawn with std `router_std / sqrt(D)` (2.0), giving router logits of std ~2, so the top-k
weights are far from uniform. Measured: 32 random tokens hit 8/8 experts in every layer of the
defaults and 82-112 of 128 (top-8) in each of 48 layers of the large shape. `expert_coverage()`
measures it and a test checks it.

    python tools/make_tiny_model.py OUT --family qwen3_moe --layout fused --dtype bf16 \
        [--shards N] [--config-style legacy] [--set key=value ...]
    python tools/make_tiny_model.py --list
    # 874 MiB random qwen3_moe, experts 99% of it (48 layers x 128 experts, top-8; builds in
    # under a minute on 2 cores with ~2 GB RAM since it is built directly in bf16):
    python tools/make_tiny_model.py OUT --family qwen3_moe --dtype bf16 --set num_hidden_layers=48 \
        --set num_experts=128 --set hidden_size=256 --set moe_intermediate_size=96 \
        --set num_experts_per_tok=8 --set intermediate_size=512
"""
from __future__ import annotations

import json
import math
import pathlib
import random
import sys

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "qwen3_next", "qwen3_5_moe_text",
            "glm4_moe", "gpt_oss", "deepseek_v3", "deepseek_v2", "qwen3_vl_moe", "dots1",
            "ernie4_5_moe", "hunyuan_v1_moe", "minimax_m2", "granitemoe", "phimoe", "llama4_text")
HYBRID = ("qwen3_next", "qwen3_5_moe_text")
MLA = ("deepseek_v3", "deepseek_v2")
# families with a router correction bias, dense first layers and the hub's MTP layer
GROUPED = ("glm4_moe", "deepseek_v3")
# families whose checkpoints are a VLM's (the text model under model.language_model.)
VLM = ("qwen3_vl_moe",)
LAYOUTS = ("per_expert", "fused", "vlm")
VLM_LAYOUT = ("qwen3_5_moe_text", "llama4_text")  # the families that have the vlm layout
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
CONFIG_STYLES = ("nested", "legacy")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Small shapes, deliberately non-square (D=64, I=48, dense 96, shared 80) so a transposed or
# mis-split tensor cannot pass a shape check by accident.
_COMMON = dict(
    vocab_size=384, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, num_experts_per_tok=2,
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
)
DEFAULTS = {
    "qwen3_moe": dict(_COMMON, num_experts=8, moe_intermediate_size=48, intermediate_size=96,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen2_moe": dict(_COMMON, num_experts=8, moe_intermediate_size=48, intermediate_size=96,
                      shared_expert_intermediate_size=80, norm_topk_prob=False,
                      decoder_sparse_step=1, mlp_only_layers=[]),
    "mixtral": dict(_COMMON, num_experts=8, intermediate_size=48, rope_theta=1e6),
    "olmoe": dict(_COMMON, num_experts=8, intermediate_size=48, norm_topk_prob=False,
                  clip_qkv=None),
}
# The hybrids: 4 layers (3 Gated DeltaNet, then attention), partial rotary 0.25 (4 of 16 dims),
# 2 key heads of 16 serving 4 value heads of 24 (conv width 4)
_HYBRID_COMMON = dict(_COMMON, num_hidden_layers=4, num_experts=8, moe_intermediate_size=48,
                      shared_expert_intermediate_size=80, partial_rotary_factor=0.25,
                      linear_conv_kernel_dim=4, linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=16, linear_value_head_dim=24)
DEFAULTS["qwen3_next"] = dict(_HYBRID_COMMON, intermediate_size=96, norm_topk_prob=True,
                              decoder_sparse_step=1, mlp_only_layers=[])
DEFAULTS["qwen3_5_moe_text"] = dict(_HYBRID_COMMON)
# glm4_moe: 8 experts in 4 groups, a token's 2 from its 2 best groups; layer 0 dense; 2 shared
# experts (96 wide); rotary on 8 of 16 head dims; scale 2.5 as GLM-4.5's
DEFAULTS["glm4_moe"] = dict(_COMMON, num_experts=8, moe_intermediate_size=48, intermediate_size=112,
                            n_shared_experts=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                            routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True,
                            attention_bias=True, partial_rotary_factor=0.5)
# gpt_oss: 4 layers, sliding (window 5) / full alternating; yarn (factor 4 over 128 positions,
# untruncated as the published config); swiglu_limit 0.6, so that the clamps cut often at this
# scale (7.0 in the published config, against gate/up values of a few units there)
DEFAULTS["gpt_oss"] = dict(_COMMON, num_hidden_layers=4, num_experts=8, intermediate_size=48,
                           sliding_window=5, attention_bias=True, swiglu_limit=0.6,
                           rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "truncate": False,
                                         "original_max_position_embeddings": 128})
# MLA: 4 heads of 16 + 8 rope dims (head_dim = the rope dims, as transformers sets it), values of
# 12, a kv latent of 32; 8 experts, layer 0 dense. deepseek_v3: q through a rank-24 bottleneck,
# glm4_moe's routing (4 groups, 2 kept), 1 shared expert; deepseek_v2: a plain q (as V2-Lite),
# softmax limited to 2 of 4 groups, 2 shared experts
_MLA_COMMON = dict(_COMMON, num_key_value_heads=4, head_dim=8, qk_rope_head_dim=8,
                   qk_nope_head_dim=16, v_head_dim=12, kv_lora_rank=32, num_experts=8,
                   moe_intermediate_size=48, intermediate_size=112, first_k_dense_replace=1,
                   n_group=4, topk_group=2)
DEFAULTS["deepseek_v3"] = dict(_MLA_COMMON, q_lora_rank=24, n_shared_experts=1,
                               routed_scaling_factor=2.5, norm_topk_prob=True)
DEFAULTS["deepseek_v2"] = dict(_MLA_COMMON, q_lora_rank=None, n_shared_experts=2,
                               topk_method="group_limited_greedy", routed_scaling_factor=2.0)
# qwen3_vl_moe: qwen3_moe's shapes with q/k/v/o biases (the published config has none)
DEFAULTS["qwen3_vl_moe"] = dict(_COMMON, num_experts=8, moe_intermediate_size=48, intermediate_size=96,
                                decoder_sparse_step=1, mlp_only_layers=[], attention_bias=True)
# dots1: glm4_moe's routing (4 groups, 2 kept, scale 2.5, bias) and 2 shared experts with full
# rotary, q/k norm and q/k/v/o biases; layer 0 dense
DEFAULTS["dots1"] = dict(_COMMON, num_experts=8, moe_intermediate_size=48, intermediate_size=112,
                         n_shared_experts=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                         routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True)
# ernie4_5_moe: layer 0 dense (112 wide), 2 shared experts (96 wide), tied embeddings as the
# released models
DEFAULTS["ernie4_5_moe"] = dict(_COMMON, num_experts=8, moe_intermediate_size=48,
                                intermediate_size=112, moe_num_shared_experts=2,
                                moe_layer_start_index=1, tie_word_embeddings=True)
# hunyuan_v1_moe: experts and the shared MLP both intermediate_size (48) wide
DEFAULTS["hunyuan_v1_moe"] = dict(_COMMON, num_experts=8, intermediate_size=48)
# minimax_m2: sigmoid routing with a correction bias (no groups), q/k RMSNorm over the whole
# projection, rotary on 8 of 16 head dims (the hub's rotary_dim 64 of 128)
DEFAULTS["minimax_m2"] = dict(_COMMON, num_experts=8, intermediate_size=48,
                              partial_rotary_factor=0.5, rope_theta=5e6)
# granitemoe: its four multipliers away from 1 (and the attention scale from 1/sqrt(16)), so
# that a dropped or misplaced one changes the output
DEFAULTS["granitemoe"] = dict(_COMMON, num_experts=8, intermediate_size=48, embedding_multiplier=1.5,
                              attention_multiplier=0.2, residual_multiplier=0.7,
                              logits_scaling=1.8)
# phimoe: LayerNorms with biases, q/k/v/o and lm_head biases; the sparsemixer's threshold
# 2 x router_jitter_noise = 0.4 of the top logit's size, so that it masks some experts out of
# the weights' softmax
DEFAULTS["phimoe"] = dict(_COMMON, num_experts=8, intermediate_size=48, rope_theta=1e6,
                          rms_norm_eps=1e-5, attention_bias=True, lm_head_bias=True,
                          router_jitter_noise=0.2)
# llama4_text: 4 layers, MoE in 1 and 3 (dense 112 wide between), top-1, a shared expert; layer
# 3 without rotary (its q scaled by the temperature from position 3 on: floor_scale 4), the
# others' attention in chunks of 8 tokens with q/k L2-normed
DEFAULTS["llama4_text"] = dict(_COMMON, num_hidden_layers=4, num_experts=8, num_experts_per_tok=1,
                               intermediate_size=48, intermediate_size_mlp=112,
                               interleave_moe_layer_step=2, attention_chunk_size=8, floor_scale=4,
                               attn_scale=0.5, rope_theta=5e5, rms_norm_eps=1e-5)
INIT_SCALE = 0.64  # default initializer_range = INIT_SCALE / sqrt(hidden_size); see module doc
# Name of the expert-count key in the published config.json of each family (legacy style).
LEGACY_EXPERTS_KEY = {"qwen3_moe": "num_experts", "qwen2_moe": "num_experts",
                      "mixtral": "num_local_experts", "olmoe": "num_experts",
                      "qwen3_next": "num_experts", "qwen3_5_moe_text": "num_experts",
                      "glm4_moe": "n_routed_experts", "gpt_oss": "num_local_experts",
                      "deepseek_v3": "n_routed_experts", "deepseek_v2": "n_routed_experts",
                      "qwen3_vl_moe": "num_experts", "dots1": "n_routed_experts",
                      "ernie4_5_moe": "moe_num_experts", "hunyuan_v1_moe": "num_experts",
                      "minimax_m2": "num_local_experts", "granitemoe": "num_local_experts",
                      "phimoe": "num_local_experts", "llama4_text": "num_local_experts"}
# Families whose published configs give no head_dim (it is hidden/heads there; MLA: the config
# class sets it).
LEGACY_NO_HEAD_DIM = ("qwen2_moe", "mixtral", "olmoe", "granitemoe", "phimoe", *MLA)


class TinyModelError(ValueError):
    """A build option is out of range (unknown family, layout, dtype, bad override)."""


# ---------------------------------------------------------------- tokenizer

_WORDS = (
    "the a an of to in is it that for on with as was by at be this from or are not have "
    "expert experts token tokens cache layer layers model router weight weights memory host "
    "device copy read write file fill miss hit evict value index list dict string number "
    "return def class self import if else elif while for yield lambda none true false "
    "print range len sum max min sort open close data line word text small large fast slow "
    "north south river mountain garden window morning evening light stone water bread"
).split()
_CODE = ("def {w}_{v}(x, n=1):\n    return [x * i for i in range(n)]\n",
         "class {W}{V}:\n    def __init__(self, {w}):\n        self.{w} = {w}\n",
         "for {w} in {v}s:\n    if {w} is not None:\n        print({w}, {v})\n",
         "{w} = {{'{v}': {n}, '{w}': [{n}, {m}]}}\n")


def corpus_text(seed: int = 0, num_lines: int = 400) -> str:
    """A few KB of deterministic prose, code and digits: the tokenizer's training text."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        kind = rng.random()
        if kind < 0.6:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 14))]
            lines.append(" ".join(words).capitalize() + rng.choice(".?!,;:") + "\n")
        else:
            w, v = rng.choice(_WORDS), rng.choice(_WORDS)
            lines.append(rng.choice(_CODE).format(w=w, v=v, W=w.capitalize(), V=v.capitalize(),
                                                  n=rng.randint(0, 999), m=rng.randint(0, 99)))
    return "".join(lines)


_TOKENIZER_CACHE: dict[int, str] = {}


def tokenizer_json(vocab_size: int) -> str:
    """A byte-level BPE trained on corpus_text() with exactly vocab_size ids (cached per process).

    Specials take ids 0..2; if training stops short of vocab_size, `<|extra_N|>` tokens fill up.
    """
    if vocab_size in _TOKENIZER_CACHE:
        return _TOKENIZER_CACHE[vocab_size]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise TinyModelError(f"vocab_size={vocab_size} is too small for a byte-level BPE: use >= 259")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, min_frequency=1)
    text = corpus_text()
    tok.train_from_iterator([text[i:i + 4096] for i in range(0, len(text), 4096)], trainer=trainer)
    extra = vocab_size - tok.get_vocab_size()
    tok.add_special_tokens([f"<|extra_{i}|>" for i in range(extra)])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    _TOKENIZER_CACHE[vocab_size] = tok.to_str()
    return _TOKENIZER_CACHE[vocab_size]


def write_tokenizer(out_dir: pathlib.Path, vocab_size: int) -> None:
    (out_dir / "tokenizer.json").write_text(tokenizer_json(vocab_size), encoding="utf-8")
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN,
           "eos_token": EOS_TOKEN, "pad_token": BOS_TOKEN, "unk_token": None,
           "add_bos_token": False, "model_max_length": 4096, "chat_template": CHAT_TEMPLATE}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")


# ---------------------------------------------------------------- model

def _hf_config(family: str, dtype: str, overrides: dict):
    import transformers

    values = dict(DEFAULTS[family])
    unknown = set(overrides) - set(DEFAULTS[family]) - {"rope_scaling", "initializer_range"}
    values.update(overrides)
    partial = values.pop("partial_rotary_factor", None)
    values.setdefault("initializer_range", INIT_SCALE / math.sqrt(values["hidden_size"]))
    rope_theta = values.pop("rope_theta")
    num_experts = values.pop("num_experts")
    values[LEGACY_EXPERTS_KEY[family]] = num_experts
    values.update(bos_token_id=SPECIAL_TOKENS.index(BOS_TOKEN),
                  eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN), pad_token_id=None,
                  rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    if "rope_scaling" in values:  # override accepted in legacy shape: {"rope_type": ..., ...}
        values["rope_parameters"] = dict(values.pop("rope_scaling") or {"rope_type": "default"},
                                         rope_theta=rope_theta)
    if partial is not None:
        values["rope_parameters"]["partial_rotary_factor"] = partial
    if family in VLM:  # M-RoPE sections (t, h, w) of the 8 rotary frequencies, as the hub's
        values["rope_parameters"].update(mrope_section=[2, 3, 3], mrope_interleaved=True)
    cls = {"qwen3_moe": transformers.Qwen3MoeConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
           "mixtral": transformers.MixtralConfig, "olmoe": transformers.OlmoeConfig,
           "qwen3_next": transformers.Qwen3NextConfig,
           "qwen3_5_moe_text": transformers.Qwen3_5MoeTextConfig,
           "glm4_moe": transformers.Glm4MoeConfig, "gpt_oss": transformers.GptOssConfig,
           "deepseek_v3": transformers.DeepseekV3Config,
           "deepseek_v2": transformers.DeepseekV2Config,
           "qwen3_vl_moe": transformers.Qwen3VLMoeTextConfig,
           "dots1": transformers.Dots1Config,
           "ernie4_5_moe": transformers.Ernie4_5_MoeConfig,
           "hunyuan_v1_moe": transformers.HunYuanMoEV1Config,
           "minimax_m2": transformers.MiniMaxM2Config,
           "granitemoe": transformers.GraniteMoeConfig,
           "phimoe": transformers.PhimoeConfig,
           "llama4_text": transformers.Llama4TextConfig}[family]
    default = cls()
    for key in sorted(unknown):  # transformers accepts any key silently; ours must be real fields
        if not hasattr(default, key):
            raise TinyModelError(f"--set {key}: the {family} config has no such field")
    config = cls(**values)
    config.dtype = DTYPES[dtype]
    return config


def _scale_routers(model, router_std: float) -> int:
    """Re-draw every MoE router ([E, D] `mlp.gate.weight`; hunyuan_v1_moe `mlp.gate.wg.weight`)
    with std router_std/sqrt(D)."""
    import torch

    count = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_router = name.endswith((".mlp.gate.weight", ".mlp.router.weight",
                                       ".mlp.gate.wg.weight", ".block_sparse_moe.router.weight",
                                       ".mlp.router.weight", ".feed_forward.router.weight"))
            if is_router and param.dim() == 2 and param.shape[0] > 1:
                param.normal_(0.0, router_std / math.sqrt(param.shape[1]))
                count += 1
    return count


def build(out_dir, family: str, layout: str = "per_expert", dtype: str = "fp32", seed: int = 0,
          shards: int = 1, config_style: str = "nested", router_std: float = 2.0,
          embed_std: float | None = 1.0, **config_overrides) -> pathlib.Path:
    """Write a random `family` checkpoint + tokenizer into out_dir and return its path.

    config_overrides are HF config fields (`num_experts` works for every family; `rope_theta`,
    `rope_scaling` in legacy shape; `initializer_range`); e.g. mlp_only_layers=[0],
    tie_word_embeddings=True. embed_std=None keeps HF's embedding init.
    """
    import torch
    import transformers

    if family not in FAMILIES:
        raise TinyModelError(f"unknown family {family!r}: choose one of {', '.join(FAMILIES)}")
    if layout not in LAYOUTS:
        raise TinyModelError(f"unknown layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    if layout == "vlm" and family not in VLM_LAYOUT:
        raise TinyModelError(f"layout vlm is a VLM checkpoint: families {', '.join(VLM_LAYOUT)} only")
    if layout == "vlm" and config_style != "nested":
        raise TinyModelError("layout vlm writes the nested (transformers 5) config only")
    if dtype not in DTYPES:
        raise TinyModelError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if config_style not in CONFIG_STYLES:
        raise TinyModelError(f"unknown config_style {config_style!r}: choose nested or legacy")
    if shards < 1:
        raise TinyModelError(f"shards={shards}: need at least 1")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _hf_config(family, dtype, config_overrides)
    torch_dtype = getattr(torch, DTYPES[dtype])
    torch.manual_seed(seed)
    # Built straight in the target dtype: a 1 GB bf16 model never exists in fp32.
    if family in VLM:
        config = transformers.Qwen3VLMoeConfig(text_config=config.to_dict(), vision_config=_TINY_VISION,
                                               tie_word_embeddings=config.tie_word_embeddings)
        config.dtype = DTYPES[dtype]
        model = transformers.Qwen3VLMoeForConditionalGeneration._from_config(config, dtype=torch_dtype)
        shards = max(shards, 2)
    elif layout == "vlm" and family == "llama4_text":
        config = transformers.Llama4Config(text_config=config.to_dict(), vision_config=_TINY_LLAMA4_VISION,
                                           tie_word_embeddings=config.tie_word_embeddings,
                                           image_token_index=5, boi_token_index=6, eoi_token_index=7)
        config.dtype = DTYPES[dtype]
        model = transformers.Llama4ForConditionalGeneration._from_config(config, dtype=torch_dtype)
        shards = max(shards, 2)
    elif layout == "vlm":
        config = transformers.Qwen3_5MoeConfig(text_config=config.to_dict(), vision_config=_TINY_VISION,
                                               tie_word_embeddings=config.tie_word_embeddings)
        config.dtype = DTYPES[dtype]
        model = transformers.Qwen3_5MoeForConditionalGeneration._from_config(config, dtype=torch_dtype)
        shards = max(shards, 2)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    _scale_routers(model, router_std)
    if embed_std is not None:
        with torch.no_grad():
            model.get_input_embeddings().weight.normal_(0.0, embed_std)
    if family in HYBRID:
        _slow_decays(model)
    if family in (*HYBRID, *GROUPED, *MLA, *VLM, "gpt_oss", "dots1", "ernie4_5_moe",
                  "hunyuan_v1_moe", "minimax_m2", "granitemoe", "phimoe", "llama4_text"):
        _perturb_constants(model)
    if family == "gpt_oss":
        _draw_expert_biases(model)
    if family in (*GROUPED, "dots1", "minimax_m2"):
        _draw_correction_biases(model)
    if family == "ernie4_5_moe":
        _draw_correction_biases(model, std=0.1)
    model.eval()
    total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    max_shard = "50GB" if shards == 1 else max(1, math.ceil(total / shards))
    model.save_pretrained(out, max_shard_size=max_shard,
                          save_original_format=(layout != "fused"))
    if layout == "vlm":
        config = model.config.text_config
        if family == "qwen3_5_moe_text":
            _add_mtp_shard(out, config, torch_dtype)
    if family in VLM:
        config = model.config.text_config
        if layout == "per_expert":
            _transpose_fused_experts(out)
    if family in GROUPED and layout == "per_expert":
        _add_mtp_layer(out, config, torch_dtype)
    if config_style == "legacy":
        _rewrite_legacy_config(out / "config.json", family)
    write_tokenizer(out, config.vocab_size)
    return out


# Llama 4's (its text model under language_model., the vision tower and its projector beside)
_TINY_LLAMA4_VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64, vision_output_dim=64, image_size=16, patch_size=4,
                           projector_input_dim=64, projector_output_dim=64)
# the smallest vision tower the Qwen3.5 VLM builds with (its weights are skipped by convert)
_TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                    patch_size=4, temporal_patch_size=2, spatial_merge_size=2)


def _slow_decays(model) -> None:
    """Re-draw each Gated DeltaNet A_log so that A is log-uniform in [0.005, 1]. transformers
    draws A in [0.01, 16]: at 4 value heads every head forgets within a few tokens, and a state
    carried across chunks or forwards would hardly change the output, so a test could not see it
    dropped; here some heads keep ~20% of their state over 64 tokens."""
    import torch

    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("linear_attn.A_log"):
                low, high = math.log(0.005), 0.0
                logs = low + (high - low) * torch.rand(param.shape, generator=gen)
                param.copy_(logs.to(param.dtype))  # A_log = log A


def _perturb_constants(model) -> None:
    """Noise on the 1-D tensors that start out constant or zero (norm weights, dt_bias), so a
    loader that drops, swaps or mis-offsets one of them changes the output."""
    import torch

    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.dim() == 1:
                param.add_(0.1 * torch.randn(param.shape, generator=gen).to(param.dtype))


def _draw_expert_biases(model) -> None:
    """gpt_oss's expert biases ([E, 2I], [E, D]; zeros in transformers' init) drawn with std
    0.3, so that a dropped, swapped or mis-interleaved bias changes the output."""
    import torch

    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
                param.copy_((0.3 * torch.randn(param.shape, generator=gen)).to(param.dtype))


def _draw_correction_biases(model, std: float = 0.5) -> None:
    """Each router's e_score_correction_bias (zeros in transformers; a buffer, ernie4_5_moe's a
    [1, E] parameter) drawn with std `std`: 0.5 on the scale of the sigmoid scores, 0.1 on that
    of ernie's softmax probabilities, so that it changes which experts a token takes."""
    import torch

    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        tensors = [*model.named_buffers(), *model.named_parameters()]
        for name, t in sorted(tensors, key=lambda item: item[0]):
            if name.endswith("e_score_correction_bias"):
                t.copy_(std * torch.randn(t.shape, generator=gen))


def _add_mtp_layer(out: pathlib.Path, config, torch_dtype) -> None:
    """GLM-4.5's or DeepSeek-V3's multi-token-prediction layer as the hub files have it:
    `model.layers.{L}.*` with L = num_hidden_layers (its own projections and norms, attention,
    experts), in a shard of its own listed in the index, and num_nextn_predict_layers=1 in
    config.json. transformers skips it (an unexpected key); a converter must skip it and say why."""
    import torch
    from safetensors.torch import save_file

    D, I, L = config.hidden_size, config.moe_intermediate_size, config.num_hidden_layers
    gen = torch.Generator().manual_seed(5)
    shapes = {"eh_proj.weight": (D, 2 * D), "enorm.weight": (D,), "hnorm.weight": (D,),
              "shared_head.norm.weight": (D,), "input_layernorm.weight": (D,),
              "self_attn.q_proj.weight": (config.num_attention_heads * config.head_dim, D),
              "mlp.gate.weight": (config.n_routed_experts, D),
              "mlp.gate.e_score_correction_bias": (config.n_routed_experts,),
              "mlp.experts.0.gate_proj.weight": (I, D), "mlp.experts.0.down_proj.weight": (D, I)}
    if config.model_type in MLA:  # DeepSeek-V3's layer 61 also holds its embedding and head
        del shapes["self_attn.q_proj.weight"]
        shapes.update({"self_attn.kv_a_proj_with_mqa.weight": (config.kv_lora_rank + config.qk_rope_head_dim, D),
                       "embed_tokens.weight": (config.vocab_size, D),
                       "shared_head.head.weight": (config.vocab_size, D)})
    tensors = {f"model.layers.{L}.{name}": torch.randn(shape, generator=gen).to(torch_dtype)
               for name, shape in shapes.items()}
    save_file(tensors, str(out / "model-mtp.safetensors"), metadata={"format": "pt"})
    index_path = out / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:  # one shard: write the index the two files now need
        from safetensors import safe_open
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in f.keys()}}
    index["weight_map"].update({name: "model-mtp.safetensors" for name in tensors})
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_nextn_predict_layers"] = 1
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def _transpose_fused_experts(out: pathlib.Path) -> None:
    """Rewrite every shard's `mlp.experts.gate_up_proj` / `down_proj` from [E, out, in] to
    [E, in, out], as the Qwen3-VL MoE hub files store them."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for path in sorted(out.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            metadata = f.metadata()
        fused = [k for k in tensors if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]
        for k in fused:
            tensors[k] = tensors[k].transpose(1, 2).contiguous()
        if fused:
            save_file(tensors, str(path), metadata=metadata)


def _add_mtp_shard(out: pathlib.Path, text_config, torch_dtype) -> None:
    """A multi-token-prediction shard (`mtp.*`, as the hub VLM checkpoints have; transformers
    ignores it) listed in the index: a converter must skip it, not fail on it."""
    import torch
    from safetensors.torch import save_file

    D = text_config.hidden_size
    gen = torch.Generator().manual_seed(2)
    tensors = {"mtp.fc.weight": torch.randn(D, 2 * D, generator=gen).to(torch_dtype),
               "mtp.norm.weight": torch.randn(D, generator=gen).to(torch_dtype),
               "mtp.layers.0.input_layernorm.weight": torch.randn(D, generator=gen).to(torch_dtype)}
    save_file(tensors, str(out / "model-mtp.safetensors"), metadata={"format": "pt"})
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({name: "model-mtp.safetensors" for name in tensors})
    index_path.write_text(json.dumps(index, indent=2) + "\n")


def _rewrite_legacy_config(path: pathlib.Path, family: str) -> None:
    cfg = json.loads(path.read_text())
    if family in VLM:  # the published VLM config: its text_config in the legacy style
        cfg["text_config"] = _legacy_config(cfg["text_config"], family)
        cfg["torch_dtype"] = cfg.pop("dtype")
    else:
        cfg = _legacy_config(cfg, family)
    path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")


def _legacy_config(cfg: dict, family: str) -> dict:
    cfg = dict(cfg)
    rope = dict(cfg.pop("rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    cfg["rope_theta"] = rope.pop("rope_theta")
    if family in (*HYBRID, "glm4_moe"):  # published configs: top-level partial rotary
        cfg["partial_rotary_factor"] = rope.pop("partial_rotary_factor", 0.25)
    if family == "minimax_m2":  # published MiniMax-M2: the rotated dims, rotary_dim
        cfg["rotary_dim"] = int(cfg["head_dim"] * rope.pop("partial_rotary_factor", 1.0))
    if family in HYBRID:  # published Qwen3-Next: the attention interval
        types = cfg["layer_types"]
        n = types.index("full_attention") + 1 if "full_attention" in types else len(types) + 1
        if types == ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(len(types))]:
            del cfg["layer_types"]  # a periodic pattern: the published configs' interval
            cfg["full_attention_interval"] = n
    plain = rope.get("rope_type", "default") == "default" and set(rope) <= {"rope_type"}
    cfg["rope_scaling"] = None if plain else rope  # M-RoPE's sections stay, as published
    cfg["torch_dtype"] = cfg.pop("dtype")
    num_experts = next(cfg.pop(k) for k in ("num_experts", "num_local_experts", "n_routed_experts",
                                            "moe_num_experts") if k in cfg)
    cfg.pop("num_local_experts", None)
    cfg[LEGACY_EXPERTS_KEY[family]] = num_experts
    if family in LEGACY_NO_HEAD_DIM and (family in MLA or cfg.get("head_dim") == cfg["hidden_size"]
                                         // cfg["num_attention_heads"]):
        cfg.pop("head_dim", None)
    if family == "qwen2_moe":  # published Qwen1.5-MoE configs predate these fields
        cfg.pop("qkv_bias", None)
        cfg.pop("layer_types", None)
    if family == "minimax_m2":  # published MiniMax-M2: the fields transformers hard-codes
        # (sigmoid scores, the correction bias, q/k norms over the whole projection)
        cfg.update(scoring_func="sigmoid", use_routing_bias=True, use_qk_norm=True,
                   qk_norm_type="per_layer")
    if family == "llama4_text":  # published Llama-4: the MoE and NoPE layers by their step and
        # interval (an empty no_rope_layers list), no layer_types
        del cfg["moe_layers"], cfg["layer_types"]
        cfg["no_rope_layers"] = []
    if family == "dots1":  # published: the sliding fields, no layer_types
        del cfg["layer_types"]
        cfg.update(sliding_window=None, max_window_layers=cfg["num_hidden_layers"])
    return dict(sorted(cfg.items()))


ORACLE_VERSION = "5.24.0"  # as pinned in pyproject.toml


def load_hf(model_dir, **kwargs):
    """The transformers model of a checkpoint built here (a VLM family's through its
    image-text-to-text class; text-only input runs its text model)."""
    import transformers

    if transformers.__version__ != ORACLE_VERSION:  # e.g. gpt_oss's logits moved between versions
        raise RuntimeError(f"the oracle is transformers=={ORACLE_VERSION} (pyproject.toml's test "
                           f"extra), this is {transformers.__version__}: pip install "
                           f"transformers=={ORACLE_VERSION}")
    cfg = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    auto = (transformers.AutoModelForImageTextToText if cfg.get("model_type") in VLM
            else transformers.AutoModelForCausalLM)
    return auto.from_pretrained(model_dir, **kwargs)


def expert_coverage(model_dir, num_tokens: int = 32, seed: int = 0) -> list[int]:
    """Distinct experts hit per MoE layer by a random num_tokens prompt (HF forward)."""
    import torch

    model = load_hf(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    config = model.config.get_text_config()
    ids = torch.randint(3, config.vocab_size, (1, num_tokens), generator=gen)
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    k = config.num_experts_per_tok
    return [len(set(logits.topk(k, dim=-1).indices.flatten().tolist())) for logits in out.router_logits]


# ---------------------------------------------------------------- CLI

def _parse_set(items) -> dict:
    result = {}
    for item in items or ():
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise TinyModelError(f"--set {item!r}: expected key=value")
        try:
            result[key] = json.loads(raw)
        except json.JSONDecodeError:
            result[key] = raw
    return result


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir", nargs="?")
    p.add_argument("--family", default="qwen3_moe", choices=FAMILIES)
    p.add_argument("--layout", default="per_expert", choices=LAYOUTS)
    p.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--config-style", default="nested", choices=CONFIG_STYLES)
    p.add_argument("--router-std", type=float, default=2.0)
    p.add_argument("--embed-std", type=float, default=1.0)
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override (JSON value)")
    p.add_argument("--list", action="store_true", help="print families, layouts and defaults")
    args = p.parse_args(argv)
    if args.list:
        for fam in FAMILIES:
            print(f"{fam}: layouts {', '.join(LAYOUTS)}; defaults {json.dumps(DEFAULTS[fam])}")
        return 0
    if not args.out_dir:
        p.error("OUT_DIR is required (or --list)")
    try:
        out = build(args.out_dir, args.family, layout=args.layout, dtype=args.dtype, seed=args.seed,
                    shards=args.shards, config_style=args.config_style, router_std=args.router_std,
                    embed_std=args.embed_std,
                    **_parse_set(args.set))
    except TinyModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in out.iterdir() if f.suffix == ".safetensors")
    print(f"wrote {out} ({args.family}, {args.layout}, {args.dtype}, {size / 2**20:.1f} MiB weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def build_ftw(root, family: str, seed: int = 0, **build_kwargs) -> tuple:
    """(checkpoint dir, FTW path): build() into root/hf, then `freetoken convert` (dtype auto)
    into root/model.ftw; what the engine tests load."""
    from ftw.convert import convert

    root = pathlib.Path(root)
    src = build(root / "hf", family, seed=seed, **build_kwargs)
    path = str(root / "model.ftw")
    convert(str(src), path, dtype="auto", progress=False)
    return src, path
