"""llama4_text (the text model of Llama 4 Scout / Maverick) beyond the oracle tests: convert from
its layout (experts fused [E, in, out]; the same from transformers' save) and from the VLM
checkpoint the hub publishes (under language_model., vision tower skipped), bitwise; the config
fields (MoE and NoPE layers by list or by step, chunked layers, q/k norm, temperature, dense and
shared widths) with Llama4TextConfig's defaults, published and nested configs alike; what it
cannot run refused; each of its features moves the tiny model's output (so the oracle tests see
it); the cuda path (under Triton's interpreter here) never takes the full-rotary q/k kernel nor
the softmax router kernel and equals the torch path."""
import json
import re

import pytest
import torch

from convert_support import assert_config_refused, assert_tensors_landed, hf_tensors
import ftw
import make_tiny_model as mtm
from freetoken.config import ModelConfig
from freetoken.experts.reference import DenseReferenceExperts
from freetoken.kv_cache import KVCache
from freetoken.loader import load_model
from ftw.convert import convert
from ftw.hf_config import detect_family, normalise

# Independent oracle: HF suffix after `model.layers.{i}.` -> FTW suffix (non-expert tensors).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "feed_forward.router.weight": "ffn_gate_inp.weight",
    "feed_forward.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "feed_forward.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "feed_forward.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "feed_forward.gate_proj.weight": "ffn_gate.weight", "feed_forward.up_proj.weight": "ffn_up.weight",
    "feed_forward.down_proj.weight": "ffn_down.weight",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def as_text_model(hf: dict) -> dict:
    """The checkpoint's text tensors under model.* / lm_head, experts [E, out, in] under mlp.
    (Llama 4's [E, in, out] transposed back), as convert_support reads them; the VLM's vision
    tensors unchanged."""
    out = {}
    for name, t in hf.items():
        name = name.removeprefix("language_model.")
        fused_name = re.fullmatch(r"(model\.layers\.\d+\.)feed_forward\.(experts\.(gate_up|down)_proj)", name)
        if fused_name:
            name, t = fused_name[1] + "mlp." + fused_name[2], t.transpose(1, 2)
        out[name] = t
    return out


@pytest.mark.parametrize("layout", ["per_expert", "vlm"])
def test_round_trip_every_layout(tmp_path, layout):
    """Every text tensor lands bitwise under its FTW name (bf16 source); the VLM's vision tower
    and projector are skipped and named."""
    src = mtm.build(tmp_path / "hf", "llama4_text", layout=layout, dtype="bf16")
    out = convert(src, tmp_path / "m.ftw", threads=2)
    hf = as_text_model(hf_tensors(src))
    vision = {n for n in hf if n.startswith(("vision_model.", "multi_modal_projector."))}
    assert bool(vision) == (layout == "vlm")
    with ftw.open(out, verify=True) as f:
        assert f.config["family"] == "llama4_text" and f.config["source_dtype"] == "bf16"
        experts = assert_tensors_landed(f, hf, vision, LAYER_NAMES, GLOBAL_NAMES)
        assert len(experts) == 2 * 8 * 3  # MoE in layers 1 and 3
        assert not any(n.startswith("blk.0.ffn_gate_inp") for n in f.tensors)  # dense
        assert f.metadata["source.ignored_tensors"] == sorted(vision)


def test_config_fields(tmp_path):
    with ftw.open(convert(mtm.build(tmp_path / "hf", "llama4_text"), tmp_path / "m.ftw")) as f:
        c = f.config
    assert (c["moe_layers"], c["num_experts_per_tok"], c["router_scoring"]) == ([1, 3], 1, "sigmoid_input")
    assert (c["moe_intermediate_size"], c["shared_expert_intermediate_size"], c["intermediate_size"]) == (48, 48, 112)
    assert (c["shared_expert_gate"], c["rope_interleaved"], c["qk_l2_norm"]) == (False, True, True)
    assert c["no_rope_layers"] == [3] and c["attention_chunk_size"] == 8
    assert c["layer_types"] == ["chunked_attention"] * 3 + ["full_attention"]
    assert (c["attn_temperature_tuning"], c["floor_scale"], c["attn_scale"]) == (True, 4, 0.5)
    assert (c["head_dim"], c["rms_norm_eps"], c["rope_theta"]) == (16, 1e-5, 5e5)


def test_published_config_equals_nested(tmp_path):
    """The published configs give the MoE and NoPE layers by interleave_moe_layer_step and
    no_rope_layer_interval (an empty no_rope_layers), no layer_types; transformers 5 writes the
    lists."""
    a = mtm.build(tmp_path / "n", "llama4_text", config_style="nested")
    b = mtm.build(tmp_path / "l", "llama4_text", config_style="legacy")
    legacy = json.loads((b / "config.json").read_text())
    assert legacy["no_rope_layers"] == [] and "moe_layers" not in legacy and "layer_types" not in legacy
    with ftw.open(convert(a, tmp_path / "n.ftw")) as fa, ftw.open(convert(b, tmp_path / "l.ftw")) as fb:
        assert fa.config == fb.config


def test_defaults_when_the_config_leaves_them_out(tmp_path):
    """Llama4TextConfig's defaults: every layer MoE, every 4th without rotary, chunks of 8192 on
    the others, q/k norm and temperature on (floor 8192, scale 0.1), dense MLPs 16384 wide,
    head_dim 128, rms_norm_eps 1e-5, rope_theta 500000."""
    src = mtm.build(tmp_path / "hf", "llama4_text", config_style="legacy")
    cfg = json.loads((src / "config.json").read_text())
    for key in ("interleave_moe_layer_step", "no_rope_layers", "no_rope_layer_interval",
                "attention_chunk_size", "use_qk_norm", "attn_temperature_tuning", "floor_scale",
                "attn_scale", "intermediate_size_mlp", "head_dim", "rms_norm_eps", "rope_theta"):
        cfg.pop(key)
    c = normalise(cfg, detect_family(cfg))
    assert (c["moe_layers"], c["no_rope_layers"], c["attention_chunk_size"]) == ([0, 1, 2, 3], [3], 8192)
    assert c["layer_types"] == ["chunked_attention"] * 3 + ["full_attention"]
    assert (c["qk_l2_norm"], c["attn_temperature_tuning"], c["floor_scale"], c["attn_scale"]) == (
        True, True, 8192, 0.1)
    assert (c["intermediate_size"], c["head_dim"], c["rms_norm_eps"], c["rope_theta"]) == (
        16384, 128, 1e-5, 500000.0)


@pytest.mark.parametrize("changes, message", [
    (dict(num_experts_per_tok=2), "top-1 only"),
    (dict(quantization_config={"quant_method": "fbgemm_fp8"}), "quantized ('fbgemm_fp8')"),
    (dict(layer_types=["sliding_attention"] * 4), "layer_types must list 4 entries"),
    (dict(no_rope_layers=[1, 0]), "no_rope_layers must list 0 or 1 for each of the 4 layers"),
    (dict(attention_chunk_size=0), "attention_chunk_size is 0"),
    (dict(partial_rotary_factor=0.5), "partial rotary"),
])
def test_bad_configs_are_refused(tmp_path, changes, message):
    assert_config_refused(tmp_path, "llama4_text", changes, message, config_style="legacy")


def _feature_off(model, feature):
    """The tiny model with one of its features taken out (what a model that ignored it runs)."""
    for blk in model.blk:
        if feature == "chunks":
            blk.attn.chunk = None
        elif feature == "temperature":
            blk.attn.has_temperature = False
        elif feature == "qk_l2_norm":
            blk.attn.has_l2_norm = False
        elif feature == "scaled_input" and hasattr(blk.ffn, "route"):  # score x expert(x)
            blk.ffn.forward = lambda x, layer, step, ffn=blk.ffn: _weighted_output(ffn, x, layer, step)


def _weighted_output(ffn, x, layer, step):
    expert_ids, scores = ffn.route(ffn.router_logits(x))
    out = step.experts.forward(layer, x, expert_ids, scores.float())
    return out + ffn.ffn_down_shexp(torch.nn.functional.silu(ffn.ffn_gate_shexp(x)) * ffn.ffn_up_shexp(x))


@pytest.mark.parametrize("feature", ["chunks", "temperature", "qk_l2_norm", "scaled_input"])
def test_each_feature_moves_the_output(tmp_path, feature):
    """Taking out any one feature moves the 20-token output beyond the oracle tests' 1e-4."""
    with ftw.open(convert(mtm.build(tmp_path / "hf", "llama4_text"), tmp_path / "m.ftw")) as f:
        config = ModelConfig.from_dict(f.config)
        model = load_model(f, config, "cpu", torch.float32,
                           DenseReferenceExperts(f.load_banks(), config, "cpu", torch.float32))

        def run():
            with torch.no_grad():
                return model(torch.arange(3, 23), torch.arange(20), KVCache(config, 20, "cpu", torch.float32))

        before = run()
        _feature_off(model, feature)
        assert (run() - before).abs().max() > 1e-2
