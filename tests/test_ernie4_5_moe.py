"""ernie4_5_moe (ERNIE-4.5 MoE) beyond the oracle tests: convert from the hub layout (per-expert,
the [1, E] correction bias under moe_statics, the multi-token-prediction tensors skipped and named)
and from transformers' save_pretrained layouts, bitwise; the config fields (MoE layer span and
interval, moe_norm_min, shared experts, interleaved rotary, tied embeddings); bad configs refused;
the biased softmax route against a brute-force reference; the router and bias kept fp32 in a bf16
model; the cuda path (under Triton's interpreter here) never takes the full-rotary q/k kernel nor
the softmax router kernel and equals the torch path."""
import json

import pytest
import torch
from safetensors.torch import save_file

from convert_support import assert_config_refused, assert_tensors_landed, hf_tensors
import ftw
import make_tiny_model as mtm
from freetoken.experts.reference import DenseReferenceExperts
from freetoken.config import ModelConfig
from freetoken.kv_cache import KVCache
from freetoken.loader import load_model
from freetoken.models.moe import softmax_bias_topk
from ftw.convert import convert

# Independent oracle: HF suffix after `model.layers.{i}.` -> FTW suffix (non-expert tensors).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.moe_statics.e_score_correction_bias": "exp_probs_b",
    "mlp.gate.moe_statics.e_score_correction_bias": "exp_probs_b",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
# the hub's multi-token-prediction tensors (names as ERNIE-4.5's files have them)
MTP = ("model.mtp_block.0.input_layernorm.weight", "model.mtp_emb_norm.0.weight",
       "model.mtp_hidden_norm.0.weight", "model.mtp_linear_proj.0.weight")


def _add_mtp_tensors(src):
    D = mtm.DEFAULTS["ernie4_5_moe"]["hidden_size"]
    shapes = {name: (D, 2 * D) if "proj" in name else (D,) for name in MTP}
    save_file({n: torch.ones(s, dtype=torch.bfloat16) for n, s in shapes.items()},
              str(src / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in hf_tensors(src)}}
    index["weight_map"].update({n: "model-mtp.safetensors" for n in MTP})
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_round_trip_every_layout(tmp_path, layout):
    """Every source tensor lands bitwise under its FTW name (bf16 source; the router and the
    [1, E] bias as transformers saved them, fp32); the hub's MTP tensors are skipped and named."""
    src = mtm.build(tmp_path / "hf", "ernie4_5_moe", layout=layout, dtype="bf16")
    if layout == "per_expert":
        _add_mtp_tensors(src)
    out = convert(src, tmp_path / "m.ftw", threads=2)
    hf = hf_tensors(src)
    skipped = set(MTP) if layout == "per_expert" else set()
    assert "lm_head.weight" not in hf  # tied, as the released models
    with ftw.open(out, verify=True) as f:
        assert f.config["family"] == "ernie4_5_moe" and f.config["source_dtype"] == "bf16"
        assert f.tensors["blk.1.exp_probs_b"].dtype == "fp32"
        assert f.tensors["blk.1.exp_probs_b"].shape == (1, 8)
        experts = assert_tensors_landed(f, hf, skipped, LAYER_NAMES, GLOBAL_NAMES)
        assert len(experts) == 2 * 8 * 3
        assert not any(n.startswith("blk.0.ffn_gate_inp") for n in f.tensors)  # layer 0 dense
        assert "output.weight" not in f.tensors
        assert f.metadata["source.ignored_tensors"] == sorted(skipped)
        assert all("multi-token-prediction" in r for r in f.metadata["source.ignored_reasons"].values())


def test_config_fields(tmp_path):
    src = mtm.build(tmp_path / "hf", "ernie4_5_moe", config_style="legacy", num_hidden_layers=6,
                    moe_layer_start_index=1, moe_layer_end_index=4, moe_layer_interval=2,
                    moe_norm_min=0.25)
    legacy = json.loads((src / "config.json").read_text())
    assert legacy["moe_num_experts"] == 8 and legacy["moe_k"] == 2 and "rope_parameters" not in legacy
    with ftw.open(convert(src, tmp_path / "m.ftw")) as f:
        c = f.config
    assert c["moe_layers"] == [1, 3] and c["intermediate_size"] == 112  # (i + 1) % 2 == 0 in [1, 4]
    assert (c["router_scoring"], c["moe_norm_min"], c["norm_topk_prob"]) == ("softmax_bias", 0.25, True)
    assert (c["shared_expert_intermediate_size"], c["shared_expert_gate"]) == (96, False)
    assert (c["rope_interleaved"], c["attention_bias"], c["tie_word_embeddings"]) == (True, False, True)
    assert (c["num_experts"], c["num_experts_per_tok"]) == (8, 2)


def test_defaults_when_the_config_leaves_them_out(tmp_path):
    """transformers' defaults: MoE from layer 1 to the last, every layer; norm_min 1e-12; 2 shared
    experts; rope_theta 500000."""
    src = mtm.build(tmp_path / "hf", "ernie4_5_moe", config_style="legacy")
    cfg = json.loads((src / "config.json").read_text())
    for key in ("moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval", "moe_norm_min",
                "moe_num_shared_experts", "rope_theta"):
        cfg.pop(key)
    (src / "config.json").write_text(json.dumps(cfg))
    with ftw.open(convert(src, tmp_path / "m.ftw")) as f:
        c = f.config
    assert (c["moe_layers"], c["moe_norm_min"], c["rope_theta"]) == ([1, 2], 1e-12, 500000.0)
    assert c["shared_expert_intermediate_size"] == 96


@pytest.mark.parametrize("changes, message", [
    (dict(use_bias=True), "use_bias"),
    (dict(moe_num_experts=[8, 4, 8]), "differs between layers"),
    (dict(partial_rotary_factor=0.5), "partial rotary"),
])
def test_bad_configs_are_refused(tmp_path, changes, message):
    assert_config_refused(tmp_path, "ernie4_5_moe", changes, message, layout="fused", config_style="legacy")


# ---- routing -----------------------------------------------------------------------------------

@pytest.mark.parametrize("E, k, norm_min", [(8, 2, 1e-12), (16, 4, 0.9), (6, 6, 0.0)])
def test_softmax_bias_topk_equals_brute_force(E, k, norm_min):
    g = torch.Generator().manual_seed(E)
    logits, bias = torch.randn(20, E, generator=g) * 2, torch.randn(1, E, generator=g) * 0.1
    ids, w = softmax_bias_topk(logits, bias, k, norm_min)
    for t in range(20):
        p = torch.softmax(logits[t].double(), dim=-1).tolist()
        choice = [p[e] + float(bias[0, e]) for e in range(E)]
        want = sorted(range(E), key=lambda e: -choice[e])[:k]
        assert sorted(ids[t].tolist()) == sorted(want)
        total = max(sum(p[e] for e in want), norm_min)
        got = dict(zip(ids[t].tolist(), w[t].tolist()))
        for e in want:
            assert got[e] == pytest.approx(p[e] / total, rel=1e-5)


def test_softmax_bias_topk_worked_example():
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()  # softmax gives back [.5 .3 .2]
    ids, w = softmax_bias_topk(logits, torch.tensor([[0.0, 0.0, 0.4]]), 2, 1e-12)
    assert ids.tolist() == [[2, 0]]
    torch.testing.assert_close(w, torch.tensor([[0.2, 0.5]]) / 0.7)
    _, w = softmax_bias_topk(logits, torch.tensor([[0.0, 0.0, 0.4]]), 2, 0.8)  # the clamp divides
    torch.testing.assert_close(w, torch.tensor([[0.2, 0.5]]) / 0.8)


def test_router_and_correction_bias_stay_fp32_in_bf16(tmp_path):
    f = ftw.open(convert(mtm.build(tmp_path / "hf", "ernie4_5_moe"), tmp_path / "m.ftw"))
    config = ModelConfig.from_dict(f.config)
    experts = DenseReferenceExperts(f.load_banks(), config, "cpu", torch.bfloat16)
    model = load_model(f, config, "cpu", torch.bfloat16, experts)
    f.close()
    params = dict(model.named_parameters())
    for layer in (1, 2):
        assert params[f"blk.{layer}.ffn.ffn_gate_inp.weight"].dtype == torch.float32
        assert params[f"blk.{layer}.ffn.exp_probs_b"].dtype == torch.float32
    assert params["blk.1.ffn.ffn_gate_shexp.weight"].dtype == torch.bfloat16
    logits = model(torch.arange(3, 9), torch.arange(6), KVCache(config, 6, "cpu", torch.bfloat16))
    assert logits.shape == (6, config.vocab_size) and torch.isfinite(logits).all()
