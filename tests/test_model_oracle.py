"""Our models against transformers (test-only oracle) in fp32, through the real path: tiny HF
checkpoint (tools/make_tiny_model.py) -> ftw.convert -> ftw.open -> load_banks -> load_model with
the dense reference expert runtime. Teacher forcing: the prompt runs in prefill chunks smaller than
itself, then the rest token by token; every position's logits must equal HF's full-sequence
logits to 1e-4 (max abs). The hybrid families (Gated DeltaNet layers) also run a prompt longer
than the DeltaNet's chunk, in engine-sized chunks that do not line up with it, then decode."""
import pytest
import torch

import ftw
import make_tiny_model
from ftw.convert import convert
from freetoken.config import ModelConfig
from freetoken.experts.reference import DenseReferenceExperts
from freetoken.kv_cache import KVCache
from freetoken.loader import load_model
from freetoken.models import linear_attention
from freetoken.state_cache import create_state_cache

ATOL = 1e-4
NUM_TOKENS, PROMPT_LEN, CHUNK = 20, 13, 4  # chunks 4+4+4+1, then 7 decode steps


class RecordingExperts(DenseReferenceExperts):
    """The reference runtime, remembering each begin_step call."""

    def __init__(self, *args):
        super().__init__(*args)
        self.steps = []

    def begin_step(self, phase, num_tokens):
        self.steps.append((phase, num_tokens))
        super().begin_step(phase, num_tokens)


def load_pair(tmp_path, family, **build_kw):
    """(HF model, our model, ModelConfig) of one freshly built and converted tiny checkpoint."""
    src = make_tiny_model.build(tmp_path / "hf", family, **build_kw)
    out = convert(src, tmp_path / "model.ftw")
    f = ftw.open(out)
    config = ModelConfig.from_dict(f.config)
    experts = RecordingExperts(f.load_banks(), config, "cpu", torch.float32)
    ours = load_model(f, config, "cpu", torch.float32, experts)
    f.close()
    hf = make_tiny_model.load_hf(src, dtype=torch.float32).eval()
    return hf, ours, config


def prompt_ids(config, n=NUM_TOKENS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, config.vocab_size, (n,), generator=gen)


def run_ours(model, config, ids, prompt_len=PROMPT_LEN, chunk=CHUNK):
    """Logits [T, V]: chunked prefill of ids[:prompt_len], then one token per forward."""
    kv = KVCache(config, len(ids) + 3, "cpu", torch.float32)
    state = create_state_cache(config, "cpu", torch.float32)
    bounds = list(range(0, prompt_len, chunk)) + list(range(prompt_len, len(ids) + 1))
    bounds = sorted(set(bounds + [prompt_len]))
    out = []
    with torch.no_grad():
        for start, end in zip(bounds, bounds[1:]):
            out.append(model(ids[start:end], torch.arange(start, end), kv, state=state))
    assert kv.num_tokens == len(ids)
    assert state is None or state.num_tokens == len(ids)
    return torch.cat(out)


def assert_logits_close(got, want):
    diff = (got - want).abs().amax(dim=-1)  # [T]
    worst = int(diff.argmax())
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert diff[worst] <= ATOL, (f"position {worst}: max abs diff {diff[worst]:.3g} > {ATOL} "
                                 f"(per position: {[round(float(d), 7) for d in diff]})")
    return float(diff[worst])


def check(tmp_path, family, ids=None, **build_kw):
    hf, ours, config = load_pair(tmp_path, family, **build_kw)
    ids = prompt_ids(config) if ids is None else ids
    with torch.no_grad():
        want = hf(ids[None]).logits[0].float()  # [T, V]
    got = run_ours(ours, config, ids)
    assert_logits_close(got, want)
    return ours, config


FAMILY_LAYOUTS = [(f, layout) for f in make_tiny_model.FAMILIES for layout in make_tiny_model.LAYOUTS
                  if layout != "vlm" or f in make_tiny_model.VLM_LAYOUT]


@pytest.mark.parametrize("family, layout", FAMILY_LAYOUTS)
def test_family_matches_transformers(tmp_path, family, layout):
    ours, _ = check(tmp_path, family, layout=layout)
    assert ours.expert_runtime.steps == [("prefill", 4)] * 3 + [("decode", 1)] * 8


@pytest.mark.parametrize("chunk", [150, 48])
@pytest.mark.parametrize("family", make_tiny_model.HYBRID)
def test_hybrid_prefill_longer_than_a_delta_net_chunk(tmp_path, family, chunk):
    """150 prompt tokens: 3 DeltaNet chunks (64) in one forward, or forwards of 48 that cut them
    (the state carried across forwards), then 10 decode steps (the recurrent form)."""
    assert 150 > 2 * linear_attention.CHUNK and 48 % linear_attention.CHUNK
    hf, ours, config = load_pair(tmp_path, family)
    ids = prompt_ids(config, n=160)
    with torch.no_grad():
        want = hf(ids[None]).logits[0].float()
    assert_logits_close(run_ours(ours, config, ids, prompt_len=150, chunk=chunk), want)


def test_hybrid_state_is_required(tmp_path):
    from freetoken.errors import ModelError
    _, ours, config = load_pair(tmp_path, "qwen3_5_moe_text")
    with pytest.raises(ModelError, match="StateCache"):
        ours(prompt_ids(config, n=3), torch.arange(3), KVCache(config, 4, "cpu", torch.float32))


VARIANTS = {
    # a dense layer, tied embeddings, q/k/v/o biases, published-style config.json
    "qwen3_dense_tied_bias": ("qwen3_moe", dict(config_style="legacy", mlp_only_layers=[1],
                                                tie_word_embeddings=True, attention_bias=True)),
    "qwen3_bf16_source": ("qwen3_moe", dict(dtype="bf16", layout="fused")),
    "qwen3_yarn": ("qwen3_moe", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 8})),
    "qwen3_llama3_rope": ("qwen3_moe", dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8})),
    "qwen3_linear_rope": ("qwen3_moe", dict(rope_scaling={"rope_type": "linear", "factor": 3.0})),
    "qwen2_dense_first_renorm": ("qwen2_moe", dict(config_style="legacy", mlp_only_layers=[0],
                                                   norm_topk_prob=True)),
    "mixtral_sliding_window": ("mixtral", dict(config_style="legacy", sliding_window=5)),
    "olmoe_clip_qkv_renorm": ("olmoe", dict(clip_qkv=0.3, norm_topk_prob=True)),
    # published-style config (top-level partial rotary, full_attention_interval), a dense layer,
    # tied embeddings, q/k/v/o biases, top-k weights not renormalised
    "qwen3_next_legacy_dense_tied_bias": ("qwen3_next", dict(
        config_style="legacy", mlp_only_layers=[1], tie_word_embeddings=True, attention_bias=True,
        norm_topk_prob=False)),
    "qwen3_next_8_layers_gqa_values": ("qwen3_next", dict(
        num_hidden_layers=8, linear_num_value_heads=6, linear_num_key_heads=3)),
    "qwen3_5_bf16_source_tied": ("qwen3_5_moe_text", dict(dtype="bf16", tie_word_embeddings=True)),
    "qwen3_5_vlm_tied": ("qwen3_5_moe_text", dict(layout="vlm", tie_word_embeddings=True)),
    # published-style config (GLM-4.5-Air-like: no q/k norm, one group, two dense layers), tied
    "glm4_legacy_no_qk_norm_no_groups_tied": ("glm4_moe", dict(
        config_style="legacy", use_qk_norm=False, n_group=1, topk_group=1, num_hidden_layers=4,
        first_k_dense_replace=2, tie_word_embeddings=True)),
    # weights not renormalised, no attention biases, full rotary, one group of the 4 kept
    "glm4_no_renorm_no_bias_full_rotary": ("glm4_moe", dict(
        norm_topk_prob=False, attention_bias=False, partial_rotary_factor=1.0, topk_group=1,
        layout="fused")),
    "glm4_bf16_source": ("glm4_moe", dict(dtype="bf16")),
    # published-style config, tied embeddings, no yarn; a window of 2 (of 13 prompt tokens)
    "gpt_oss_legacy_tied_window_2": ("gpt_oss", dict(
        config_style="legacy", tie_word_embeddings=True, sliding_window=2,
        rope_scaling={"rope_type": "default"})),
    "gpt_oss_bf16_source": ("gpt_oss", dict(dtype="bf16", swiglu_limit=7.0)),
    # DeepSeek-V3's YaRN: the rotary tables' attention factor and the softmax's mscale_all_dim
    "deepseek_v3_yarn_mscale": ("deepseek_v3", dict(max_position_embeddings=128, rope_scaling={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "mscale": 0.8,
        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})),
    # half-split rotary (rope_interleave off), biases on q_a / kv_a / o, tied, published-style config
    "deepseek_v3_no_interleave_bias_tied_legacy": ("deepseek_v3", dict(
        rope_interleave=False, attention_bias=True, tie_word_embeddings=True, config_style="legacy")),
    # DeepSeek-V2 (not Lite): q LoRA, greedy routing over all experts, YaRN in the published form
    "deepseek_v2_q_lora_greedy_yarn_legacy": ("deepseek_v2", dict(
        q_lora_rank=24, topk_method="greedy", config_style="legacy", max_position_embeddings=128,
        rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
            "mscale": 0.707, "mscale_all_dim": 0.707})),
    "deepseek_v2_bf16_source": ("deepseek_v2", dict(dtype="bf16", layout="fused")),
    # published-style nested config (legacy text_config), tied, a dense layer, no biases (as
    # Qwen3-VL-30B-A3B); a bf16 source in the hub's [E, in, out] experts
    "qwen3_vl_moe_legacy_tied_dense_no_bias": ("qwen3_vl_moe", dict(
        config_style="legacy", tie_word_embeddings=True, mlp_only_layers=[0], attention_bias=False)),
    "qwen3_vl_moe_bf16_source": ("qwen3_vl_moe", dict(dtype="bf16")),
    # published-style config (sliding fields, no layer_types), one group, not renormalised, tied,
    # no biases (as dots.llm1)
    "dots1_legacy_no_groups_no_renorm_tied": ("dots1", dict(
        config_style="legacy", n_group=1, topk_group=1, norm_topk_prob=False,
        tie_word_embeddings=True, attention_bias=False)),
    "dots1_bf16_source": ("dots1", dict(dtype="bf16", layout="fused")),
    # published-style config; moe_norm_min 0.9 above most top-2 sums (the clamp divides); every
    # other layer sparse within [1, 3] of 5 layers; untied
    "ernie_legacy_norm_min_interval": ("ernie4_5_moe", dict(
        config_style="legacy", moe_norm_min=0.9, num_hidden_layers=5, moe_layer_interval=2,
        moe_layer_end_index=3, tie_word_embeddings=False)),
    "ernie_bf16_source": ("ernie4_5_moe", dict(dtype="bf16", layout="fused")),
    # q/k/v/o biases, rope `dynamic` with `alpha` (transformers' ntk_alpha), tied, legacy config
    "hunyuan_bias_ntk_alpha_tied_legacy": ("hunyuan_v1_moe", dict(
        attention_bias=True, tie_word_embeddings=True, config_style="legacy",
        rope_scaling={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0})),
    "hunyuan_bf16_source": ("hunyuan_v1_moe", dict(dtype="bf16")),
    # published-style config (rotary_dim, scoring_func, ...), tied; full rotary; a bf16 source
    "minimax_m2_legacy_tied": ("minimax_m2", dict(config_style="legacy", tie_word_embeddings=True)),
    "minimax_m2_full_rotary": ("minimax_m2", dict(partial_rotary_factor=1.0, layout="fused")),
    "minimax_m2_bf16_source": ("minimax_m2", dict(dtype="bf16")),
    # published-style config (no head_dim), tied (as Granite 3.x MoE), q/k/v/o biases
    "granitemoe_legacy_tied_bias": ("granitemoe", dict(config_style="legacy", tie_word_embeddings=True,
                                                       attention_bias=True)),
    "granitemoe_bf16_source": ("granitemoe", dict(dtype="bf16", layout="fused")),
    # published-style config, tied, no biases; a window of 5 on every layer and Phi-3.5-MoE's
    # jitter 0.01 (the sparsemixer's mask then rarely drops an expert)
    "phimoe_legacy_tied_no_bias": ("phimoe", dict(config_style="legacy", tie_word_embeddings=True,
                                                  attention_bias=False, lm_head_bias=False)),
    "phimoe_sliding_window_published_jitter": ("phimoe", dict(sliding_window=5, router_jitter_noise=0.01,
                                                              layout="fused")),
    "phimoe_bf16_source": ("phimoe", dict(dtype="bf16")),
    # Phi-3.5-MoE's longrope (short factors, short_mscale below original_max_position_embeddings)
    "phimoe_longrope": ("phimoe", dict(config_style="legacy", rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
        "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0], "short_mscale": 1.2,
        "long_mscale": 1.5, "original_max_position_embeddings": 64})),
    # published-style config (steps, empty no_rope_layers), tied, Scout's llama3 rope scaling
    "llama4_legacy_llama3_rope_tied": ("llama4_text", dict(
        config_style="legacy", tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8})),
    # every layer MoE, no q/k norm, no temperature, q/k/v/o biases, no chunks
    "llama4_all_moe_plain_attention_bias": ("llama4_text", dict(
        interleave_moe_layer_step=1, use_qk_norm=False, attn_temperature_tuning=False,
        attention_bias=True, attention_chunk_size=None)),
    "llama4_bf16_source": ("llama4_text", dict(dtype="bf16")),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_matches_transformers(tmp_path, variant):
    family, build_kw = VARIANTS[variant]
    check(tmp_path, family, **build_kw)


def test_dynamic_rope_beyond_trained_length(tmp_path):
    """Dynamic NTK rescales by the longest position seen, so HF's full-sequence forward equals a
    single forward of ours (chunks would see shorter lengths: that is dynamic NTK, not a bug)."""
    hf, ours, config = load_pair(tmp_path, "qwen3_moe", max_position_embeddings=8,
                                 rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    ids = prompt_ids(config)
    with torch.no_grad():
        want = hf(ids[None]).logits[0].float()
        got = ours(ids, torch.arange(len(ids)), KVCache(config, len(ids), "cpu", torch.float32))
    assert_logits_close(got, want)


def test_num_logits_and_full_context(tmp_path):
    hf, ours, config = load_pair(tmp_path, "olmoe")
    ids = prompt_ids(config, n=6)
    kv = KVCache(config, 6, "cpu", torch.float32)
    with torch.no_grad():
        last = ours(ids, torch.arange(6), kv, num_logits=1)  # [1, V]
        want = hf(ids[None]).logits[0, -1:].float()
    assert last.shape == (1, config.vocab_size)
    assert_logits_close(last, want)
    from freetoken.errors import ModelError
    with pytest.raises(ModelError, match="context is full"):
        ours(ids[:1], torch.tensor([6]), kv)
    assert kv.num_tokens == 6
