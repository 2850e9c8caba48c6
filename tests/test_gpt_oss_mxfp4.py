"""gpt-oss's experts as the hub publishes them, in MXFP4 (`*_blocks` uint8 [E, out, in/32, 16],
`*_scales` e8m0 [E, out, in/32], biases bf16; ftw/SPEC.md §9.1): `convert` copies their bytes
into mxfp4 banks (no dequantize-requantize), the biases beside them, and the engine on
--device cpu then gives transformers' logits within 1e-4 (transformers 5.24 dequantizes MXFP4
to the model's dtype on a CPU: exactly our values, checked below), per policy and cache size.
The fixture is a tiny bf16 gpt_oss whose experts are quantized here (ftw.quant, §9.4) and
written in the hub's layout. Also: a bf16 gpt_oss with `--quant` keeps its biases beside the
quantized weights."""
import json

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import ftw
import make_tiny_model as mtm
from freetoken.config import EngineConfig
from freetoken.engine import Engine, _refuse_quantized
from freetoken.errors import ModelError
from ftw import quant as Q
from ftw.convert import convert
from ftw.errors import ConvertError, MissingTensorError, UnsupportedConfigError
from test_engine_oracle import score_then_decode
from test_quant_engine import kernel_path, rewrite_banks

ATOL = 1e-4
NUM_LAYERS, E, D, I = 4, 8, 64, 64  # the tiny gpt_oss with whole 32-blocks
HUB_QUANT_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def publish_mxfp4(weight: torch.Tensor):
    """A bf16 [E, in, out] expert weight -> the hub's (blocks [E, out, in/32, 16], scales
    [E, out, in/32]): each expert's [out, in] quantized with ftw.quant's mxfp4, whose element
    bytes and e8m0 scales are the hub's (SPEC.md §9.1)."""
    blocks, scales = [], []
    for w in weight:
        x = w.float().T.contiguous().numpy()  # [out, in]
        r = Q.regions("mxfp4", x.shape)
        data = np.frombuffer(Q.quantize(x, "mxfp4"), np.uint8)
        blocks.append(data[:r.qs_nbytes].reshape(x.shape[0], -1, 16))
        scales.append(data[r.scales_offset:].reshape(r.scales_shape))
    return torch.from_numpy(np.stack(blocks)), torch.from_numpy(np.stack(scales))


def build_mxfp4(root, seed=5):
    """A tiny gpt_oss checkpoint in the hub's MXFP4 layout, and its hub tensors."""
    src = mtm.build(root, "gpt_oss", dtype="bf16", seed=seed, intermediate_size=I)
    tensors = load_file(str(src / "model.safetensors"))
    for i in range(NUM_LAYERS):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            tensors[name + "_blocks"], tensors[name + "_scales"] = publish_mxfp4(tensors.pop(name))
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = HUB_QUANT_CONFIG
    (src / "config.json").write_text(json.dumps(cfg))
    return src, tensors


class Published:
    def __init__(self, root):
        self.src, self.tensors = build_mxfp4(root / "hf")
        self.path = str(convert(self.src, root / "m.ftw", threads=2))
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(self.src, dtype=torch.float32).eval()
        gen = torch.Generator().manual_seed(3)
        self.ids = torch.randint(3, 384, (20,), generator=gen).tolist()
        with torch.no_grad():
            self.want = self.hf(torch.tensor([self.ids])).logits[0]


@pytest.fixture(autouse=True)
def fp32_kernels(monkeypatch):
    """The 1e-4 comparisons need the CPU kernels' fp32 path (the int8 one rounds the inputs per
    block: tests/test_quant_engine.py bounds it on its own)."""
    kernel_path(monkeypatch, "fp32")


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    return Published(tmp_path_factory.mktemp("gpt_oss_mxfp4"))


def test_convert_copies_the_published_bytes(published):
    """Each projection's element bytes and scales are the hub's rows (gate the even rows of
    gate_up, up the odd ones), in SPEC.md §9.2's regions; the biases are the hub's bf16."""
    t = published.tensors
    with ftw.open(published.path, verify=True) as f:
        assert f.version == 2
        for layer, b in f.banks.items():
            assert (b.quant, b.dtype) == ("mxfp4", "bf16")
            assert [p.name for p in b.projections] == ["gate", "up", "down", "gate_bias",
                                                        "up_bias", "down_bias"]
            pre = f"model.layers.{layer}.mlp.experts."
            for e in (0, 3, E - 1):
                slot = f.slot_bytes(layer, e)
                got = {p.name: slot[p.offset:p.offset + p.nbytes] for p in b.projections}
                rows = {"gate": slice(0, None, 2), "up": slice(1, None, 2), "down": slice(None)}
                for name, sel in rows.items():
                    hub = "down_proj" if name == "down" else "gate_up_proj"
                    shape = (D, I) if name == "down" else (I, D)
                    r = Q.regions("mxfp4", shape)
                    blocks = t[pre + hub + "_blocks"][e, sel].numpy().reshape(-1)
                    scales = t[pre + hub + "_scales"][e, sel].numpy().reshape(-1)
                    assert np.array_equal(got[name][:r.qs_nbytes], blocks), (layer, e, name)
                    assert np.array_equal(got[name][r.scales_offset:r.nbytes], scales), (layer, e, name)
                bias = t[pre + "gate_up_proj_bias"][e].view(torch.uint16).numpy()
                assert np.array_equal(got["gate_bias"].view(np.uint16), bias[0::2])
                assert np.array_equal(got["up_bias"].view(np.uint16), bias[1::2])
                down_bias = t[pre + "down_proj_bias"][e].view(torch.uint16).numpy()
                assert np.array_equal(got["down_bias"].view(np.uint16), down_bias)


def test_transformers_dequantizes_to_our_values(published):
    """The oracle reads the same numbers: transformers' dequantized experts ([E, in, out], gate
    and up interleaved) equal ftw.quant's dequantize of our banks, exactly."""
    with ftw.open(published.path) as f:
        for layer, b in f.banks.items():
            experts = published.hf.model.layers[layer].mlp.experts
            for e in (0, E - 1):
                slot = f.slot_bytes(layer, e)
                ours = {p.name: torch.from_numpy(Q.dequantize(slot[p.offset:p.offset + p.nbytes],
                                                              "mxfp4", p.shape))
                        for p in b.projections[:3]}
                gate_up = experts.gate_up_proj[e].detach()  # [D, 2I]
                assert torch.equal(gate_up[:, 0::2].T, ours["gate"]), (layer, e)
                assert torch.equal(gate_up[:, 1::2].T, ours["up"]), (layer, e)
                assert torch.equal(experts.down_proj[e].detach().T, ours["down"]), (layer, e)


@pytest.mark.parametrize("policy", ["hybrid", "offload", "cpu"])
@pytest.mark.parametrize("cache", [0.0, 0.25, 1.0])
def test_logits_match_transformers(published, policy, cache):
    """Prefill in chunks of 8, then decode steps: every position's logits within 1e-4 of
    transformers' on the MXFP4 checkpoint (the CPU kernels read the mxfp4 blocks, the biases
    beside them, from the bank and the cpu tier's slots)."""
    with Engine(published.path, EngineConfig(device="cpu", dtype="fp32", policy=policy,
                                             prefill_chunk=8, expert_cache_frac=cache)) as engine:
        got, held = score_then_decode(engine, published.ids, 5)
    assert held[0] == len(published.ids)
    diff = (got - published.want).abs().amax(dim=-1)
    assert float(diff.max()) <= ATOL, f"worst position {int(diff.argmax())}: {float(diff.max()):.3g}"


def test_refusals_say_what_to_do(tmp_path, published):
    with pytest.raises(ConvertError, match="--quant q4_0: layer 0's experts are MXFP4 as published.*"
                                           "without --quant"):
        convert(published.src, tmp_path / "q.ftw", quant="q4_0")
    assert not (tmp_path / "q.ftw").exists()
    src, tensors = build_mxfp4(tmp_path / "hf")
    del tensors["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(MissingTensorError, match="down_proj_blocks has no matching scales"):
        convert(src, tmp_path / "m.ftw")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes"}
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedConfigError, match="'bitsandbytes'.*MXFP4 release or a bf16"):
        convert(src, tmp_path / "m.ftw")


@pytest.mark.parametrize("quant", ["q8_0", "mxfp4"])
def test_quant_keeps_the_biases(tmp_path, quant):
    """A bf16 gpt_oss converted with --quant: the weights quantized, the biases as bf16 beside
    them; the engine's logits equal those of a copy holding the dequantized values (1e-4)."""
    src = mtm.build(tmp_path / "hf", "gpt_oss", dtype="bf16", seed=2, intermediate_size=I)
    path = convert(src, tmp_path / "q.ftw", threads=2, quant=quant)
    with ftw.open(path, verify=True) as f:
        b = f.banks[0]
        assert b.quant == quant and [p.nbytes for p in b.projections[3:]] == [2 * I, 2 * I, 2 * D]
        with pytest.raises(ModelError, match="quantized experts with biases.*--device cpu"):
            _refuse_quantized(f, torch.device("cuda"))  # the device kernels read no biases yet
    dequantized = rewrite_banks(path, tmp_path / "dq.ftw")
    ids = list(range(5, 25))
    scores = []
    for p in (path, dequantized):
        with Engine(str(p), EngineConfig(device="cpu", dtype="fp32", expert_cache_frac=0.25)) as engine:
            scores.append(engine.score(ids))
    assert float((scores[0] - scores[1]).abs().max()) <= ATOL
