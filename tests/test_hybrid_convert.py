"""freetoken convert / inspect of the hybrid families, qwen3_next and qwen3_5_moe_text: the hub
layout (per-expert), transformers' save_pretrained layouts (both), the Qwen3.5/3.6 VLM checkpoint
(text under model.language_model., vision and mtp skipped with their reasons), bitwise; the
hybrid config fields normalised once; bad configs refused with what to change."""
import json

import pytest
from click.testing import CliRunner

from convert_support import assert_tensors_landed, edit_config, hf_tensors
import ftw
import make_tiny_model as mtm
from freetoken.cli import main
from ftw.convert import convert
from ftw.errors import ConvertError

# Independent oracle: HF suffix after the layer prefix -> FTW suffix (non-expert tensors).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkvz.weight": "ssm_in_qkvz.weight", "linear_attn.in_proj_ba.weight": "ssm_in_ba.weight",
    "linear_attn.in_proj_qkv.weight": "ssm_in_qkv.weight", "linear_attn.in_proj_z.weight": "ssm_in_z.weight",
    "linear_attn.in_proj_b.weight": "ssm_in_b.weight", "linear_attn.in_proj_a.weight": "ssm_in_a.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a_log", "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
GLOBAL_NAMES = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
CASES = [("qwen3_next", "per_expert"), ("qwen3_next", "fused"),
         ("qwen3_5_moe_text", "per_expert"), ("qwen3_5_moe_text", "fused"), ("qwen3_5_moe_text", "vlm")]


@pytest.mark.parametrize("family, layout", CASES)
def test_round_trip_every_layout(tmp_path, family, layout):
    src = mtm.build(tmp_path / "hf", family, layout=layout, dtype="bf16")
    out = convert(src, tmp_path / "m.ftw", threads=2)
    hf = hf_tensors(src)
    prefix = "model.language_model." if layout == "vlm" else "model."
    skipped = {n for n in hf if n.startswith(("model.visual.", "mtp."))}
    assert bool(skipped) == (layout == "vlm")
    with ftw.open(out, verify=True) as f:
        assert f.config["family"] == family and f.config["source_dtype"] == "bf16"
        experts = assert_tensors_landed(f, hf, skipped, LAYER_NAMES, GLOBAL_NAMES, prefix)
        assert len(experts) == 4 * 8 * 3
        assert f.metadata["source.ignored_tensors"] == sorted(skipped)
        reasons = f.metadata["source.ignored_reasons"]
        assert set(reasons) == skipped
        assert all(("vision" in r) if n.startswith("model.visual.") else ("multi-token" in r)
                   for n, r in reasons.items())


def test_inspect_shows_family_and_every_skipped_tensor(tmp_path):
    src = mtm.build(tmp_path / "hf", "qwen3_5_moe_text", layout="vlm")
    out = tmp_path / "m.ftw"
    r = CliRunner().invoke(main, ["convert", str(src), "-o", str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert r.exit_code == 0, r.output
    assert "* family: qwen3_5_moe_text (source qwen3_5_moe)" in r.output
    with ftw.open(out) as f:
        skipped = f.metadata["source.ignored_reasons"]
    assert len(skipped) > 10 and "mtp.fc.weight" in skipped
    assert f"* skipped source tensors ({len(skipped)}):" in r.output
    lines = r.output.splitlines()
    for name, reason in skipped.items():
        assert any(line.split() and line.split()[0] == name and line.rstrip().endswith(reason)
                   for line in lines), name


def test_hybrid_config_fields(tmp_path):
    cfgs = {}
    for family in mtm.HYBRID:
        with ftw.open(convert(mtm.build(tmp_path / family, family), tmp_path / f"{family}.ftw")) as f:
            cfgs[family] = f.config
    nxt, q35 = cfgs["qwen3_next"], cfgs["qwen3_5_moe_text"]
    for c in cfgs.values():
        assert c["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
        assert (c["partial_rotary_factor"], c["attn_output_gate"], c["rope_scaling"]) == (0.25, True, None)
        assert (c["linear_conv_kernel_dim"], c["linear_num_key_heads"], c["linear_num_value_heads"],
                c["linear_key_head_dim"], c["linear_value_head_dim"]) == (4, 2, 4, 16, 24)
        assert (c["shared_expert_intermediate_size"], c["shared_expert_gate"]) == (80, True)
        assert c["moe_layers"] == [0, 1, 2, 3] and c["norm_topk_prob"] is True
    assert nxt["intermediate_size"] == 96 and q35["intermediate_size"] == 0


def test_published_qwen3_next_config_equals_nested(tmp_path):
    """Top-level partial_rotary_factor and full_attention_interval (no layer_types) read as the
    nested transformers 5 config does."""
    a = mtm.build(tmp_path / "n", "qwen3_next", config_style="nested")
    b = mtm.build(tmp_path / "l", "qwen3_next", config_style="legacy")
    assert "layer_types" not in json.loads((b / "config.json").read_text())
    with ftw.open(convert(a, tmp_path / "n.ftw")) as fa, ftw.open(convert(b, tmp_path / "l.ftw")) as fb:
        assert fa.config == fb.config


def test_bad_hybrid_configs_are_refused(tmp_path):
    src = mtm.build(tmp_path / "q", "qwen3_next")
    edit_config(src, layer_types=["linear_attention", "sliding_attention", "linear_attention",
                                   "full_attention"])
    with pytest.raises(ConvertError, match="layer_types must list 4 entries"):
        convert(src, tmp_path / "a.ftw")
    edit_config(src, layer_types=None, attn_output_gate=False)
    with pytest.raises(ConvertError, match="attention output gate"):
        convert(src, tmp_path / "g.ftw")
    edit_config(src, attn_output_gate=True, linear_num_value_heads=3)
    with pytest.raises(ConvertError, match="multiple of linear_num_key_heads"):
        convert(src, tmp_path / "b.ftw")
    other = mtm.build(tmp_path / "o", "qwen3_moe")
    cfg = json.loads((other / "config.json").read_text())
    edit_config(other, rope_parameters=dict(cfg["rope_parameters"], partial_rotary_factor=0.5))
    with pytest.raises(ConvertError, match="partial rotary"):
        convert(other, tmp_path / "c.ftw")
