"""deepseek_v3 and deepseek_v2 beyond the oracle tests (test_model_oracle.py, test_engine_oracle.py):
convert from the hub layout (per-expert; DeepSeek-V3's multi-token-prediction layer skipped and
named by `inspect`) and from transformers' save_pretrained layouts, bitwise; the config normalised
once (both styles, transformers' defaults per family); bad configs and the sparse-attention
families refused; deepseek_v2's softmax routing against a brute-force reference; MLA's KV cache
holds the kv latent and the rope key only, decode steps absorb attn_kv_b (no cached latent is
expanded) and equal the expanded form; a prefill of several engine chunks and pages, then decode
steps, equals transformers; the routers stay fp32 in bf16; no captured decode graphs for MLA;
the cuda path (fused norms and GEMVs, under Triton's interpreter here) equals the torch path."""
import itertools
import json
import re

import pytest
import torch
import transformers
from click.testing import CliRunner

from convert_support import assert_tensors_landed, edit_config, hf_tensors
import ftw
import make_tiny_model as mtm
from freetoken import graphs
from freetoken.cli import main
from freetoken.config import EngineConfig, ModelConfig
from freetoken.engine import Engine
from freetoken.experts.reference import DenseReferenceExperts
from freetoken.kv_cache import KVCache, KVPages
from freetoken.loader import load_model
from freetoken.models import fused, fused_router, mla
from freetoken.models.moe import softmax_group_topk
from freetoken.models.rope import Rotary
from freetoken.models.transformer import Step
from ftw.convert import convert
from ftw.errors import ConvertError
from fused_support import interpreter, make_model, run_tokens
from test_engine_oracle import assert_close, score_then_decode
from test_split_attention import assert_logits_near

# Independent oracle: HF suffix after `model.layers.{i}.` -> FTW suffix (non-expert tensors).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight", "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
NUM_LAYERS = mtm.DEFAULTS["deepseek_v3"]["num_hidden_layers"]  # layer 0 dense, 1 and 2 MoE


@pytest.mark.parametrize("family, layout", [("deepseek_v3", "per_expert"), ("deepseek_v3", "fused"),
                                            ("deepseek_v2", "fused")])
def test_round_trip_every_layout(tmp_path, family, layout):
    """Every source tensor lands bitwise under its FTW name (bf16 source; the router and the
    correction bias as transformers saved them, fp32); the hub layout's MTP layer is skipped."""
    src = mtm.build(tmp_path / "hf", family, layout=layout, dtype="bf16")
    out = convert(src, tmp_path / "m.ftw", threads=2)
    hf = hf_tensors(src)
    skipped = {n for n in hf if n.startswith(f"model.layers.{NUM_LAYERS}.")}
    assert bool(skipped) == (layout == "per_expert")
    with ftw.open(out, verify=True) as f:
        assert f.config["family"] == family and f.config["source_dtype"] == "bf16"
        assert f.tensors["blk.1.ffn_gate_inp.weight"].dtype == "fp32"
        experts = assert_tensors_landed(f, hf, skipped, LAYER_NAMES, GLOBAL_NAMES)
        assert len(experts) == 2 * 8 * 3
        assert not any(n.startswith("blk.0.ffn_gate_inp") for n in f.tensors)  # layer 0 dense
        assert ("blk.1.exp_probs_b" in f.tensors) == (family == "deepseek_v3")
        assert f.metadata["source.ignored_tensors"] == sorted(skipped)


def test_inspect_shows_family_and_the_skipped_mtp_layer(tmp_path):
    src = mtm.build(tmp_path / "hf", "deepseek_v3")
    out = tmp_path / "m.ftw"
    r = CliRunner().invoke(main, ["convert", str(src), "-o", str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert r.exit_code == 0, r.output
    assert "* family: deepseek_v3" in r.output
    with ftw.open(out) as f:
        skipped = f.metadata["source.ignored_reasons"]
    assert f"model.layers.{NUM_LAYERS}.shared_head.head.weight" in skipped and len(skipped) == 12
    lines = r.output.splitlines()
    for name, reason in skipped.items():
        assert "num_nextn_predict_layers" in reason
        assert any(line.split() and line.split()[0] == name and line.rstrip().endswith(reason)
                   for line in lines), name


def _config(tmp_path, family, **build_kw):
    with ftw.open(convert(mtm.build(tmp_path / "hf", family, **build_kw), tmp_path / "m.ftw")) as f:
        return f.config


def test_config_fields(tmp_path):
    v3, v2 = _config(tmp_path / "3", "deepseek_v3"), _config(tmp_path / "2", "deepseek_v2")
    for c in (v3, v2):
        assert c["moe_layers"] == [1, 2] and c["intermediate_size"] == 112
        assert (c["head_dim"], c["qk_nope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]) == (8, 16, 12, 32)
        assert (c["num_expert_groups"], c["num_topk_groups"], c["rope_interleaved"]) == (4, 2, True)
        assert c["shared_expert_gate"] is False and ModelConfig.from_dict(c).kv_entry == (1, 1, 40)
    assert (v3["router_scoring"], v3["routed_scaling_factor"], v3["norm_topk_prob"]) == ("sigmoid", 2.5, True)
    assert (v3["q_lora_rank"], v3["shared_expert_intermediate_size"], v3["num_mtp_layers"]) == (24, 48, 1)
    assert (v2["router_scoring"], v2["routed_scaling_factor"], v2["norm_topk_prob"]) == ("softmax", 2.0, False)
    assert (v2["q_lora_rank"], v2["shared_expert_intermediate_size"], v2["num_mtp_layers"]) == (0, 96, 0)


@pytest.mark.parametrize("family", mtm.MLA)
def test_published_config_equals_nested(tmp_path, family):
    """Top-level rope_theta / torch_dtype, no head_dim: read as the nested config."""
    a = mtm.build(tmp_path / "n", family, config_style="nested")
    b = mtm.build(tmp_path / "l", family, config_style="legacy")
    legacy = json.loads((b / "config.json").read_text())
    assert "rope_parameters" not in legacy and "head_dim" not in legacy
    with ftw.open(convert(a, tmp_path / "n.ftw")) as fa, ftw.open(convert(b, tmp_path / "l.ftw")) as fb:
        assert fa.config == fb.config


def test_defaults_when_the_config_leaves_them_out(tmp_path):
    """Without the routing and placement keys each family takes transformers' defaults, checked
    against transformers' reading of the same config.json. deepseek_v3: 3 dense layers, 8 groups
    with 4 kept, renormalised, scale 2.5, one shared expert, interleaved rotary; deepseek_v2: no
    dense layer, greedy, scale 1, two shared experts."""
    keys = ("first_k_dense_replace", "n_group", "topk_group", "norm_topk_prob",
            "routed_scaling_factor", "n_shared_experts")
    v3 = mtm.build(tmp_path / "3", "deepseek_v3", config_style="legacy", num_experts=16,
                   num_hidden_layers=4, first_k_dense_replace=3, n_group=8, topk_group=4)
    edit_config(v3, drop=keys + ("rope_interleave",))
    v2 = mtm.build(tmp_path / "2", "deepseek_v2", config_style="legacy", first_k_dense_replace=0,
                   topk_method="greedy", routed_scaling_factor=1.0)
    edit_config(v2, drop=keys + ("topk_method",))
    with ftw.open(convert(v3, tmp_path / "3.ftw")) as f3, ftw.open(convert(v2, tmp_path / "2.ftw")) as f2:
        c3, c2 = f3.config, f2.config
    assert (c3["moe_layers"], c3["num_expert_groups"], c3["num_topk_groups"]) == ([3], 8, 4)
    assert (c3["norm_topk_prob"], c3["routed_scaling_factor"]) == (True, 2.5)
    assert (c3["shared_expert_intermediate_size"], c3["rope_interleaved"]) == (48, True)
    assert (c2["moe_layers"], c2["num_expert_groups"], c2["num_topk_groups"]) == ([0, 1, 2], 1, 1)
    assert (c2["routed_scaling_factor"], c2["shared_expert_intermediate_size"]) == (1.0, 96)
    h3, h2 = transformers.AutoConfig.from_pretrained(v3), transformers.AutoConfig.from_pretrained(v2)
    assert (h3.first_k_dense_replace, h3.n_group, h3.topk_group, h3.norm_topk_prob) == (3, 8, 4, True)
    assert (h3.routed_scaling_factor, h3.n_shared_experts, h3.rope_interleave) == (2.5, 1, True)
    assert (h2.first_k_dense_replace, h2.topk_method, h2.routed_scaling_factor) == (0, "greedy", 1.0)
    assert h2.n_shared_experts == 2


@pytest.mark.parametrize("changes, message", [
    (dict(topk_method="noaux_tc"), "topk_method 'noaux_tc' is not supported for deepseek_v2"),
    (dict(n_group=3), "n_group 3 / topk_group 2 do not fit 8 experts"),
    (dict(topk_group=1, num_experts_per_tok=3), "num_experts_per_tok 3 is more than the 2"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim 7 is odd"),
    (dict(kv_lora_rank=None), "kv_lora_rank is None"),
])
def test_bad_configs_are_refused(tmp_path, changes, message):
    src = mtm.build(tmp_path / "hf", "deepseek_v2", layout="fused", config_style="legacy")
    edit_config(src, **changes)
    with pytest.raises(ConvertError, match=re.escape(message)):
        convert(src, tmp_path / "m.ftw")


@pytest.mark.parametrize("model_type, arch, models", [
    ("deepseek_v32", "DeepseekV32ForCausalLM", "DeepSeek-V3.2"),
    ("deepseek_v3", "DeepseekV4ForCausalLM", "DeepSeek-V4"),  # found by its architecture too
    ("glm_moe_dsa", "GlmMoeDsaForCausalLM", "GLM-5"),
])
def test_sparse_attention_families_are_refused(tmp_path, model_type, arch, models):
    """A DeepSeek-V3.2-style checkpoint has deepseek_v3's tensors plus an indexer: refused by
    name, never converted into a dense model that runs wrong."""
    src = mtm.build(tmp_path / "hf", "deepseek_v3", layout="fused")
    edit_config(src, model_type=model_type, architectures=[arch])
    with pytest.raises(ConvertError, match=re.escape(f"({models}) uses sparse attention")):
        convert(src, tmp_path / "m.ftw")
    assert not (tmp_path / "m.ftw").exists()


# ---- deepseek_v2's routing ---------------------------------------------------------------------

def _brute_force(logits, k, groups, topk_groups, scale):
    """One token at a time: every allowed set of groups tried, the best k probabilities in them."""
    E = logits.shape[-1]
    size = E // groups
    ids_out, w_out = [], []
    for row in logits.double():
        p = torch.softmax(row, dim=-1).tolist()
        best = max(itertools.combinations(range(groups), topk_groups),
                   key=lambda gs: sorted(max(p[g * size:(g + 1) * size]) for g in gs))
        allowed = [e for g in best for e in range(g * size, (g + 1) * size)]
        ids = sorted(allowed, key=lambda e: -p[e])[:k]
        ids_out.append(ids)
        w_out.append([p[e] * scale for e in ids])
    return torch.tensor(ids_out), torch.tensor(w_out, dtype=torch.float64)


@pytest.mark.parametrize("E, k, groups, topk_groups, scale", [
    (8, 2, 4, 2, 2.0), (16, 6, 1, 1, 1.0), (32, 4, 8, 3, 16.0),
])
def test_softmax_group_topk_equals_brute_force(E, k, groups, topk_groups, scale):
    gen = torch.Generator().manual_seed(E + k)
    logits = 2 * torch.randn(64, E, generator=gen)
    ids, w = softmax_group_topk(logits, k, groups, topk_groups, scale)
    want_ids, want_w = _brute_force(logits, k, groups, topk_groups, scale)
    order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    assert torch.allclose(w.gather(1, order.indices).double(), want_w.gather(1, want_order.indices),
                          atol=1e-6)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32


# ---- multi-head latent attention ----------------------------------------------------------------

def _load(path, dtype):
    f = ftw.open(path)
    config = ModelConfig.from_dict(f.config)
    model = load_model(f, config, "cpu", dtype,
                       DenseReferenceExperts(f.load_banks(), config, "cpu", dtype))
    f.close()
    return model, config


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    """The tiny deepseek_v3 (FTW path, our model and config) and transformers' model of it."""
    root = tmp_path_factory.mktemp("v3")
    src = mtm.build(root / "hf", "deepseek_v3", seed=3)
    path = convert(src, root / "m.ftw")
    model, config = _load(path, torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    return path, model, config, hf


def test_the_cache_holds_the_latent_and_the_rope_key_only(v3):
    """Per layer and token one row of kv_lora_rank + rope dims: the normed latent, then the
    rotated rope key, as transformers' cache holds them."""
    _, model, config, hf = v3
    assert KVPages(config, 2, 4, "cpu", torch.float32).data.shape == (3, 1, 1, 8, 32 + 8)
    ids = torch.arange(3, 12)
    kv = KVCache(config, 9, "cpu", torch.float32)
    with torch.no_grad():
        model(ids, torch.arange(9), kv)
        cache = transformers.DynamicCache(config=hf.config)
        hf(ids[None], cache=cache, use_cache=True)
    for layer in range(config.num_layers):
        latent, rope = cache.layers[layer].keys[0, 0], cache.layers[layer].values[0, 0]  # [S, r], [S, dr]
        ours = kv.data[layer, 0, 0]  # [S, r + dr]
        assert torch.allclose(ours[:, :32], latent, atol=1e-6)
        # the rotated pairs in the order transformers leaves them: even dims, then odd dims
        assert torch.allclose(ours[:, 32:], rope, atol=1e-6)


def test_decode_absorbs_and_equals_the_expanded_form(v3, monkeypatch):
    """A decode step never runs attn_kv_b on cached latents (absorbed into q and the output);
    forced either way, every layer's attention output agrees."""
    _, model, config, _ = v3
    assert mla.absorbs(1, 2, 128, 512, 128, 64, 128) and not mla.absorbs(512, 512, 128, 512, 128, 64, 128)
    attn = model.blk[1].attn
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, config.hidden_size, generator=gen)
    rotary = Rotary(config)

    def run(T_first, absorb):
        monkeypatch.setattr(mla, "absorbs", lambda *a: absorb)
        kv = KVCache(config, 12, "cpu", torch.float32)
        outs = []
        for start, end in ((0, T_first), *((i, i + 1) for i in range(T_first, 12))):
            cos, sin = rotary.cos_sin(torch.arange(start, end), torch.float32)
            mask = "causal" if start == 0 and end > 1 else None
            kv.reserve(end - start)
            outs.append(attn(x[start:end], 1, Step(start, cos, sin, mask, kv, None)))
            kv.commit(end - start)
        return torch.cat(outs)

    with torch.no_grad():
        expanded, absorbed = run(5, False), run(5, True)
    assert torch.allclose(expanded, absorbed, atol=1e-5), (expanded - absorbed).abs().max()
    monkeypatch.undo()
    kv = KVCache(config, 12, "cpu", torch.float32)
    with torch.no_grad():
        model(torch.tensor([5, 6]), torch.arange(2), kv)  # a prefill expands
        calls = []
        monkeypatch.setattr(attn.attn_kv_b, "forward", lambda x: calls.append(x.shape))
        for pos in range(2, 5):
            model(torch.tensor([5 + pos]), torch.tensor([pos]), kv)
    assert calls == []


def test_router_stays_fp32_in_bf16(v3, tmp_path):
    path, *_ = v3
    model, config = _load(path, torch.bfloat16)
    params = dict(model.named_parameters())
    assert params["blk.1.ffn.ffn_gate_inp.weight"].dtype == torch.float32
    assert params["blk.1.ffn.exp_probs_b"].dtype == torch.float32
    assert params["blk.1.attn.attn_kv_b.weight"].dtype == torch.bfloat16
    v2 = convert(mtm.build(tmp_path / "hf", "deepseek_v2"), tmp_path / "v2.ftw")
    model2, _ = _load(v2, torch.bfloat16)
    assert dict(model2.named_parameters())["blk.2.ffn.ffn_gate_inp.weight"].dtype == torch.float32
    logits = model(torch.arange(3, 9), torch.arange(6), KVCache(config, 6, "cpu", torch.bfloat16))
    assert logits.shape == (6, config.vocab_size) and torch.isfinite(logits).all()


def test_no_captured_decode_graphs(v3):
    _, model, _, _ = v3
    assert "multi-head latent attention" in graphs.unsupported_reason(model, object(), "cuda")


LONG_PROMPT = [3 + (i * 37) % 380 for i in range(110)]  # 4 pages of 32 tokens


@pytest.mark.parametrize("family, policy, cache", [("deepseek_v3", "hybrid", 0.5),
                                                   ("deepseek_v2", "offload", 0.125)])
def test_long_prefill_then_decode(tmp_path, family, policy, cache):
    """100 prompt tokens in forwards of 48 over 4 KV pages, then 10 decode steps (absorbed):
    every position equals transformers."""
    src = mtm.build(tmp_path / "hf", family, seed=5)
    path = str(convert(src, tmp_path / "m.ftw"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([LONG_PROMPT])).logits[0]
    with Engine(path, EngineConfig(device="cpu", dtype="fp32", policy=policy, expert_cache_frac=cache,
                                   prefill_chunk=48)) as engine:
        logits, held = score_then_decode(engine, LONG_PROMPT, 10)
    assert held[0] == len(LONG_PROMPT)
    assert_close(logits, want, f"{family} long prompt")


# ---- the cuda path: the fused norms and one-row GEMVs, torch attention and routes ----------------

def _fused_path_equals_torch(family, device, dtype, monkeypatch, force_on_cpu):
    def refuse(*args, **kwargs):
        raise AssertionError("MLA reached the q/k rotary kernel or the softmax router kernel")

    model = make_model(family, device, dtype)
    enabled = fused.enabled
    monkeypatch.setattr(fused, "enabled", lambda x: False)  # the torch path: the reference
    ref = run_tokens(model, device)
    monkeypatch.setattr(fused, "enabled", enabled)
    if force_on_cpu:  # the interpreter runs the kernels on cpu tensors
        monkeypatch.setattr(fused, "enabled", lambda x: x.dtype in fused._DTYPES)
    norms, rms_norm = [], fused.rms_norm
    monkeypatch.setattr(fused, "rms_norm", lambda *a: norms.append(1) or rms_norm(*a))
    monkeypatch.setattr(fused, "qk_rope", refuse)
    monkeypatch.setattr(fused_router, "softmax_topk", refuse)
    ours = run_tokens(model, device)
    assert norms, "the fused RMSNorm did not run"
    assert_logits_near(ours, ref, dtype)


@interpreter
@pytest.mark.slow  # (a whole model's forwards in the interpreter)
@pytest.mark.parametrize("family", mtm.MLA)
def test_fused_path_equals_torch_interpreted(family, monkeypatch):
    _fused_path_equals_torch(family, "cpu", torch.bfloat16, monkeypatch, force_on_cpu=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", mtm.MLA)
def test_fused_path_equals_torch_cuda(family, dtype, monkeypatch):
    _fused_path_equals_torch(family, "cuda", dtype, monkeypatch, force_on_cpu=False)
