"""phimoe (Phi-3.5-MoE) beyond the oracle tests: convert from the hub layout (mixtral's names,
LayerNorm and lm_head biases) and from transformers' save_pretrained layouts (router
`mlp.router`), bitwise; the config fields (router_jitter_noise, LayerNorms, output bias, sliding
window) and their defaults; bad configs refused; longrope past its original length (one forward,
as transformers picks the scale); the sparsemixer route against transformers' own
function (the inference path: exactly 2 experts, the jitter threshold) in fp32 and bf16, and its
threshold moving the output; the cuda path (under Triton's interpreter here) never takes the
RMSNorm or softmax router kernels and equals the torch path."""
import dataclasses
import json

import pytest
import torch
from transformers.models.phimoe import modeling_phimoe

from convert_support import assert_config_refused, assert_tensors_landed, hf_tensors, load_reference
import ftw
import make_tiny_model as mtm
from freetoken.kv_cache import KVCache
from freetoken.models.phimoe import sparsemixer_top2
from ftw.convert import convert

# Independent oracle: HF suffix after `model.layers.{i}.` -> FTW suffix (non-expert tensors).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "input_layernorm.bias": "attn_norm.bias", "post_attention_layernorm.bias": "ffn_norm.bias",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight", "mlp.router.weight": "ffn_gate_inp.weight",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "model.norm.bias": "output_norm.bias", "lm_head.weight": "output.weight",
                "lm_head.bias": "output.bias"}


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_round_trip_every_layout(tmp_path, layout):
    """Every source tensor lands bitwise under its FTW name (bf16 source); nothing is skipped."""
    src = mtm.build(tmp_path / "hf", "phimoe", layout=layout, dtype="bf16")
    out = convert(src, tmp_path / "m.ftw", threads=2)
    hf = hf_tensors(src)
    with ftw.open(out, verify=True) as f:
        assert f.config["family"] == "phimoe" and f.config["source_dtype"] == "bf16"
        assert f.tensors["output.bias"].shape == (384,) and f.tensors["blk.2.ffn_norm.bias"].shape == (64,)
        experts = assert_tensors_landed(f, hf, set(), LAYER_NAMES, GLOBAL_NAMES)
        assert len(experts) == 3 * 8 * 3  # every layer sparse
        assert f.metadata["source.ignored_tensors"] == []


def test_config_fields(tmp_path):
    src = mtm.build(tmp_path / "hf", "phimoe", config_style="legacy", sliding_window=7)
    legacy = json.loads((src / "config.json").read_text())
    assert "head_dim" not in legacy and legacy["num_local_experts"] == 8
    with ftw.open(convert(src, tmp_path / "m.ftw")) as f:
        c = f.config
    assert (c["router_scoring"], c["router_jitter_noise"], c["num_experts_per_tok"]) == ("sparsemixer", 0.2, 2)
    assert (c["layer_norm"], c["output_bias"], c["attention_bias"]) == (True, True, True)
    assert (c["rms_norm_eps"], c["rope_theta"], c["sliding_window"]) == (1e-5, 1e6, 7)
    assert (c["moe_layers"], c["moe_intermediate_size"], c["qk_norm"]) == ([0, 1, 2], 48, "none")


def test_defaults_when_the_config_leaves_them_out(tmp_path):
    """PhimoeConfig's defaults: router_jitter_noise 0.01, no lm_head bias (and then none is
    expected), rms_norm_eps 1e-5, rope_theta 1e6."""
    src = mtm.build(tmp_path / "hf", "phimoe", config_style="legacy", lm_head_bias=False)
    cfg = json.loads((src / "config.json").read_text())
    for key in ("router_jitter_noise", "lm_head_bias", "rms_norm_eps", "rope_theta"):
        cfg.pop(key)
    (src / "config.json").write_text(json.dumps(cfg))
    with ftw.open(convert(src, tmp_path / "m.ftw")) as f:
        c = f.config
        assert "output.bias" not in f.tensors
    assert (c["router_jitter_noise"], c["output_bias"], c["rms_norm_eps"], c["rope_theta"]) == (
        0.01, False, 1e-5, 1e6)


# Phi-3.5-MoE's rope scaling on the tiny model's 8 rotary frequencies (head_dim 16)
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
            "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0], "short_mscale": 1.2,
            "long_mscale": 1.5, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("changes, message", [
    (dict(num_experts_per_tok=3), "takes exactly 2"),
    (dict(router_jitter_noise=-0.1), "router_jitter_noise is -0.1"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0, "short_mscale": 1.0,
                        "long_mscale": 1.2}), "rope_scaling 'linear'"),
    (dict(rope_scaling=dict(LONGROPE, short_factor=[1.0] * 4)), "short_factor must list 8"),
    (dict(rope_scaling=dict(LONGROPE, long_mscale=None)), "long_mscale is None"),
    (dict(tie_word_embeddings=True), "lm_head_bias and tie_word_embeddings"),
])
def test_bad_configs_are_refused(tmp_path, changes, message):
    assert_config_refused(tmp_path, "phimoe", changes, message, layout="fused", config_style="legacy")


def test_longrope_past_the_original_length_matches_transformers(tmp_path):
    """One forward of 20 tokens past original_max_position_embeddings 8: transformers and ours
    both scale that forward's cos/sin by long_mscale (the frequencies stay the short factors').
    The scale is chosen per forward, as transformers does, so only a single forward compares to
    its full-sequence one (the shorter forwards are the oracle variant's)."""
    from test_model_oracle import assert_logits_close, load_pair, prompt_ids
    hf, ours, config = load_pair(tmp_path, "phimoe", rope_scaling=dict(
        LONGROPE, original_max_position_embeddings=8))
    ids = prompt_ids(config)
    with torch.no_grad():
        want = hf(ids[None]).logits[0].float()
        got = ours(ids, torch.arange(len(ids)), KVCache(config, len(ids), "cpu", torch.float32))
    assert_logits_close(got, want)
    for last, mscale in ((8, 1.2), (9, 1.5)):  # cos(0) x the forward's mscale
        cos, _ = ours.rotary.cos_sin(torch.arange(last), torch.float32)
        assert float(cos[0].max()) == pytest.approx(mscale)


# ---- the sparsemixer route ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("eps", [0.0, 0.01, 0.2, 10.0])
def test_sparsemixer_equals_transformers(dtype, eps):
    """Against transformers' own sparsemixer at inference (training=False), logits of both signs
    with ties: the same experts in the same order, the same weights (in the logits' dtype)."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 8, generator=g) * 2).to(dtype)
    logits[:4, :2] = logits[:4, 2:4]  # a few ties
    want_w, want_ids = modeling_phimoe.sparsemixer(logits, jitter_eps=eps, training=False)
    ids, w = sparsemixer_top2(logits, eps)
    assert torch.equal(ids, want_ids) and w.dtype == torch.float32
    assert torch.equal(w, want_w.float())


def test_sparsemixer_worked_example():
    ids, w = sparsemixer_top2(torch.tensor([[4.0, 3.5, 1.0]]), 0.1)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(w, torch.tensor([[torch.sigmoid(torch.tensor(0.5)).item(), 1.0]]))


def test_the_jitter_threshold_changes_the_output(tmp_path):
    """The tiny model's threshold (0.2) masks experts out of the weights' softmax: without it
    (a threshold no logit gap reaches) the output moves beyond the oracle tests' 1e-4."""
    model, config = load_reference(convert(mtm.build(tmp_path / "hf", "phimoe"), tmp_path / "m.ftw"),
                          torch.float32)
    ids = torch.arange(3, 23)

    def run(model):
        with torch.no_grad():
            return model(ids, torch.arange(20), KVCache(model.config, 20, "cpu", torch.float32))

    before = run(model)
    for blk in model.blk:
        blk.ffn.config = dataclasses.replace(config, router_jitter_noise=1e6)
    assert (run(model) - before).abs().max() > 1e-2
