"""DeepSeek-V3 / Qwen FP8 checkpoints as published (ftw/SPEC.md §9.1 fp8_e4m3): every linear
weight stored float8_e4m3fn [out, in] with its `weight_scale_inv` fp32 [ceil(out/128),
ceil(in/128)]. `convert` copies the experts' e4m3 bytes and scales into fp8_e4m3 banks, byte for
byte (no dequantize-requantize), and dequantizes the dense FP8 tensors to the compute dtype
(`inspect` lists them). The fixture is a tiny fp32 qwen3_moe (D = 160, I = 48: partial tiles in
both dims) whose experts and attention projections are quantized here with torch in the HF
layout, and a copy of it holding the dequantized values as fp32."""
import json
import re

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import ftw
import make_tiny_model as mtm
from convert_support import raw
from freetoken.cli import main
from ftw import quant as Q
from ftw.convert import convert
from ftw.errors import ConvertError, UnsupportedConfigError

D, I, TILE = 160, 48, 128
HUB_QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [TILE, TILE]}
DENSE = ("self_attn.q_proj", "self_attn.o_proj")  # dense FP8 tensors of the fixture


def publish_fp8(w: torch.Tensor):
    """An fp32 [out, in] weight -> (float8_e4m3fn [out, in], fp32 weight_scale_inv [ceil(out/128),
    ceil(in/128)]) as DeepSeek-V3's and Qwen's FP8 releases store them (torch's own rounding)."""
    out, inn = w.shape
    tr, tc = -(-out // TILE), -(-inn // TILE)
    padded = torch.zeros(tr * TILE, tc * TILE)
    padded[:out, :inn] = w
    amax = padded.reshape(tr, TILE, tc, TILE).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)).float()
    full = scale.repeat_interleave(TILE, 0).repeat_interleave(TILE, 1)[:out, :inn]
    q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out, inn = q.shape
    full = scale.repeat_interleave(TILE, 0).repeat_interleave(TILE, 1)[:out, :inn]
    return q.float() * full


def is_fp8(name: str) -> bool:
    return name.endswith(".weight") and (".mlp.experts." in name or any(d in name for d in DENSE))


def build_fp8(root, seed=11):
    """(fp8 checkpoint, its dequantized fp32 copy, the fp8 checkpoint's tensors)."""
    src = mtm.build(root / "fp8", "qwen3_moe", dtype="fp32", seed=seed, hidden_size=D,
                    moe_intermediate_size=I)
    tensors = load_file(str(src / "model.safetensors"))
    fp8, dq = {}, {}
    for name, t in tensors.items():
        if is_fp8(name):
            q, s = publish_fp8(t)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            dq[name] = dequantize_fp8(q, s)
        else:
            fp8[name] = dq[name] = t
    save_file(fp8, str(src / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = HUB_QUANT_CONFIG
    (src / "config.json").write_text(json.dumps(cfg))
    plain = mtm.build(root / "dq", "qwen3_moe", dtype="fp32", seed=seed, hidden_size=D,
                      moe_intermediate_size=I)
    save_file(dq, str(plain / "model.safetensors"), metadata={"format": "pt"})
    return src, plain, fp8


class Published:
    def __init__(self, root):
        self.src, self.plain, self.tensors = build_fp8(root)
        self.path = str(convert(self.src, root / "fp8.ftw", threads=2))
        self.dequantized = str(convert(self.plain, root / "dq.ftw", threads=2))


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    return Published(tmp_path_factory.mktemp("fp8"))


def test_fixture_is_torch_fp8():
    """The fixture's e4m3 codes are torch's, and ftw.quant's decode of them is torch's value."""
    w = torch.randn(130, 200) * 3
    q, s = publish_fp8(w)
    r = Q.regions("fp8_e4m3", w.shape)
    data = Q.assemble("fp8_e4m3", w.shape, q.view(torch.uint8).numpy(), s.numpy())
    assert r.scales_shape == (2, 2) and len(data) == r.nbytes
    np.testing.assert_array_equal(Q.dequantize(data, "fp8_e4m3", w.shape), dequantize_fp8(q, s).numpy())


def test_convert_copies_the_published_experts(published):
    """Each projection's e4m3 bytes and fp32 scales are the checkpoint's, unchanged."""
    with ftw.open(published.path, verify=True) as f:
        assert f.version == 2
        assert {(b.dtype, b.quant) for b in f.banks.values()} == {("fp32", "fp8_e4m3")}
        for layer, b in f.banks.items():
            for e in range(b.num_experts):
                slot = f.slot_bytes(layer, e)
                for p in b.projections:
                    name = f"model.layers.{layer}.mlp.experts.{e}.{p.name}_proj.weight"
                    r = Q.regions("fp8_e4m3", p.shape)
                    got = slot[p.offset:p.offset + p.nbytes]
                    assert got[:r.qs_nbytes].tobytes() == raw(published.tensors[name]), name
                    assert (got[r.scales_offset:].tobytes()
                            == raw(published.tensors[name + "_scale_inv"])), name


def test_dense_fp8_tensors_are_dequantized(published):
    """Dense FP8 tensors hold e4m3 * scale (fp32, exactly torch's), every other tensor is the
    plain copy's; `inspect` names the dequantized ones."""
    with ftw.open(published.path) as f, ftw.open(published.dequantized) as p:
        assert set(f.tensors) == set(p.tensors)
        for name, t in f.tensors.items():
            assert (t.dtype, t.quant) == ("fp32", "none")
            assert f.tensor_bytes(name).tobytes() == p.tensor_bytes(name).tobytes(), name
        dq = f.metadata[ftw.constants.KEY_DEQUANTIZED]
        assert sorted(dq) == sorted(f"blk.{i}.attn_{w}.weight" for i in range(3) for w in ("q", "output"))
        assert all("fp8_e4m3" in how and how.endswith("-> fp32") for how in dq.values())
    text = CliRunner().invoke(main, ["inspect", published.path]).output
    assert "dense tensors dequantized at convert (6;" in text
    assert re.search(r"blk\.0\.attn_q\.weight +model\.layers\.0\.self_attn\.q_proj\.weight: fp8_e4m3", text)
    assert re.search(r"blk\.0\.ffn_exps +fp32 +fp8_e4m3 ", text)


def test_fp8_bank_is_smaller(published):
    with ftw.open(published.path) as f, ftw.open(published.dequantized) as p:
        assert f.banks[0].nbytes < p.banks[0].nbytes / 3  # e4m3: 1 byte (+ scales), fp32: 4


def test_fp8_experts_refuse_another_quant(published, tmp_path):
    with pytest.raises(ConvertError, match="FP8 as published"):
        convert(published.src, tmp_path / "x.ftw", threads=2, quant="q4_0")
    out = convert(published.src, tmp_path / "y.ftw", threads=2, quant="fp8_e4m3")  # a no-op
    with ftw.open(out) as f, ftw.open(published.path) as g:
        assert f.slot_bytes(1, 5).tobytes() == g.slot_bytes(1, 5).tobytes()


def test_fp8_weight_without_scale_is_refused(published, tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    for p in published.src.iterdir():
        if p.suffix != ".safetensors":
            (src / p.name).write_bytes(p.read_bytes())
    tensors = dict(published.tensors)
    del tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedConfigError, match="no model.layers.0.self_attn.q_proj.weight_scale_inv"):
        convert(src, tmp_path / "x.ftw", threads=2)
    tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedConfigError, match=r"F32 \[1, 2\]"):
        convert(src, tmp_path / "y.ftw", threads=2)


def test_other_fp8_blocks_are_refused(published, tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    for p in published.src.iterdir():
        (src / p.name).write_bytes(p.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [64, 64]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedConfigError, match=r"weight_block_size is \[64, 64\]"):
        convert(src, tmp_path / "x.ftw", threads=2)


def test_quant_fp8_e4m3_of_fp32_experts(published, tmp_path):
    """`--quant fp8_e4m3` of the dequantized copy: ftw.quant's reference quantizer per expert."""
    out = tmp_path / "q.ftw"
    r = CliRunner().invoke(main, ["convert", str(published.plain), "-o", str(out), "--quant",
                                  "fp8_e4m3", "--threads", "2"])
    assert r.exit_code == 0, r.output
    plain = load_file(str(published.plain / "model.safetensors"))
    with ftw.open(out, verify=True) as f:
        b = f.banks[2]
        assert (b.dtype, b.quant) == ("fp32", "fp8_e4m3")
        slot = f.slot_bytes(2, 6)
        for p in b.projections:
            w = plain[f"model.layers.2.mlp.experts.6.{p.name}_proj.weight"].numpy()
            assert slot[p.offset:p.offset + p.nbytes].tobytes() == Q.quantize(w, "fp8_e4m3")


PROMPT = [5, 77, 300, 12, 9, 141, 250, 33, 61, 199, 8, 120, 45, 370]


@pytest.fixture
def fp32_kernels(monkeypatch):
    """The CPU kernels' fp32 path (fp8_e4m3 has no other; set anyway, as test_quant_engine)."""
    from freetoken import kernels
    monkeypatch.setenv(kernels.TUNE_ENV, "qdot=fp32")
    monkeypatch.setattr(kernels, "_shared", None)


@pytest.mark.parametrize("policy, cache", [("cpu", 0.0), ("hybrid", 0.25), ("offload", 1.0)])
def test_engine_on_the_published_fp8_equals_the_dequantized_model(published, fp32_kernels, policy, cache):
    """The CPU kernels read the fp8_e4m3 banks (D = 160, I = 48: partial tiles) as the
    dequantized values: logits within 1e-4 of the engine on the dequantized fp32 checkpoint,
    decode steps and a whole-prompt prefill."""
    from freetoken.config import EngineConfig
    from freetoken.engine import Engine
    for chunk in (1, 512):
        options = dict(device="cpu", dtype="fp32", expert_cache_frac=cache, policy=policy,
                       prefill_chunk=chunk)
        with Engine(published.dequantized, EngineConfig(**options)) as engine:
            want = engine.score(PROMPT)
        with Engine(published.path, EngineConfig(**options)) as engine:
            got = engine.score(PROMPT)
        diff = float((got - want).abs().max())
        assert diff <= 1e-4, f"policy={policy} cache={cache} chunk={chunk}: max |diff| {diff:.3g}"
        assert float(want.abs().max()) > 1  # real logits, not zeros


@pytest.mark.gpu
@pytest.mark.parametrize("policy, cache", [("hybrid", 0.25), ("offload", 1.0)])
def test_cuda_on_the_published_fp8_equals_the_cpu_device(published, policy, cache):
    """On cuda the Triton kernels read the fp8_e4m3 slots (decode and grouped prefill), the
    misses the CPU kernels: logits within 1e-4 of --device cpu's (fp32 on both)."""
    from freetoken.config import EngineConfig
    from freetoken.engine import Engine
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for chunk in (1, 512):
        options = dict(dtype="fp32", expert_cache_frac=cache, policy=policy, prefill_chunk=chunk)
        with Engine(published.path, EngineConfig(device="cpu", **options)) as engine:
            want = engine.score(PROMPT)
        with Engine(published.path, EngineConfig(device="cuda", **options)) as engine:
            got = engine.score(PROMPT).cpu()
        diff = float((got - want).abs().max())
        assert diff <= 1e-4, f"cuda policy={policy} cache={cache} chunk={chunk}: {diff:.3g}"


def test_deepseek_v3_fp8_checkpoint(tmp_path, fp32_kernels):
    """A tiny deepseek_v3 with every linear weight FP8 as DeepSeek-V3's release has them (MLA's
    q_a / q_b / kv_a_proj_with_mqa / kv_b / o, the dense first layer's MLP, the shared and the
    routed experts; router, norms, embeddings and lm_head fp32): the routed experts' bytes are
    copied, every other FP8 weight dequantized, and the engine's logits equal the dequantized
    checkpoint's within 1e-4."""
    from freetoken.config import EngineConfig
    from freetoken.engine import Engine
    fp8_name = re.compile(r"(_proj|_mqa)\.weight$")
    src = mtm.build(tmp_path / "fp8", "deepseek_v3", dtype="fp32", seed=4)
    plain = mtm.build(tmp_path / "dq", "deepseek_v3", dtype="fp32", seed=4)
    tensors = load_file(str(src / "model.safetensors"))
    fp8, dq = {}, {}
    for name, t in tensors.items():
        if fp8_name.search(name):
            q, s = publish_fp8(t)
            fp8[name], fp8[name + "_scale_inv"], dq[name] = q, s, dequantize_fp8(q, s)
        else:
            fp8[name] = dq[name] = t
    save_file(fp8, str(src / "model.safetensors"), metadata={"format": "pt"})
    save_file(dq, str(plain / "model.safetensors"), metadata={"format": "pt"})
    index = json.loads((src / "model.safetensors.index.json").read_text())  # (an MTP shard beside)
    index["weight_map"].update({n: "model.safetensors" for n in fp8 if n.endswith("_scale_inv")})
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = HUB_QUANT_CONFIG
    (src / "config.json").write_text(json.dumps(cfg))
    path, want_path = convert(src, tmp_path / "fp8.ftw", threads=2), convert(plain, tmp_path / "dq.ftw", threads=2)
    with ftw.open(path, verify=True) as f:
        assert {b.quant for b in f.banks.values()} == {"fp8_e4m3"} and len(f.banks) >= 1
        dq_names = set(f.metadata[ftw.constants.KEY_DEQUANTIZED])
        assert any("attn_kv_a_mqa" in n or "kv_a" in n for n in dq_names)
        assert any("shexp" in n for n in dq_names) and not any("ffn_gate_inp" in n for n in dq_names)
        layer = min(f.banks)
        p = f.banks[layer].projections[2]
        name = f"model.layers.{layer}.mlp.experts.3.down_proj.weight"
        assert f.slot_bytes(layer, 3)[p.offset:p.offset + Q.regions("fp8_e4m3", p.shape).qs_nbytes].tobytes() == raw(fp8[name])
    options = dict(device="cpu", dtype="fp32", expert_cache_frac=0.25, policy="hybrid")
    with Engine(str(want_path), EngineConfig(**options)) as engine:
        want = engine.score(PROMPT)
    with Engine(str(path), EngineConfig(**options)) as engine:
        got = engine.score(PROMPT)
    assert float((got - want).abs().max()) <= 1e-4
