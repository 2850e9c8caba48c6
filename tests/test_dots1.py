"""dots1 (dots.llm1) beyond the oracle tests: convert from the hub layout (per-expert) and from
transformers' fused save, bitwise; the config normalised once (both styles, Dots1Config's
defaults); sliding-window layers refused; its MoE block is glm4_moe's (the grouped sigmoid
routing tested in test_glm4_moe.py) with the router and correction bias kept fp32 in bf16."""
import json

import pytest
import torch

from convert_support import assert_tensors_landed, hf_tensors
import ftw
import make_tiny_model as mtm
from freetoken.config import ModelConfig
from freetoken.experts.reference import DenseReferenceExperts
from freetoken.loader import load_model
from freetoken.models.glm4_moe import Glm4MoeBlock
from ftw.convert import convert
from ftw.errors import UnsupportedConfigError
from ftw.hf_config import detect_family, normalise

# Independent oracle: HF suffix after `model.layers.{i}.` -> FTW suffix (non-expert tensors).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_round_trip_every_layout(tmp_path, layout):
    """Every source tensor lands bitwise under its FTW name (bf16 source; the router and its
    correction bias fp32 as transformers saved them); nothing is skipped."""
    src = mtm.build(tmp_path / "hf", "dots1", layout=layout, dtype="bf16")
    out = convert(src, tmp_path / "m.ftw", threads=2)
    hf = hf_tensors(src)
    with ftw.open(out, verify=True) as f:
        assert f.config["family"] == "dots1" and f.config["source_dtype"] == "bf16"
        assert f.tensors["blk.1.exp_probs_b"].dtype == "fp32"
        assert f.tensors["blk.1.ffn_gate_inp.weight"].dtype == "fp32"
        experts = assert_tensors_landed(f, hf, set(), LAYER_NAMES, GLOBAL_NAMES)
        assert len(experts) == 2 * 8 * 3
        assert not any(n.startswith("blk.0.ffn_gate_inp") for n in f.tensors)  # layer 0 dense
        assert f.metadata["source.ignored_tensors"] == []


def test_config_fields(tmp_path):
    with ftw.open(convert(mtm.build(tmp_path / "hf", "dots1"), tmp_path / "m.ftw")) as f:
        c = f.config
    assert c["moe_layers"] == [1, 2] and c["intermediate_size"] == 112
    assert (c["router_scoring"], c["num_expert_groups"], c["num_topk_groups"]) == ("sigmoid", 4, 2)
    assert (c["routed_scaling_factor"], c["norm_topk_prob"]) == (2.5, True)
    assert (c["shared_expert_intermediate_size"], c["shared_expert_gate"]) == (96, False)
    assert (c["qk_norm"], c["attention_bias"]) == ("per_head", True)
    assert ModelConfig.from_dict(c).rotary_dim == 16 and c["sliding_window"] is None


def test_published_config_equals_nested(tmp_path):
    a = mtm.build(tmp_path / "n", "dots1", config_style="nested")
    b = mtm.build(tmp_path / "l", "dots1", config_style="legacy")
    legacy = json.loads((b / "config.json").read_text())
    assert "layer_types" not in legacy and legacy["max_window_layers"] == 3
    with ftw.open(convert(a, tmp_path / "n.ftw")) as fa, ftw.open(convert(b, tmp_path / "l.ftw")) as fb:
        assert fa.config == fb.config


def test_defaults_when_the_config_leaves_them_out(tmp_path):
    """Dots1Config's defaults: no dense layer, one group, not renormalised, scale 1, no shared
    expert (transformers' own model needs n_shared_experts, so only our reading is checked)."""
    src = mtm.build(tmp_path / "hf", "dots1", config_style="legacy")
    cfg = json.loads((src / "config.json").read_text())
    for key in ("first_k_dense_replace", "norm_topk_prob", "n_group", "topk_group",
                "routed_scaling_factor", "n_shared_experts"):
        cfg.pop(key)
    c = normalise(cfg, detect_family(cfg))
    assert c["moe_layers"] == [0, 1, 2] and c["norm_topk_prob"] is False
    assert (c["num_expert_groups"], c["num_topk_groups"], c["routed_scaling_factor"]) == (1, 1, 1.0)
    assert c["shared_expert_intermediate_size"] == 0


@pytest.mark.parametrize("fields", [
    dict(sliding_window=8, max_window_layers=1),  # layers 1 and 2 slide
    dict(layer_types=["full_attention", "sliding_attention", "full_attention"], sliding_window=8),
])
def test_sliding_window_layers_are_refused(tmp_path, fields):
    src = mtm.build(tmp_path / "hf", "dots1", config_style="legacy")
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(fields)
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedConfigError, match="max_window_layers"):
        convert(src, tmp_path / "m.ftw")


def test_moe_block_is_glm4_moes_and_its_router_stays_fp32(tmp_path):
    src = mtm.build(tmp_path / "hf", "dots1", dtype="bf16")
    with ftw.open(convert(src, tmp_path / "m.ftw")) as f:
        config = ModelConfig.from_dict(f.config)
        model = load_model(f, config, "cpu", torch.bfloat16,
                           DenseReferenceExperts(f.load_banks(), config, "cpu", torch.bfloat16))
    assert isinstance(model.blk[1].ffn, Glm4MoeBlock)
    params = dict(model.named_parameters())
    for layer in (1, 2):
        assert params[f"blk.{layer}.ffn.ffn_gate_inp.weight"].dtype == torch.float32
        assert params[f"blk.{layer}.ffn.exp_probs_b"].dtype == torch.float32
    assert params["blk.1.ffn.ffn_gate_shexp.weight"].dtype == torch.bfloat16
    assert params["blk.1.attn.attn_output.bias"].dtype == torch.bfloat16
