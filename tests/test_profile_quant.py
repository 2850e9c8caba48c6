"""Profiles of quantized experts (issue 35): the key and record name the quant type (unquantized
keys unchanged), `freetoken profile --quant` / --model measure on that type's synthetic bank,
and a quantized bank's lookup takes its type's profile, else bf16's by FALLBACK_RULE, saying so."""
import json
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

from freetoken import bandwidth as bw
from freetoken import profile as prof
from freetoken.cli import main
from freetoken.experts.split import ExpertRates, MissBandwidths
from freetoken.quant_banks import plain_info, quant_info
from ftw import quant as Q

GPU = "Test GPU 80GB"
FAST = dict(seconds=0.05, min_working_set=4 << 20)
Q4 = prof.ExpertShape(quant="q4_0")  # the Qwen3-30B-A3B shape's q4_0 experts


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(bw, "llc_bytes", lambda: 1 << 20)  # keep working sets small
    return tmp_path / "cache"


def _store(shape, P, C, **more):
    body = {"gpu": GPU, "cpu": prof.cpu_model(), "threads": 15, "shape_key": shape.key(),
            "quant": shape.quant, "P": P, "C": C, "B_H": C * 1.25, "created": "2026-01-01T00:00:00",
            "slot_bytes": bw.synthetic_layout(shape).slot_stride, **more}
    if shape.quant == "none":
        del body["quant"]  # as every profile stored before quant types
    return prof.save_profile(body)


def test_keys_name_the_quant_type_and_bf16_keys_stay():
    assert prof.ExpertShape().key() == "2048x768-bf16"  # the key of profiles stored today
    assert prof.ExpertShape(256, 96, dtype="fp16").key() == "256x96-fp16"
    assert Q4.key() == "2048x768-bf16-q4_0"
    assert prof.profile_key(GPU, "CPU", 15, Q4.key()) != prof.profile_key(GPU, "CPU", 15, "2048x768-bf16")


def test_record_round_trip_with_the_quant_type():
    shape = prof.ExpertShape(256, 96, 4, "bf16", 16, "small", "mxfp4")
    r = prof.measure_profile(cpu_threads=1, shape=shape, **FAST)
    assert (r["quant"], r["shape_key"], r["shape"]["quant"]) == ("mxfp4", "256x96-bf16-mxfp4", "mxfp4")
    assert r["slot_bytes"] == bw.synthetic_layout(shape).slot_stride < bw.synthetic_layout(
        prof.ExpertShape(256, 96)).slot_stride
    prof.save_profile(r)
    stored = prof.load_profile(r["gpu"], prof.cpu_model(), 1, "256x96-bf16-mxfp4")
    assert stored["quant"] == "mxfp4" and stored["B_H"] == r["B_H"]
    assert prof.load_profile(r["gpu"], prof.cpu_model(), 1, "256x96-bf16") is None


def test_synthetic_quant_bank_is_the_type_convert_writes():
    """bandwidth.synthetic_bank of a quantized layout: convert's slot layout, and every slot's
    weights dequantize to finite values of the bf16 experts' size."""
    shape = prof.ExpertShape(64, 32, 2, "bf16", 4, "tiny", "q8_0")
    lay = bw.synthetic_layout(shape)
    info = quant_info(plain_info(64, 32, 1), "q8_0")
    assert (lay.quant, lay.slot_stride, lay.offset_down) == ("q8_0", info.slot_stride,
                                                             info.projections[2].offset)
    bank = bw.synthetic_bank(lay, 20)  # 16 quantized slots, 4 noisy copies
    assert bank.nbytes == 20 * lay.slot_stride and bank.ctypes.data % 4096 == 0
    slots = bank.reshape(20, -1)
    for e in (0, 19):
        w = Q.dequantize(slots[e, lay.offset_down:lay.offset_down + lay.proj_nbytes[2]], "q8_0", (64, 32))
        assert np.isfinite(w).all() and 0.005 < w.std() < 0.05  # randn x 0.02
    assert not np.array_equal(slots[3], slots[19])  # a copy of template 3, with noise


def test_cli_profile_quant_stores_a_q4_0_profile(cache_home, monkeypatch):
    monkeypatch.setattr(bw, "MIN_WORKING_SET", 4 << 20)
    monkeypatch.setattr(bw, "MEASURE_SECONDS", 0.05)
    # the default shape (Qwen3-30B-A3B's) shrunk: its 16 template slots would take seconds here
    monkeypatch.setattr(prof, "ExpertShape", lambda: bw.ExpertShape(256, 128, 4, "bf16", 8, "small"))
    res = CliRunner().invoke(main, ["profile", "--quant", "q4_0", "--cpu-threads", "1", "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.output)
    assert r["quant"] == "q4_0" and r["shape_key"] == "256x128-bf16-q4_0" and r["B_H"] > 0
    stored = prof.load_profile(r["gpu"], prof.cpu_model(), 1, "256x128-bf16-q4_0")
    assert stored["quant"] == "q4_0" and stored["slot_bytes"] == r["slot_bytes"]
    assert "--quant [none|q8_0|q4_0|mxfp4|nvfp4|fp8_e4m3]" in CliRunner().invoke(
        main, ["profile", "--help"]).output


def test_cli_profile_model_measures_its_quant_type(tmp_path, monkeypatch):
    """--model of a q8_0 model profiles q8_0; --quant none on it profiles its bf16 shape."""
    from ftw import writer
    monkeypatch.setattr(bw, "MIN_WORKING_SET", 4 << 20)
    monkeypatch.setattr(bw, "MEASURE_SECONDS", 0.05)
    rng = np.random.default_rng(0)
    experts = [{k: (rng.standard_normal(s) * 0.02).astype(np.float32)
                for k, s in (("gate", (64, 160)), ("up", (64, 160)), ("down", (160, 64)))}
               for _ in range(4)]
    path = tmp_path / "m.ftw"
    writer.write(str(path), {"model.config": {"family": "qwen3_moe", "num_experts_per_tok": 2}},
                 [], [writer.bank_from_arrays(0, "bf16", experts, "q8_0")])
    for extra, key in (([], "160x64-bf16-q8_0"), (["--quant", "none"], "160x64-bf16")):
        res = CliRunner().invoke(main, ["profile", "--model", str(path), "--cpu-threads", "1",
                                        "--json", *extra])
        assert res.exit_code == 0, res.output
        assert json.loads(res.output)["shape_key"] == key
    res = CliRunner().invoke(main, ["profile", "--model", str(path), "--cpu-threads", "1"])
    assert res.exit_code == 0 and "D=160 I=64 bf16 q8_0 experts top-2" in res.output, res.output


def test_a_quantized_bank_takes_its_type_else_bf16_scaled(monkeypatch):
    monkeypatch.setattr(prof, "gpu_name", lambda device=None: GPU)
    slot = bw.synthetic_layout(Q4).slot_stride
    assert prof.get_bandwidths("cuda", slot, shape=Q4) is None  # nothing stored
    _store(prof.ExpertShape(), 40.0, 80.0)
    got = prof.get_bandwidths("cuda", slot, shape=Q4)
    ratio = bw.synthetic_layout(Q4).expert_nbytes / bw.synthetic_layout(prof.ExpertShape()).expert_nbytes
    assert 0.25 < ratio < 0.3  # 4.5 bits of 16
    assert got["P"] == 40.0 and got["C"] == pytest.approx(80.0 * ratio)
    assert got["C_alone"] == pytest.approx(100.0 * ratio)
    assert got["fallback"].startswith(f"no q4_0 profile: 2048x768-bf16's with C x {ratio:.2f}")
    assert "run `freetoken profile --model MODEL.ftw`" in got["fallback"]
    assert got["fallback"] in got["source"]
    # a bf16 bank is not scaled, nor a q8_0 one by q4_0's ratio
    assert prof.get_bandwidths("cuda", 9437184, shape=prof.ExpertShape())["fallback"] == ""
    q8 = prof.get_bandwidths("cuda", None, shape=prof.ExpertShape(quant="q8_0"))
    assert q8["C"] == pytest.approx(80.0 * 34 / 64, rel=1e-3) and "no q8_0 profile" in q8["fallback"]
    _store(Q4, 42.0, 30.0)  # the type's own profile wins
    got = prof.get_bandwidths("cuda", slot, shape=Q4)
    assert (got["P"], got["C"], got["fallback"]) == (42.0, 30.0, "")
    assert "2048x768-bf16-q4_0" in got["source"]
    assert prof.get_bandwidths("cuda", 9437184, shape=prof.ExpertShape())["C"] == 80.0
    assert prof.get_bandwidths("cuda", 9437184)["C"] == 80.0  # no shape: unquantized only
    assert prof.get_bandwidths("cuda", slot) is None  # no shape: unquantized profiles only


def test_expert_rates_of_a_quantized_model_say_the_fallback(monkeypatch):
    """The engine's lookup (expert_rates) over q4_0 banks: bf16's profile scaled, and the split
    line the runtime prints names it and the fix; the prefill rates fall back alike."""
    monkeypatch.setattr(prof, "gpu_name", lambda device=None: GPU)
    info = quant_info(plain_info(2048, 768, 128), "q4_0")
    banks = {0: SimpleNamespace(info=info)}
    config = SimpleNamespace(cuda_graphs=False, cpu_threads=15)
    assert not prof.expert_rates(banks, config, "cuda").measured
    _store(prof.ExpertShape(), 40.0, 80.0, B_P=50.0, cpu_gflops=300.0)
    rates = prof.expert_rates(banks, config, "cuda")
    assert rates.measured and rates.miss.P == 40.0 and rates.miss.C < 80.0 * 0.3
    assert (rates.stream_gbps, rates.cpu_gflops) == (50.0, 300.0)
    assert rates.origin().startswith("profile; no q4_0 profile: 2048x768-bf16's with C x 0.28")
    assert "freetoken profile --model" in rates.origin()
    _store(Q4, 42.0, 30.0, cpu_gflops=200.0)
    rates = prof.expert_rates(banks, config, "cuda")
    assert (rates.miss.C, rates.cpu_gflops, rates.origin()) == (30.0, 200.0, "profile")


def test_runtime_split_line_prints_the_rates_origin():
    from test_expert_runtime import CONFIG, D, E, I, LAYERS, make_banks
    from freetoken.config import EngineConfig, Tuning
    from freetoken.experts import create_expert_runtime
    banks, _ = make_banks(LAYERS, E, D, I)
    rates = ExpertRates(MissBandwidths(1.0, 2.0, 1.0, 2.0), measured=True, note="no q4_0 profile: X")
    rt = create_expert_runtime(banks, CONFIG, EngineConfig(expert_cache_frac=0.5, tuning=Tuning(
        cpu_experts="torch")), "cpu", "fp32", rates)
    assert "(profile; no q4_0 profile: X, copy fills)" in rt.split_info
    rt.close()


def test_bandwidths_for_calibrates_the_type_or_falls_back(monkeypatch):
    monkeypatch.setattr(prof, "gpu_name", lambda device=None: GPU)
    lay = bw.synthetic_layout(Q4)
    _store(prof.ExpertShape(), 40.0, 80.0)
    P, C, src = prof.bandwidths_for(lay, "cuda", num_threads=15)
    assert P == 40.0 and C < 80.0 * 0.3 and "no q4_0 profile" in src
    calibrated = []
    monkeypatch.setattr(prof, "run_calibration", lambda threads, shape: calibrated.append(shape) or {
        "P": 41.0, "C": 33.0, "threads": threads, "shape_key": shape.key(), "calibrated": True})
    P, C, src = prof.bandwidths_for(lay, "cuda", num_threads=15, calibrate=True)
    assert (P, C) == (41.0, 33.0) and "calibration" in src and "2048x768-bf16-q4_0" in src
    assert [s.quant for s in calibrated] == ["q4_0"]
