"""Quantized experts end to end on --device cpu: `convert --quant q8_0|q4_0|mxfp4|nvfp4|fp8_e4m3` of a
tiny HF checkpoint (the experts' bytes are ftw.quant's, every other tensor as converted without it),
then the engine on it against the same engine on a copy whose banks hold the dequantized values
as fp32: logits within 1e-4 and the same greedy tokens, for expert caches of none / some / all
experts and the hybrid / offload / cpu policies (the CPU kernels read the bank's and the cpu
tier's quantized slots), and the refusals where no path runs yet. On cuda (gpu): the same
logits as --device cpu's, every expert path there reading the quantized slots (the Triton
kernels: tests/test_quant_device_kernels.py).

The CPU kernels run their fp32 path here (KernelTuning.qdot="fp32", set for every test by
`fp32_kernels`), exact up to the order of additions; the int8 path (the default: inputs
rounded to int8 per 32-block, cython/qdot.h) has its own test, greedy tokens equal to the
dequantized model's and logits within INT8_ATOL."""
import re

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import ftw
import make_tiny_model as mtm
from convert_support import hf_tensors
from freetoken import kernels
from freetoken.cli import main
from freetoken.config import EngineConfig, Tuning
from freetoken.engine import Engine, _refuse_quantized
from freetoken.kernel_args import DEVICE_QUANTS
from freetoken.errors import ConfigError, ModelError
from freetoken.sampling import SamplingParams
from test_engine_oracle import score_then_decode
from ftw import constants as C, quant as Q, writer
from ftw.hf_source import convert_dtype
from ftw.convert import convert

ATOL = 1e-4
INT8_ATOL = 5e-2  # the int8 path's logits (seen: 1e-3 .. 1e-2 on this model)
PROMPT = [5, 77, 300, 12, 9, 141, 250, 33, 61, 199, 8, 120, 45, 370]
CACHE_FRACS = {"none": 0.0, "some": 0.25, "all": 1.0}  # of 24 experts: 0, 6, 24
POLICIES = ("hybrid", "offload", "cpu")


def rewrite_banks(path, out, quant="none"):
    """The FTW file at `path` written to `out` with every bank's values dequantized, then stored
    as fp32 ("none") or quantized again as `quant` (biases as fp32); tensors and metadata
    unchanged."""
    with ftw.open(path) as f:
        tensors = [writer.tensor_from_array(n, t.dtype, np.array(f.tensor(n)))
                   for n, t in f.tensors.items()]
        banks = []
        for layer, b in f.banks.items():
            experts = []
            for e in range(b.num_experts):
                slot = f.slot_bytes(layer, e)
                experts.append({p.name: values(slot[p.offset:p.offset + p.nbytes], b, p)
                                for p in b.projections})
            banks.append(writer.bank_from_arrays(layer, "fp32", experts, quant=quant))
        writer.write(str(out), dict(f.metadata), tensors, banks, threads=2)
    return str(out)


def values(raw, bank, proj):
    """One projection's values as fp32: dequantized weights, or biases (stored as `dtype`)."""
    if bank.quant != "none" and proj.name not in C.BIAS_PROJECTIONS:
        return Q.dequantize(raw, bank.quant, proj.shape)
    return convert_dtype(np.asarray(raw).view(C.NUMPY_DTYPES[bank.dtype]), bank.dtype, "fp32").reshape(proj.shape)


class Quantized:
    """One tiny qwen3_moe (I = D = 64: whole 32-blocks) converted with --quant, and its
    dequantized copy."""

    def __init__(self, root, quant):
        self.quant = quant
        self.src = mtm.build(root / "hf", "qwen3_moe", dtype="fp32", seed=7, moe_intermediate_size=64)
        self.path = str(root / "q.ftw")
        r = CliRunner().invoke(main, ["convert", str(self.src), "-o", self.path, "--quant", quant,
                                      "--threads", "2"])
        assert r.exit_code == 0, r.output
        self.dequantized = rewrite_banks(self.path, root / "dq.ftw")

    def engine(self, path=None, **options):
        return Engine(path or self.path, EngineConfig(**{"device": "cpu", "dtype": "fp32", **options}))


def kernel_path(monkeypatch, qdot):
    """The CPU kernels' KernelTuning.qdot for the engines made next: the variable, and a fresh
    shared pool (a --device cpu engine keeps the pool's tuning)."""
    monkeypatch.setenv(kernels.TUNE_ENV, f"qdot={qdot}")
    monkeypatch.setattr(kernels, "_shared", None)


@pytest.fixture(autouse=True)
def fp32_kernels(monkeypatch):
    kernel_path(monkeypatch, "fp32")


# the default run's interpreted cells (conftest.py: the others are marked slow): a block type's
# decode steps and whole-cache prefill, fp8's integer decode
SUITE_CELLS = {"test_device_paths_read_quantized_slots_interpreted": [
    {"model": "q4_0"}, {"model": "fp8_e4m3", "cache": "some"}]}


@pytest.fixture(scope="module", params=["q8_0", "q4_0", "mxfp4", "nvfp4", "fp8_e4m3"])
def model(request, tmp_path_factory):
    return Quantized(tmp_path_factory.mktemp(request.param), request.param)


def test_convert_quantizes_the_experts_alone(model, tmp_path):
    plain = convert(model.src, tmp_path / "plain.ftw", threads=2)
    hf = hf_tensors(model.src)
    with ftw.open(model.path, verify=True) as f, ftw.open(plain) as p:
        assert f.version == 2 and p.version == 1
        assert {b.quant for b in f.banks.values()} == {model.quant}
        assert all(b.dtype == "fp32" for b in f.banks.values())  # the compute dtype
        for name, t in p.tensors.items():  # dense tensors as converted without --quant
            assert f.tensors[name].quant == "none"
            assert f.tensor_bytes(name).tobytes() == p.tensor_bytes(name).tobytes(), name
        for layer, b in f.banks.items():
            for e in (0, b.num_experts - 1):
                slot = f.slot_bytes(layer, e)
                for proj in b.projections:
                    hf_name = f"model.layers.{layer}.mlp.experts.{e}.{proj.name}_proj.weight"
                    want = Q.quantize(hf[hf_name].numpy(), model.quant)
                    assert slot[proj.offset:proj.offset + proj.nbytes].tobytes() == want, hf_name
        nbytes = [sum(q.nbytes for q in fb.banks[0].projections) for fb in (f, p)]
        assert nbytes[0] < nbytes[1] / 3  # fp32 elements: 4 bytes, q8_0 1 + 1/16, 4-bit ~1/2 + 1/16
    text = CliRunner().invoke(main, ["inspect", model.path]).output
    assert "expert banks (" in text and f"quant {model.quant})" in text  # the summary line
    assert re.search(rf"blk\.0\.ffn_exps +fp32 +{model.quant} ", text)


@pytest.mark.parametrize("dtype, layout", [("bf16", "fused"), ("fp16", "per_expert")])
def test_convert_quantizes_bf16_and_fp16_experts_from_their_values(tmp_path, dtype, layout):
    """The experts' values in the output dtype (bf16, fp16: widened to fp32 exactly) are what
    gets quantized, from either source layout; the bank's dtype stays the source's."""
    src = mtm.build(tmp_path / "hf", "qwen3_moe", layout=layout, dtype=dtype, moe_intermediate_size=64)
    out = convert(src, tmp_path / "q.ftw", threads=2, quant="q8_0")
    hf = hf_tensors(src)
    with ftw.open(out, verify=True) as f:
        b = f.banks[1]
        assert (b.dtype, b.quant) == (dtype, "q8_0")
        proj = {p.name: p for p in b.projections}
        slot = f.slot_bytes(1, 3)
        if layout == "fused":  # [E, 2I, D] gate rows then up rows; [E, D, I]
            want = {"gate": hf["model.layers.1.mlp.experts.gate_up_proj"][3, :64],
                    "down": hf["model.layers.1.mlp.experts.down_proj"][3]}
        else:
            want = {p: hf[f"model.layers.1.mlp.experts.3.{p}_proj.weight"] for p in ("gate", "down")}
        for name, t in want.items():
            p = proj[name]
            got = slot[p.offset:p.offset + p.nbytes].tobytes()
            assert got == Q.quantize(t.float().numpy(), "q8_0"), name


def test_convert_refuses_experts_that_are_not_whole_blocks(tmp_path):
    src = mtm.build(tmp_path / "hf", "qwen3_moe", dtype="fp32")  # I = 48
    r = CliRunner().invoke(main, ["convert", str(src), "-o", str(tmp_path / "m.ftw"), "--quant", "q4_0"])
    assert r.exit_code != 0 and "--quant q4_0" in r.output and "multiple of 32" in r.output
    assert not (tmp_path / "m.ftw").exists()


def assert_close(ours, ref, what):
    diff = float((ours - ref).abs().max())
    assert diff <= ATOL, f"{what}: max |diff| {diff:.3g}"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("cache", CACHE_FRACS)
def test_logits_equal_the_dequantized_model(model, cache, policy):
    """Decode steps (chunks of 1: plans, fills, evictions) and a 14-token prefill (streamed
    layers where a cache exists) both equal the dequantized model's."""
    for chunk in (1, 512):
        options = dict(expert_cache_frac=CACHE_FRACS[cache], policy=policy, prefill_chunk=chunk)
        with model.engine(model.dequantized, **options) as engine:
            want = engine.score(PROMPT)
        with model.engine(**options) as engine:
            got = engine.score(PROMPT)
            stats = engine.experts.stats
        assert_close(got, want, f"{model.quant} cache={cache} policy={policy} chunk={chunk}")
        if cache == "some" and chunk == 1 and policy != "cpu":
            assert stats["fills"] > 0 and stats["hits"] > 0  # the cpu tier's slots were read


def test_greedy_tokens_equal_the_dequantized_model(model):
    params = SamplingParams(temperature=0, max_tokens=8)
    with model.engine(model.dequantized, expert_cache_frac=0.25, policy="hybrid") as engine:
        want = list(engine.generate(PROMPT, params))
    with model.engine(expert_cache_frac=0.25, policy="hybrid") as engine:
        assert list(engine.generate(PROMPT, params)) == want


def test_int8_path_keeps_the_greedy_tokens(model, monkeypatch):
    """The default int8 path (x and h rounded to int8 per 32-block; nvfp4 and fp8_e4m3 stay fp32): the
    same greedy tokens as the dequantized model, logits within INT8_ATOL of it, and not the fp32
    path's logits (it ran)."""
    params = SamplingParams(temperature=0, max_tokens=8)
    options = dict(expert_cache_frac=0.25, policy="hybrid")
    with model.engine(model.dequantized, **options) as engine:
        want_tokens = list(engine.generate(PROMPT, params))
        want = engine.score(PROMPT)
    kernel_path(monkeypatch, "int8")
    with model.engine(**options) as engine:
        assert list(engine.generate(PROMPT, params)) == want_tokens
        got = engine.score(PROMPT)
    diff = float((got - want).abs().max())
    assert diff <= INT8_ATOL, f"{model.quant} int8: max |diff| {diff:.3g}"
    fp32_only = model.quant in ("nvfp4", "fp8_e4m3")
    assert diff > (-1 if fp32_only else ATOL), f"{model.quant}: the int8 path did not run"
    assert diff <= (ATOL if fp32_only else INT8_ATOL)


def test_torch_reference_paths_dequantize(model):
    """The torch CPU executor and the dense reference runtime (the tests' oracles) read a
    quantized bank through ftw.quant's dequantize: the same logits."""
    with model.engine(model.dequantized, expert_cache_frac=0.0) as engine:
        want = engine.score(PROMPT)
    for tuning in (Tuning(cpu_experts="torch"), Tuning(reference_experts=True)):
        with model.engine(expert_cache_frac=0.0, tuning=tuning) as engine:
            assert_close(engine.score(PROMPT), want, f"{model.quant} {tuning}")


@pytest.mark.parametrize("cache, chunk", [("some", 1), ("all", 512)])
def test_device_paths_read_quantized_slots_interpreted(model, cache, chunk, monkeypatch):
    """The cuda runtime's expert paths on cpu tensors, the Triton kernels interpreted: the
    torch tier (tier_torch) with the runtime's QuantSpecs, so that decode steps' hits and fills
    (host_step), streamed prefill layers and a resident layer's runs reach the grouped kernels
    through bank.pool_bytes, as on cuda. Logits equal the dequantized model's."""
    import os
    from freetoken.experts import runtime
    from freetoken.experts.compute import grouped_experts
    from freetoken.experts.compute.quant_blocks import QuantSpec
    if not grouped_experts.available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton and TRITON_INTERPRET=1")
    if model.quant not in DEVICE_QUANTS:
        pytest.skip(f"{model.quant}: no device kernels yet")

    def one_storage(x, weights, quant=None):  # grouped_experts._one_storage, cpu tensors too
        plain = grouped_experts._bytes if quant is not None else grouped_experts._plain
        storage = weights[0].untyped_storage().data_ptr()
        return all(plain(w, x.dtype) and w.untyped_storage().data_ptr() == storage for w in weights)

    monkeypatch.setattr(grouped_experts, "_one_storage", one_storage)
    monkeypatch.setattr(runtime, "_refuse_quantized_tier", lambda *args: None)
    options = dict(expert_cache_frac=CACHE_FRACS[cache], policy="hybrid", prefill_chunk=chunk)
    with model.engine(model.dequantized, **options) as engine:
        want = engine.score(PROMPT)
        plain_stride = engine.experts.cache.slot_stride
    with model.engine(tuning=Tuning(tier_torch=True), **options) as engine:
        rt = engine.experts
        # a slot is the bank's quantized slot (a GB budget's slot count follows from it)
        assert rt.cache.storage.shape[1] == rt.infos[0].slot_stride < plain_stride
        rt.quant.update({layer: QuantSpec.of(info) for layer, info in rt.infos.items()})  # cuda's
        assert rt.prefill.quant is rt.quant
        got = engine.score(PROMPT)
        stats = rt.stats
    assert_close(got, want, f"{model.quant} interpreted cache={cache} chunk={chunk}")
    assert stats["device_routes"] > 0
    if chunk == 512 and cache == "some":
        assert stats["prefill_layers_streamed"] > 0


def test_cli_run_on_a_quantized_model(model):
    """`freetoken run --device cpu` with an expert cache on the quantized file prints the text
    it prints on the dequantized copy, and the expert counters."""
    texts = []
    for path in (model.path, model.dequantized):
        r = CliRunner().invoke(main, ["run", path, "--device", "cpu", "--dtype", "fp32", "-n", "6",
                                      "--temp", "0", "--expert-cache-gb", "0.0001", "--stats",
                                      "-p", "def main():"])
        assert r.exit_code == 0, r.output
        texts.append(r.stdout)  # the text (the memory plan and timings go to stderr)
    assert texts[0] == texts[1] and len(texts[0]) > 0
    assert "hits=" in r.output and "fills=" in r.output


def test_refusals_name_what_runs(model, tmp_path):
    with pytest.raises(ConfigError, match="native CPU kernels.*--expert-cache-gb 0"):
        model.engine(expert_cache_frac=0.25, tuning=Tuning(tier_torch=True))
    with ftw.open(model.path) as f:
        if model.quant in DEVICE_QUANTS:
            _refuse_quantized(f, torch.device("cuda"))  # the Triton kernels read them there
        _refuse_quantized(f, torch.device("cpu"))
    for quant in ("nvfp4", "fp8_e4m3"):
        other = rewrite_banks(model.path, tmp_path / f"{quant}.ftw", quant=quant)
        with ftw.open(other) as f:  # the CPU kernels read them
            _refuse_quantized(f, torch.device("cpu"))
            if quant not in DEVICE_QUANTS:
                with pytest.raises(ModelError, match=f"holds {quant} experts.*runs "
                                                     f"{', '.join(DEVICE_QUANTS)} experts on --device cuda"):
                    _refuse_quantized(f, torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("cache", CACHE_FRACS)
def test_cuda_logits_equal_the_cpu_device(model, cache, policy):
    """On cuda every expert path reads the quantized slots: streamed prefill layers and slot
    path runs (grouped_experts), decode steps replayed from graphs (triton_experts), fills and
    admissions moving the bytes unchanged, the misses on the CPU kernels. fp32 on both devices:
    logits within ATOL of --device cpu's, the prompt prefilled in one forward and in chunks of
    4, its last 6 tokens as decode steps."""
    if model.quant not in DEVICE_QUANTS:
        pytest.skip(f"{model.quant}: no device kernels yet")
    options = dict(expert_cache_frac=CACHE_FRACS[cache], policy=policy)
    with model.engine(**options) as engine:
        want = engine.score(PROMPT)
    for chunk in (512, 4):
        with model.engine(device="cuda", prefill_chunk=chunk, **options) as engine:
            assert engine.graphs is not None, engine.graphs_off  # decode: triton_experts
            got, _ = score_then_decode(engine, PROMPT, 6)
            stats = engine.experts.stats
        assert_close(got, want, f"cuda {model.quant} cache={cache} policy={policy} chunk={chunk}")
        if cache == "all" or (cache != "none" and policy != "cpu"):  # (cpu: never fills)
            assert stats["device_routes"] > 0  # the quantized slots were read on the device
