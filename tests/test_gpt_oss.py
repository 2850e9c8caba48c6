"""gpt_oss beyond the family-wide oracle tests (test_model_oracle.py, test_engine_oracle.py run it
with every layout, cache size, policy and prefill mode): convert from the hub's bf16 layout
(fused [E, in, out] experts, gate and up interleaved, biases) bitwise, both config styles alike;
other quantizations refused with a message saying so (the hub's MXFP4: test_gpt_oss_mxfp4.py);
the config normalised once (transformers' defaults for layer_types and the yarn rope); the router's softmax over its top-k logits; a
prompt longer than the sliding window and than one prefill chunk through the engine against
transformers, per policy and cache size; the attention sinks, the window and the experts'
biases each change the output (so the oracle tests cannot pass without them)."""
import re

import pytest

from freetoken.errors import ConfigError
import torch
import transformers
from click.testing import CliRunner

from convert_support import edit_config, hf_tensors, proj_bytes, raw
import ftw
import make_tiny_model as mtm
from freetoken.cli import main
from freetoken.config import EngineConfig, ModelConfig
from freetoken.engine import Engine
from freetoken.models.gpt_oss import softmax_of_topk
from ftw.convert import convert
from ftw.errors import ConvertError
from test_engine_oracle import score_then_decode

ATOL = 1e-4
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.sinks": "attn_sinks", "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
EXPERTS = r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?"


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_round_trip_every_layout(tmp_path, layout):
    """Every source tensor lands bitwise under its FTW name (bf16 source): the interleaved
    gate/up columns of [E, D, 2I] as gate and up [I, D] rows, down [E, I, D] as [D, I], the
    biases de-interleaved into the slot's bias projections."""
    src = mtm.build(tmp_path / "hf", "gpt_oss", layout=layout, dtype="bf16")
    out = convert(src, tmp_path / "m.ftw", threads=2)
    with ftw.open(out, verify=True) as f:
        assert f.config["family"] == "gpt_oss" and f.config["source_dtype"] == "bf16"
        assert [p.name for p in f.banks[0].projections] == [
            "gate", "up", "down", "gate_bias", "up_bias", "down_bias"]
        seen = set()
        for name, t in hf_tensors(src).items():
            m = re.fullmatch(EXPERTS, name)
            if m:
                layer, bias = int(m[1]), bool(m[3])
                for e in range(t.shape[0]):
                    if m[2] == "gate_up_proj":
                        gate, up = t[e, ..., 0::2], t[e, ..., 1::2]  # [D, I] columns (or [I])
                        names = ("gate_bias", "up_bias") if bias else ("gate", "up")
                        for p, w in zip(names, (gate, up)):
                            assert proj_bytes(f, layer, e, p) == raw(w if bias else w.t()), (name, p)
                    else:
                        p = "down_bias" if bias else "down"
                        assert proj_bytes(f, layer, e, p) == raw(t[e] if bias else t[e].t()), name
                seen.add((layer, m[2], bias))
            else:
                lm = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
                canon = f"blk.{lm[1]}.{LAYER_NAMES[lm[2]]}" if lm else GLOBAL_NAMES[name]
                assert f.tensor_bytes(canon).tobytes() == raw(t), name
        assert len(seen) == 4 * 4
        assert f.metadata["source.ignored_tensors"] == []


def test_inspect_shows_the_family(tmp_path):
    out = tmp_path / "m.ftw"
    r = CliRunner().invoke(main, ["convert", str(mtm.build(tmp_path / "hf", "gpt_oss")), "-o", str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert r.exit_code == 0 and "* family: gpt_oss" in r.output, r.output


def test_config_fields_and_both_styles(tmp_path):
    a = convert(mtm.build(tmp_path / "n", "gpt_oss", config_style="nested"), tmp_path / "n.ftw")
    b = convert(mtm.build(tmp_path / "l", "gpt_oss", config_style="legacy"), tmp_path / "l.ftw")
    with ftw.open(a) as fa, ftw.open(b) as fb:
        assert fa.config == fb.config
        c = fa.config
    assert c["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert (c["layer_window"], c["sliding_window"], c["attn_sinks"]) == (5, None, True)
    assert (c["expert_act"], c["swiglu_alpha"], c["swiglu_limit"]) == ("clamped_swiglu", 1.702, 0.6)
    assert (c["router_bias"], c["expert_bias"], c["attention_bias"]) == (True, True, True)
    assert c["rope_scaling"]["rope_type"] == "yarn" and c["rope_scaling"]["truncate"] is False
    mc = ModelConfig.from_dict(c)
    assert [mc.attention_window(i) for i in range(4)] == [5, None, 5, None]


def test_transformers_defaults_when_the_config_leaves_them_out(tmp_path):
    """No layer_types: even layers slide; no rope parameters: GptOssConfig's yarn (factor 32
    over 4096), theta 150000; no rms_norm_eps: 1e-5; no attention_bias: true."""
    src = mtm.build(tmp_path / "hf", "gpt_oss", config_style="legacy")
    edit_config(src, drop=("layer_types", "rope_scaling", "rope_theta", "rms_norm_eps",
                            "attention_bias", "swiglu_alpha", "swiglu_limit"))
    with ftw.open(convert(src, tmp_path / "m.ftw")) as f:
        c = f.config
    hf = transformers.AutoConfig.from_pretrained(src)
    assert c["layer_types"] == hf.layer_types == ["sliding_attention", "full_attention"] * 2
    assert c["rope_theta"] == hf.rope_parameters["rope_theta"] == 150000.0
    for key in ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings", "truncate"):
        assert c["rope_scaling"][key] == hf.rope_parameters[key], key
    assert (c["rms_norm_eps"], c["attention_bias"]) == (hf.rms_norm_eps, hf.attention_bias)
    assert (c["swiglu_alpha"], c["swiglu_limit"]) == (hf.swiglu_alpha, hf.swiglu_limit)


@pytest.mark.parametrize("changes, message", [
    (dict(layer_types=["sliding_attention", "linear_attention"] * 2), "layer_types must list 4"),
    (dict(sliding_window=None), "sliding_window is None"),
    (dict(quantization_config={"quant_method": "bitsandbytes"}), "quantized as 'bitsandbytes'"),
])
def test_bad_configs_are_refused(tmp_path, changes, message):
    src = mtm.build(tmp_path / "hf", "gpt_oss", config_style="legacy")
    edit_config(src, **changes)
    with pytest.raises(ConvertError, match=re.escape(message)):
        convert(src, tmp_path / "m.ftw")


def test_softmax_of_topk():
    """The top k logits (router bias included by the linear), softmax over those k only."""
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0], [1.0, 1.0, 4.0, 0.0]])
    ids, w = softmax_of_topk(logits, 2)
    assert ids.tolist() == [[1, 3], [2, 0]] or ids.tolist() == [[1, 3], [2, 1]]
    want = torch.softmax(torch.tensor([[3.0, 2.0], [4.0, 1.0]]), dim=-1)
    assert torch.allclose(w, want) and w.dtype == torch.float32


# ---- a prompt longer than the window and than one prefill chunk, through the engine -----------

PROMPT_LEN, NUM_NEW = 23, 6  # window 5, prefill chunks of 8: 8 + 8 + 7, then decode


@pytest.fixture(scope="module")
def long_case(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_long")
    src = mtm.build(root / "hf", "gpt_oss", seed=3)
    path = str(convert(src, root / "m.ftw"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 384, (PROMPT_LEN + NUM_NEW,), generator=gen).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    return path, ids, want, hf


@pytest.mark.parametrize("policy", ["hybrid", "offload", "cpu"])
@pytest.mark.parametrize("cache", [0.0, 0.125, 0.5, 1.0])
def test_long_prompt_matches_transformers(long_case, policy, cache):
    """Teacher forcing: the prompt in chunks of 8 (windows cut across chunks), then one token
    per decode step; every position's logits within 1e-4 of transformers'."""
    path, ids, want, _ = long_case
    with Engine(path, EngineConfig(device="cpu", dtype="fp32", policy=policy, prefill_chunk=8,
                                   expert_cache_frac=cache)) as engine:
        got, held = score_then_decode(engine, ids, NUM_NEW)
    assert held[0] == len(ids)
    diff = (got - want).abs().amax(dim=-1)
    assert float(diff.max()) <= ATOL, f"worst position {int(diff.argmax())}: {float(diff.max()):.3g}"


def test_long_prompt_greedy_tokens(long_case):
    """Greedy tokens after the long prompt equal transformers' (full recompute each step), as
    far as its top-2 margin is wide and no end-of-sequence token comes."""
    from freetoken.sampling import SamplingParams
    path, ids, _, hf = long_case
    want, margins = list(ids[:PROMPT_LEN]), []
    with torch.no_grad():
        for _ in range(8):
            top = hf(torch.tensor([want])).logits[0, -1].topk(2)
            margins.append(float(top.values[0] - top.values[1]))
            want.append(int(top.indices[0]))
    want = want[PROMPT_LEN:]
    with Engine(path, EngineConfig(device="cpu", dtype="fp32", prefill_chunk=8,
                                   expert_cache_frac=0.5)) as engine:
        eos = set(engine.model_config.eos_token_ids)
        wide = next((i for i, (t, m) in enumerate(zip(want, margins)) if m < 1e-3 or t in eos), 8)
        assert wide >= 3, (want, margins)
        got = list(engine.generate(ids[:PROMPT_LEN], SamplingParams(temperature=0, max_tokens=wide)))
    assert got == want[:wide]


def test_sinks_window_and_expert_math_each_matter(tmp_path):
    """Without the window, the sinks, the experts' biases or their clamped SwiGLU the logits
    move far past the oracle tests' 1e-4 (test_model_oracle.py checks them with all four)."""
    from dataclasses import replace
    from test_model_oracle import load_pair, prompt_ids, run_ours
    hf, ours, config = load_pair(tmp_path, "gpt_oss")
    ids = prompt_ids(config)
    with torch.no_grad():
        want = hf(ids[None]).logits[0].float()

    def worst():
        return float((run_ours(ours, config, ids) - want).abs().max())
    assert worst() <= ATOL
    attns = [blk.attn for blk in ours.blk]
    for a in attns:
        a.window = None
    assert worst() > 1e-2
    for i, a in enumerate(attns):
        a.window = config.attention_window(i)
        a.attn_sinks.data.fill_(-1e4)  # a sink whose share is 0
    assert worst() > 1e-2
    hf, ours, config = load_pair(tmp_path / "b", "gpt_oss")
    rt = ours.expert_runtime
    rt.act = replace(rt.act, name="silu")
    assert worst() > 1e-2
    rt.act = replace(rt.act, name="clamped_swiglu")
    assert worst() <= ATOL
    infos = {layer: b.info for layer, b in rt.banks.items()}
    for info in infos.values():  # the bank read without its bias projections
        object.__setattr__(info, "projections", info.projections[:3])
    assert worst() > 1e-2


# ---- the cuda path: the fused kernels where they apply, the masked SDPA for the attention -------

def _fused_path_equals_torch(device, dtype, monkeypatch, force_on_cpu):
    """The fused q/k/v, q/k rotary and GEMV kernels (interpreted on cpu) against the torch path;
    the StaticKV decode step (the captured step's forward: window and sinks over the span's
    mask) against the eager decode step, and (cuda) captured against eager."""
    from fused_support import make_model, run_tokens
    from freetoken.kv_cache import KVCache
    from freetoken.models import fused, fused_router, split_attention
    from test_split_attention import assert_logits_near, static_decode_logits

    def refuse(*args, **kwargs):
        raise AssertionError("gpt_oss reached the softmax router or the split-K decode kernel")
    monkeypatch.setattr(fused_router, "softmax_topk", refuse)
    monkeypatch.setattr(split_attention, "decode_attention", refuse)
    model = make_model("gpt_oss", device, dtype)
    enabled = fused.enabled
    monkeypatch.setattr(fused, "enabled", lambda x: False)  # the torch path: the reference
    ref = run_tokens(model, device)
    ref_step = static_decode_logits(model, device).clone()
    ids = torch.arange(13, device=device) * 7 % 50
    kv = KVCache(model.config, 64, device, dtype)
    with torch.inference_mode():
        model(ids[:12], torch.arange(12, device=device), kv)
        eager_step = model(ids[12:], torch.tensor([12], device=device), kv)
    assert_logits_near(ref_step, eager_step, dtype)
    monkeypatch.setattr(fused, "enabled", enabled)
    if force_on_cpu:  # the interpreter runs the kernels on cpu tensors
        monkeypatch.setattr(fused, "enabled", lambda x: x.dtype in fused._DTYPES)
    ours = run_tokens(model, device)
    assert all(blk.attn._qkv is not None for blk in model.blk), "the fused q/k/v did not run"
    assert_logits_near(ours, ref, dtype)
    assert_logits_near(static_decode_logits(model, device, capture=not force_on_cpu), ref_step, dtype)


def test_static_decode_step_equals_eager(monkeypatch):
    """The StaticKV step's window and sinks (layers.Attention._masked_attention, static) on cpu."""
    from fused_support import make_model
    from freetoken.kv_cache import KVCache
    from freetoken.models import fused
    from test_split_attention import static_decode_logits
    monkeypatch.setattr(fused, "enabled", lambda x: False)
    model = make_model("gpt_oss", "cpu", torch.float32)
    ids = torch.arange(13) * 7 % 50
    kv = KVCache(model.config, 64, "cpu", torch.float32)
    with torch.inference_mode():
        model(ids[:12], torch.arange(12), kv)
        eager = model(ids[12:], torch.tensor([12]), kv)
    torch.testing.assert_close(static_decode_logits(model, "cpu"), eager, rtol=1e-5, atol=1e-5)


def test_batched_static_rows_equal_each_alone(monkeypatch):
    """forward_batch over StaticKV rows (a captured batched step's forward) of three lengths
    around the window of 3: each row's logits equal its sequence decoded alone, eagerly
    (Attention.forward_rows: the window and sinks per row, over its span's mask)."""
    from fused_support import make_model
    from freetoken.graphs import StaticKV
    from freetoken.kv_cache import KVCache
    from freetoken.models import fused
    monkeypatch.setattr(fused, "enabled", lambda x: False)
    model = make_model("gpt_oss", "cpu", torch.float32)
    ids = torch.arange(16) * 7 % 50
    lengths = (12, 2, 7)
    alone, rows = [], []
    with torch.inference_mode():
        for n in lengths:
            kvs = [KVCache(model.config, 64, "cpu", torch.float32) for _ in range(2)]
            for kv in kvs:
                model(ids[:n], torch.arange(n), kv)
            alone.append(model(ids[n:n + 1], torch.tensor([n]), kvs[0]))
            rows.append(StaticKV(kvs[1], torch.tensor([n]), 32, model.config.sliding_window))
        batched = model.forward_batch(torch.stack([ids[n] for n in lengths]), rows)
    torch.testing.assert_close(batched, torch.cat(alone), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_path_equals_torch_interpreted(dtype, monkeypatch):
    from fused_support import INTERPRET
    if not INTERPRET:
        pytest.skip("needs Triton and TRITON_INTERPRET=1")
    _fused_path_equals_torch("cpu", dtype, monkeypatch, force_on_cpu=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_path_and_captured_step_equal_torch_cuda(dtype, monkeypatch):
    _fused_path_equals_torch("cuda", dtype, monkeypatch, force_on_cpu=False)


def test_a_family_unverified_on_a_device_is_refused_there(monkeypatch):
    """engine.UNVERIFIED_ON refuses a family on one device type with the way out in the message
    (gpt_oss's cuda path was verified against transformers 5.24 on the H200, 2026-12-02)."""
    from freetoken import engine
    from freetoken.engine import refuse_on_device
    monkeypatch.setitem(engine.UNVERIFIED_ON, ("gpt_oss", "cuda"), "not checked")
    with pytest.raises(ConfigError, match="--device cpu only for now: not checked; use --device cpu"):
        refuse_on_device("gpt_oss", "cuda")
    refuse_on_device("gpt_oss", "cpu")
    refuse_on_device("qwen3_moe", "cuda")
