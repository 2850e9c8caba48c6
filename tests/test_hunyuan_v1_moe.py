"""hunyuan_v1_moe (Hunyuan MoE) beyond the oracle tests: convert from the hub layout (per-expert,
router `gate.wg`, `shared_mlp`, q/k norms named `query_layernorm` / `key_layernorm`) and from
transformers' save_pretrained layouts, bitwise; the config fields (top-k `moe_topk`, per-layer
lists of one value, rope `dynamic` + `alpha` as a fixed base); bad configs refused; the router
kept fp32 in a bf16 model; the q/k norm after the rotary is not the norm before it; the cuda path
(under Triton's interpreter here) never takes the norm-then-rotary q/k kernel and equals the
torch path."""
import json

import pytest
import torch

from convert_support import assert_config_refused, assert_tensors_landed, hf_tensors, load_reference
import ftw
import make_tiny_model as mtm
from freetoken.kv_cache import KVCache
from ftw.convert import convert

# Independent oracle: HF suffix after `model.layers.{i}.` -> FTW suffix (non-expert tensors).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.query_layernorm.weight": "attn_q_norm.weight",
    "self_attn.key_layernorm.weight": "attn_k_norm.weight",
    "mlp.gate.wg.weight": "ffn_gate_inp.weight",
    "mlp.shared_mlp.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_mlp.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_mlp.down_proj.weight": "ffn_down_shexp.weight",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_round_trip_every_layout(tmp_path, layout):
    """Every source tensor lands bitwise under its FTW name (bf16 source, the router fp32 as
    transformers saved it, q/k/v/o biases)."""
    src = mtm.build(tmp_path / "hf", "hunyuan_v1_moe", layout=layout, dtype="bf16",
                    attention_bias=True)
    out = convert(src, tmp_path / "m.ftw", threads=2)
    hf = hf_tensors(src)
    with ftw.open(out, verify=True) as f:
        assert f.config["family"] == "hunyuan_v1_moe" and f.config["source_dtype"] == "bf16"
        assert f.tensors["blk.0.ffn_gate_inp.weight"].dtype == "fp32"
        experts = assert_tensors_landed(f, hf, set(), LAYER_NAMES, GLOBAL_NAMES)
        assert len(experts) == 3 * 8 * 3  # every layer sparse
        assert f.metadata["source.ignored_tensors"] == []


def test_config_fields(tmp_path):
    src = mtm.build(tmp_path / "hf", "hunyuan_v1_moe", config_style="legacy")
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["num_experts"] == 8 and cfg["moe_topk"] == 2
    cfg.update(num_experts=[8, 8, 8], moe_topk=[2, 2, 2],  # per-layer lists of one value
               rope_scaling={"type": "dynamic", "alpha": 1000.0, "factor": 1.0})
    (src / "config.json").write_text(json.dumps(cfg))
    with ftw.open(convert(src, tmp_path / "m.ftw")) as f:
        c = f.config
    assert (c["num_experts"], c["num_experts_per_tok"], c["moe_layers"]) == (8, 2, [0, 1, 2])
    assert (c["shared_expert_intermediate_size"], c["shared_expert_gate"]) == (48, False)
    assert (c["qk_norm"], c["qk_norm_after_rope"], c["norm_topk_prob"]) == ("per_head", True, True)
    # transformers' ntk_alpha: base theta * alpha ** (hd / (hd - 2)), then plain RoPE
    assert c["rope_scaling"] is None
    assert c["rope_theta"] == pytest.approx(10000.0 * 1000.0 ** (16 / 14))


@pytest.mark.parametrize("changes, message", [
    (dict(moe_topk=[2, 1, 2]), "moe_topk [2, 1, 2] differs between layers"),
    (dict(use_cla=True), "use_cla"),
    (dict(partial_rotary_factor=0.5), "partial rotary"),
])
def test_bad_configs_are_refused(tmp_path, changes, message):
    assert_config_refused(tmp_path, "hunyuan_v1_moe", changes, message, layout="fused", config_style="legacy")


def test_router_stays_fp32_in_bf16(tmp_path):
    model, config = load_reference(convert(mtm.build(tmp_path / "hf", "hunyuan_v1_moe"), tmp_path / "m.ftw"),
                          torch.bfloat16)
    params = dict(model.named_parameters())
    assert all(params[f"blk.{i}.ffn.ffn_gate_inp.weight"].dtype == torch.float32 for i in range(3))
    assert params["blk.1.ffn.ffn_gate_shexp.weight"].dtype == torch.bfloat16
    logits = model(torch.arange(3, 9), torch.arange(6), KVCache(config, 6, "cpu", torch.bfloat16))
    assert logits.shape == (6, config.vocab_size) and torch.isfinite(logits).all()


def test_the_norm_order_changes_the_output(tmp_path):
    """The tiny model's q/k norm weights are far enough from 1 that norming before the rotary
    (qwen3_moe's order) moves the output beyond the oracle tests' 1e-4."""
    model, config = load_reference(convert(mtm.build(tmp_path / "hf", "hunyuan_v1_moe"), tmp_path / "m.ftw"),
                          torch.float32)
    ids = torch.arange(3, 23)

    def run():
        with torch.no_grad():
            return model(ids, torch.arange(20), KVCache(config, 20, "cpu", torch.float32))

    before = run()
    for blk in model.blk:
        blk.attn.is_norm_after_rope = False
    assert (run() - before).abs().max() > 1e-2
