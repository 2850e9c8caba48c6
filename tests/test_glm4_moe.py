"""glm4_moe (GLM-4.5 / 4.6 / 4.7) beyond the oracle tests: convert from the hub layout (per-expert,
with the multi-token-prediction layer skipped and named by `inspect`) and from transformers'
save_pretrained layouts, bitwise; the config normalised once (both styles); bad configs refused;
the grouped sigmoid routing against a brute-force reference, never the fused softmax kernel;
the router and its correction bias kept fp32 in a bf16 model; the cuda path (fused kernels, under
Triton's interpreter here) takes the torch q/k norm + rotary for partial rotary and equals the
torch path, and a captured decode step equals the eager one (gpu)."""
import itertools
import json
import re

import pytest
import torch
from click.testing import CliRunner

from convert_support import assert_tensors_landed, edit_config, hf_tensors
import ftw
import make_tiny_model as mtm
from freetoken.cli import main
from freetoken.config import ModelConfig
from freetoken.experts.reference import DenseReferenceExperts
from freetoken.kv_cache import KVCache
from freetoken.loader import load_model
from freetoken.models import fused, fused_router
from freetoken.models.glm4_moe import Glm4MoeBlock
from freetoken.models.moe import sigmoid_group_topk
from ftw.convert import convert
from ftw.errors import ConvertError

# Independent oracle: HF suffix after `model.layers.{i}.` -> FTW suffix (non-expert tensors).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
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
NUM_LAYERS = mtm.DEFAULTS["glm4_moe"]["num_hidden_layers"]  # layer 0 dense, 1 and 2 MoE


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_round_trip_every_layout(tmp_path, layout):
    """Every source tensor lands bitwise under its FTW name (bf16 source; the router and its
    correction bias as transformers saved them, fp32); the hub layout's MTP layer is skipped."""
    src = mtm.build(tmp_path / "hf", "glm4_moe", layout=layout, dtype="bf16")
    out = convert(src, tmp_path / "m.ftw", threads=2)
    hf = hf_tensors(src)
    skipped = {n for n in hf if n.startswith(f"model.layers.{NUM_LAYERS}.")}
    assert bool(skipped) == (layout == "per_expert")
    with ftw.open(out, verify=True) as f:
        assert f.config["family"] == "glm4_moe" and f.config["source_dtype"] == "bf16"
        assert f.tensors["blk.1.exp_probs_b"].dtype == "fp32"
        experts = assert_tensors_landed(f, hf, skipped, LAYER_NAMES, GLOBAL_NAMES)
        assert len(experts) == 2 * 8 * 3
        assert not any(n.startswith("blk.0.ffn_gate_inp") for n in f.tensors)  # layer 0 dense
        assert f.metadata["source.ignored_tensors"] == sorted(skipped)
        assert all("multi-token-prediction layer" in r
                   for r in f.metadata["source.ignored_reasons"].values())


def test_inspect_shows_family_and_the_skipped_mtp_layer(tmp_path):
    src = mtm.build(tmp_path / "hf", "glm4_moe")
    out = tmp_path / "m.ftw"
    r = CliRunner().invoke(main, ["convert", str(src), "-o", str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert r.exit_code == 0, r.output
    assert "* family: glm4_moe" in r.output
    with ftw.open(out) as f:
        skipped = f.metadata["source.ignored_reasons"]
    assert f"model.layers.{NUM_LAYERS}.eh_proj.weight" in skipped and len(skipped) == 10
    assert f"* skipped source tensors ({len(skipped)}):" in r.output
    lines = r.output.splitlines()
    for name, reason in skipped.items():
        assert "num_nextn_predict_layers" in reason
        assert any(line.split() and line.split()[0] == name and line.rstrip().endswith(reason)
                   for line in lines), name


def test_config_fields(tmp_path):
    with ftw.open(convert(mtm.build(tmp_path / "hf", "glm4_moe"), tmp_path / "m.ftw")) as f:
        c = f.config
    assert c["moe_layers"] == [1, 2] and c["intermediate_size"] == 112
    assert (c["router_scoring"], c["num_expert_groups"], c["num_topk_groups"]) == ("sigmoid", 4, 2)
    assert (c["routed_scaling_factor"], c["norm_topk_prob"]) == (2.5, True)
    assert (c["shared_expert_intermediate_size"], c["shared_expert_gate"]) == (96, False)
    assert (c["partial_rotary_factor"], c["qk_norm"], c["attention_bias"]) == (0.5, "per_head", True)
    assert c["num_mtp_layers"] == 1 and ModelConfig.from_dict(c).rotary_dim == 8


def test_published_config_equals_nested(tmp_path):
    """Top-level partial_rotary_factor / rope_theta / torch_dtype read as the nested config."""
    a = mtm.build(tmp_path / "n", "glm4_moe", config_style="nested")
    b = mtm.build(tmp_path / "l", "glm4_moe", config_style="legacy")
    legacy = json.loads((b / "config.json").read_text())
    assert legacy["partial_rotary_factor"] == 0.5 and "rope_parameters" not in legacy
    with ftw.open(convert(a, tmp_path / "n.ftw")) as fa, ftw.open(convert(b, tmp_path / "l.ftw")) as fb:
        assert fa.config == fb.config


def test_defaults_when_the_config_leaves_them_out(tmp_path):
    """transformers' defaults: partial rotary 0.5, one dense layer, renormalised, one group, scale 1."""
    src = mtm.build(tmp_path / "hf", "glm4_moe", config_style="legacy", n_shared_experts=1,
                    use_qk_norm=False, n_group=1, topk_group=1, routed_scaling_factor=1.0)
    cfg = json.loads((src / "config.json").read_text())
    for key in ("partial_rotary_factor", "first_k_dense_replace", "norm_topk_prob", "n_group",
                "topk_group", "routed_scaling_factor", "n_shared_experts", "use_qk_norm"):
        cfg.pop(key)
    (src / "config.json").write_text(json.dumps(cfg))
    with ftw.open(convert(src, tmp_path / "m.ftw")) as f:
        c = f.config
        assert not any("attn_q_norm" in n for n in f.tensors)
    assert (c["partial_rotary_factor"], c["moe_layers"], c["norm_topk_prob"]) == (0.5, [1, 2], True)
    assert (c["num_expert_groups"], c["num_topk_groups"], c["routed_scaling_factor"]) == (1, 1, 1.0)
    assert (c["shared_expert_intermediate_size"], c["qk_norm"]) == (48, "none")


@pytest.mark.parametrize("changes, message", [
    (dict(n_group=3), "n_group 3 / topk_group 2 do not fit 8 experts"),
    (dict(n_group=8, topk_group=2), "groups of 2 or more"),
    (dict(topk_group=5), "1 <= topk_group <= n_group"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=3), "num_experts_per_tok 3 is more than the 2"),
    (dict(partial_rotary_factor=0.1), "rotates 1 dims; rotary needs pairs"),
])
def test_bad_configs_are_refused(tmp_path, changes, message):
    src = mtm.build(tmp_path / "hf", "glm4_moe", layout="fused", config_style="legacy")
    edit_config(src, **changes)
    with pytest.raises(ConvertError, match=re.escape(message)):
        convert(src, tmp_path / "m.ftw")


# ---- routing -----------------------------------------------------------------------------------

def _brute_force(logits, bias, k, groups, topk_groups, renormalize, scale):
    """One token at a time: every allowed set of groups tried, the best k of s + bias among them."""
    E = logits.shape[-1]
    size = E // groups
    ids_out, w_out = [], []
    for row in logits.double():
        s = torch.sigmoid(row)
        choice = (s + bias.double()).tolist()
        group_score = [sum(sorted(choice[g * size:(g + 1) * size])[-2:]) for g in range(groups)]
        best = max(itertools.combinations(range(groups), topk_groups),
                   key=lambda gs: sorted(group_score[g] for g in gs))  # the topk_group best groups
        allowed = [e for g in best for e in range(g * size, (g + 1) * size)]
        ids = sorted(allowed, key=lambda e: -choice[e])[:k]
        w = s[ids]
        if renormalize:
            w = w / w.sum()
        ids_out.append(ids)
        w_out.append((w * scale).tolist())
    return torch.tensor(ids_out), torch.tensor(w_out, dtype=torch.float64)


@pytest.mark.parametrize("E, k, groups, topk_groups, renormalize, scale", [
    (8, 2, 4, 2, True, 2.5), (16, 4, 4, 1, False, 1.0), (12, 3, 1, 1, True, 1.0), (32, 8, 8, 4, True, 1.8),
])
def test_sigmoid_group_topk_equals_brute_force(E, k, groups, topk_groups, renormalize, scale):
    gen = torch.Generator().manual_seed(E + k)
    logits = 2 * torch.randn(64, E, generator=gen)
    bias = 0.5 * torch.randn(E, generator=gen)
    ids, w = sigmoid_group_topk(logits, bias, k, groups, topk_groups, renormalize, scale)
    want_ids, want_w = _brute_force(logits, bias, k, groups, topk_groups, renormalize, scale)
    order = ids.sort(dim=-1)
    want_order = want_ids.sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    assert torch.allclose(w.gather(1, order.indices).double(), want_w.gather(1, want_order.indices),
                          atol=1e-6)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32


def test_sigmoid_group_topk_worked_example():
    """The docstring's example: expert 4 (.8) is never taken, its group loses."""
    choice = torch.tensor([[.9, .1, .5, .5, .8, .0, .2, .3]])
    bias = torch.full((8,), -0.05)  # choice = sigmoid(logit) + bias
    logits = torch.logit(choice - bias)
    ids, w = sigmoid_group_topk(logits, bias, 2, 4, 2, False, 1.0)
    assert ids[0, 0] == 0 and int(ids[0, 1]) in (2, 3)
    assert torch.allclose(w, (choice - bias).gather(1, ids))


def test_glm_routing_never_takes_the_fused_softmax_kernel(monkeypatch):
    """On cuda fused.enabled holds and softmax_topk would run fused_router's kernel (softmax only):
    the grouped sigmoid route is torch there too."""
    def refuse(*args, **kwargs):
        raise AssertionError("glm4_moe routing reached the fused softmax router")

    monkeypatch.setattr(fused, "enabled", lambda *a, **kw: True)
    monkeypatch.setattr(fused_router, "softmax_topk", refuse)
    config = ModelConfig(family="glm4_moe", vocab_size=8, hidden_size=16, num_layers=1, num_heads=2,
                         num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                         max_position_embeddings=8, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=4, moe_layers=(0,), router_scoring="sigmoid",
                         num_expert_groups=4, num_topk_groups=2, routed_scaling_factor=2.5,
                         norm_topk_prob=True)
    block = Glm4MoeBlock(config)
    logits = torch.randn(5, 8)
    ids, w = block.route(logits)
    want_ids, want_w = sigmoid_group_topk(logits, block.exp_probs_b, 2, 4, 2, True, 2.5)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)


# ---- the model ---------------------------------------------------------------------------------

def _load(path, dtype):
    f = ftw.open(path)
    config = ModelConfig.from_dict(f.config)
    model = load_model(f, config, "cpu", dtype,
                       DenseReferenceExperts(f.load_banks(), config, "cpu", dtype))
    f.close()
    return model, config


def test_router_and_correction_bias_stay_fp32_in_bf16(tmp_path):
    out = convert(mtm.build(tmp_path / "hf", "glm4_moe"), tmp_path / "m.ftw")
    model, _ = _load(out, torch.bfloat16)
    params = dict(model.named_parameters())
    for layer in (1, 2):
        assert params[f"blk.{layer}.ffn.ffn_gate_inp.weight"].dtype == torch.float32
        assert params[f"blk.{layer}.ffn.exp_probs_b"].dtype == torch.float32
    assert params["blk.1.ffn.ffn_gate_shexp.weight"].dtype == torch.bfloat16
    assert params["blk.1.attn.attn_q.weight"].dtype == torch.bfloat16
    ids = torch.arange(3, 9)
    logits = model(ids, torch.arange(6), KVCache(model.config, 6, "cpu", torch.bfloat16))
    assert logits.shape == (6, model.config.vocab_size) and torch.isfinite(logits).all()


def test_the_correction_bias_changes_the_output(tmp_path):
    """The tiny model's biases are large enough that a loader dropping them would fail the
    oracle tests (the output moves far beyond their 1e-4)."""
    out = convert(mtm.build(tmp_path / "hf", "glm4_moe"), tmp_path / "m.ftw")
    model, config = _load(out, torch.float32)
    ids = torch.arange(3, 23)

    def run():
        with torch.no_grad():
            return model(ids, torch.arange(20), KVCache(config, 20, "cpu", torch.float32))

    before = run()
    for layer in config.moe_layers:
        model.blk[layer].ffn.exp_probs_b.data.zero_()
    assert (run() - before).abs().max() > 1e-2
