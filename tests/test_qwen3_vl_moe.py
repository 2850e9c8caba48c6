"""qwen3_vl_moe (Qwen3-VL MoE, its text model) beyond the oracle tests: convert from the hub
layout (experts fused [E, in, out] under model.language_model.) and from transformers' save
([E, out, in]), bitwise; the vision tower skipped and named by `inspect`; an expert block that
reads both ways refused; the config normalised once (both styles, M-RoPE sections ignored, the
top-k weights always renormalised)."""
import json

import pytest
from click.testing import CliRunner

from convert_support import assert_tensors_landed, hf_tensors
import ftw
import make_tiny_model as mtm
from freetoken.cli import main
from ftw.convert import convert
from ftw.errors import UnsupportedConfigError

# Independent oracle: HF suffix after `model.layers.{i}.` -> FTW suffix (non-expert tensors).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
TEXT = "model.language_model."


def as_text_model(hf: dict, layout: str) -> dict:
    """The checkpoint's text tensors under model.* with experts [E, out, in] (the hub's [E, in,
    out] transposed back), as convert_support reads them; vision tensors unchanged."""
    out = {}
    for name, t in hf.items():
        if name.startswith(TEXT):
            name = "model." + name[len(TEXT):]
        if layout == "per_expert" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            t = t.transpose(1, 2)
        out[name] = t
    return out


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_round_trip_every_layout(tmp_path, layout):
    """Every text tensor lands bitwise under its FTW name (bf16 source); the hub layout's experts
    are [E, in, out], transformers' [E, out, in]; the vision tower is skipped."""
    src = mtm.build(tmp_path / "hf", "qwen3_vl_moe", layout=layout, dtype="bf16")
    hf = hf_tensors(src)
    gate_up = hf[TEXT + "layers.1.mlp.experts.gate_up_proj"]
    assert tuple(gate_up.shape) == ((8, 64, 96) if layout == "per_expert" else (8, 96, 64))
    out = convert(src, tmp_path / "m.ftw", threads=2)
    skipped = {n for n in hf if n.startswith("model.visual.")}
    with ftw.open(out, verify=True) as f:
        assert f.config["family"] == "qwen3_vl_moe" and f.config["source_dtype"] == "bf16"
        experts = assert_tensors_landed(f, as_text_model(hf, layout), skipped, LAYER_NAMES,
                                        GLOBAL_NAMES)
        assert len(experts) == 3 * 8 * 3
        assert f.metadata["source.ignored_tensors"] == sorted(skipped)


def test_inspect_shows_family_and_the_skipped_vision_tower(tmp_path):
    src = mtm.build(tmp_path / "hf", "qwen3_vl_moe")
    out = tmp_path / "m.ftw"
    r = CliRunner().invoke(main, ["convert", str(src), "-o", str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert r.exit_code == 0, r.output
    assert "* family: qwen3_vl_moe" in r.output
    with ftw.open(out) as f:
        skipped = f.metadata["source.ignored_reasons"]
    assert "model.visual.patch_embed.proj.weight" in skipped
    assert all(n.startswith("model.visual.") for n in skipped)
    assert f"* skipped source tensors ({len(skipped)}):" in r.output
    lines = r.output.splitlines()
    for name, reason in skipped.items():
        assert reason == "vision tower (freetoken runs the text model)"
        assert any(line.split() and line.split()[0] == name and line.rstrip().endswith(reason)
                   for line in lines), name


def test_config_fields(tmp_path):
    """The text_config read: M-RoPE is plain RoPE for text, weights always renormalised (the
    config has no norm_topk_prob), every layer MoE but mlp_only_layers, q/k/v/o biases."""
    src = mtm.build(tmp_path / "hf", "qwen3_vl_moe", mlp_only_layers=[1])
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_vl_moe" and "norm_topk_prob" not in cfg["text_config"]
    assert cfg["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]
    with ftw.open(convert(src, tmp_path / "m.ftw")) as f:
        c = f.config
    assert c["moe_layers"] == [0, 2] and c["norm_topk_prob"] is True
    assert (c["rope_scaling"], c["rope_theta"]) == (None, 10000.0)
    assert (c["qk_norm"], c["attention_bias"], c["router_scoring"]) == ("per_head", True, "softmax")
    assert (c["vocab_size"], c["bos_token_id"], c["eos_token_ids"]) == (384, 0, [2])


def test_published_config_equals_nested(tmp_path):
    a = mtm.build(tmp_path / "n", "qwen3_vl_moe", config_style="nested")
    b = mtm.build(tmp_path / "l", "qwen3_vl_moe", config_style="legacy")
    legacy = json.loads((b / "config.json").read_text())["text_config"]
    assert "rope_parameters" not in legacy and legacy["rope_scaling"]["mrope_section"] == [2, 3, 3]
    with ftw.open(convert(a, tmp_path / "n.ftw")) as fa, ftw.open(convert(b, tmp_path / "l.ftw")) as fb:
        assert fa.config == fb.config


def test_square_expert_block_is_refused(tmp_path):
    """hidden 64 = 2 x 32: gate_up_proj [8, 64, 64] reads as [E, in, out] and as [E, out, in]."""
    src = mtm.build(tmp_path / "hf", "qwen3_vl_moe", moe_intermediate_size=32)
    with pytest.raises(UnsupportedConfigError, match="reads both as"):
        convert(src, tmp_path / "m.ftw")
