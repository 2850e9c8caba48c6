"""`freetoken profile` and the profile store (freetoken.profile), on small working sets."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from freetoken import kernels
from freetoken import bandwidth as bw
from freetoken import profile as prof
from freetoken.cli import main

FAST = dict(seconds=0.05, min_working_set=16 << 20)


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(bw, "llc_bytes", lambda: 1 << 20)  # keep working sets small
    return tmp_path / "cache"


def test_run_profile_stores_and_loads(cache_home):
    shape = prof.ExpertShape(256, 96, 4, "bf16", 16, "small")
    r = json.loads(prof.run_profile(cpu_threads=1, as_json=True, shape=shape, **FAST))
    assert r["B_H"] > 0 and r["stream_read"] > 0 and r["threads"] == 1 and r["cpu_gflops"] > 0
    assert "F    CPU experts, 32 tokens each" in prof.format_profile(r)
    assert r["working_set_bytes"] >= 16 << 20
    if r["gpu"] is None:
        assert r["B_P"] is None and r["P"] is None and r["policy"].startswith("cpu-only")
    else:
        assert r["B_P"] > 0 and 0 < r["q_frac"] < 1
        from freetoken.experts.transfer import zero_copy
        if zero_copy.available():
            assert r["B_Z"] > 0 and r["P_zc"] > 0 and r["C_zc"] > 0 and 0 < r["q_frac_zc"] < 1
    assert r["path"].startswith(str(cache_home / "freetoken" / "profiles"))
    stored = prof.load_profile(r["gpu"], prof.cpu_model(), 1, "256x96-bf16")
    assert stored["B_H"] == r["B_H"]
    assert prof.load_profile(r["gpu"], prof.cpu_model(), 1, "999x96-bf16") is None


def _store(gpu, threads, shape_key, P, C, slot_bytes=9437184, **more):
    d = prof.profile_dir()
    d.mkdir(parents=True, exist_ok=True)
    body = {"gpu": gpu, "cpu": prof.cpu_model(), "threads": threads, "shape_key": shape_key,
            "P": P, "C": C, "created": "2026-01-01T00:00:00", "slot_bytes": slot_bytes, **more}
    (d / f"{prof.profile_key(gpu, prof.cpu_model(), threads, shape_key)}.json").write_text(json.dumps(body))


def test_get_bandwidths_defaults_profile_and_cpu_only(monkeypatch):
    monkeypatch.setattr(prof, "gpu_name", lambda device=None: "Test GPU 80GB")
    shape = prof.ExpertShape()
    P, C, src = prof.bandwidths_for(shape, "cuda", num_threads=3)
    assert (P, C) == (prof.DEFAULT_P, prof.DEFAULT_C) and src.startswith("defaults")
    _store("Test GPU 80GB", 7, shape.key(), 20.0, 60.0)  # another thread count: still used
    P, C, src = prof.bandwidths_for((2048, 768, "bf16"), "cuda", num_threads=3)
    assert (P, C) == (20.0, 60.0) and "profile" in src and "7 threads" in src
    _store("Test GPU 80GB", 3, shape.key(), 30.0, 45.0)  # the exact key wins
    assert prof.bandwidths_for(shape, "cuda", num_threads=3)[:2] == (30.0, 45.0)
    assert prof.bandwidths_for(prof.ExpertShape(4096, 768), "cuda", num_threads=3)[2].startswith("defaults")
    P, C, src = prof.bandwidths_for(shape, "cpu", num_threads=3)
    assert P == 0.0 and src.startswith("no GPU")


def test_get_bandwidths_for_the_policy(monkeypatch):
    """The INTERFACES section 6 form: (device_type, slot_bytes) -> None | {'P', 'C', 'source'}."""
    monkeypatch.setattr(prof, "gpu_name", lambda device=None: "Test GPU 80GB")
    assert prof.get_bandwidths("cuda", 9437184) is None
    _store("Test GPU 80GB", 15, "2048x768-bf16", 40.0, 80.0)
    got = prof.get_bandwidths("cuda", 9437184)
    assert (got["P"], got["C"]) == (40.0, 80.0) and "15 threads" in got["source"]
    assert prof.get_bandwidths("cuda", 4096) is None
    # a slot of the same expert shape with biases (gpt_oss) is larger: the shape still matches
    assert prof.get_bandwidths("cuda", 9437184 + 8192, shape=prof.ExpertShape())["P"] == 40.0
    assert prof.get_bandwidths("cuda", 9437184 + 8192, shape=prof.ExpertShape(2048, 512)) is None
    assert prof.get_bandwidths("cpu", 9437184) is None
    monkeypatch.setattr(prof, "gpu_name", lambda device=None: "Other GPU")
    assert prof.get_bandwidths("cuda", 9437184) is None


def test_prefill_rates_from_the_stored_profile(monkeypatch):
    """prefill_rates: the whole-layer copies (cuda only) and F for experts/prefill/choice.py;
    the runtime takes them as its defaults."""
    monkeypatch.setattr(prof, "gpu_name", lambda device=None: "Test GPU 80GB")
    assert prof.prefill_rates("cuda", 9437184) == {}
    _store("Test GPU 80GB", 15, "2048x768-bf16", 40.0, 80.0, B_P=54.0, cpu_gflops=400.0)
    assert prof.prefill_rates("cuda", 9437184) == {"B_P": 54.0, "F": 400.0}
    assert prof.prefill_rates("cuda", 4096) == {}
    _store(None, 2, "2048x768-bf16", None, 30.0, cpu_gflops=90.0)
    assert prof.prefill_rates("cpu", 9437184) == {"F": 90.0}  # no copies without a GPU


def test_zero_copy_fills_take_their_own_pair(monkeypatch):
    """A profile with the zero-copy gather's pair gives it for fills="zero_copy"; the copy pair
    otherwise, and for profiles measured before zero-copy fills existed."""
    monkeypatch.setattr(prof, "gpu_name", lambda device=None: "Test GPU 80GB")
    _store("Test GPU 80GB", 15, "2048x768-bf16", 40.0, 80.0)
    got = prof.get_bandwidths("cuda", 9437184, fills="zero_copy")
    assert (got["P"], got["C"]) == (40.0, 80.0)  # no zero-copy pair stored: the copy pair
    _store("Test GPU 80GB", 15, "2048x768-bf16", 40.0, 80.0, P_zc=35.0, C_zc=90.0)
    got = prof.get_bandwidths("cuda", 9437184, fills="zero_copy")
    assert (got["P"], got["C"]) == (35.0, 90.0) and "zero-copy" in got["source"]
    assert prof.get_bandwidths("cuda", 9437184)["P"] == 40.0
    P, C, src = prof.bandwidths_for(prof.ExpertShape(), "cuda", num_threads=15, fills="zero_copy")
    assert (P, C) == (35.0, 90.0) and "zero-copy" in src
    assert prof.bandwidths_for(prof.ExpertShape(), "cuda", num_threads=15)[:2] == (40.0, 80.0)


def test_bandwidths_for_reads_layouts_and_shapes():
    lay = bw.synthetic_layout(prof.ExpertShape(128, 64))
    assert prof._shape_fields(lay) == (128, 64, "bf16", "none")
    assert prof._shape_fields((128, 64, "fp16")) == (128, 64, "fp16", "none")


def test_format_profile_with_gpu_shows_split():
    r = {"cpu": "CPU", "gpu": "GPU", "threads": 15, "isa": "avx512bf16",
         "shape": {"name": "Qwen3-30B-A3B", "hidden": 2048, "expert_hidden": 768, "dtype": "bf16", "top_k": 8},
         "slot_bytes": 9437184, "layer_bytes": 128 * 9437184, "working_set_bytes": 1 << 30,
         "llc_bytes": 1 << 25, "B_P_slot": 40.0, "B_P": 48.0, "P": 45.0, "B_H": 88.0, "C": 80.0,
         "stream_read": 90.0, "q_frac": 45 / 125, "paper_q_frac": 48 / 88}
    text = prof.format_profile(r)
    assert "q*/m = P/(P+C) = 0.360" in text and "B_P/B_H = 0.545" in text
    assert "absent" not in text


def test_route_sets_walk_the_bank_at_batch_1():
    calls = bw.route_sets(24, 1, 8, 3)
    seen = np.concatenate([e for _, e, _, _ in calls])
    assert sorted(seen.tolist()) == list(range(24))
    tok, exp, w, unique = bw.route_sets(24, 4, 8, 1)[0]
    assert tok.shape == exp.shape == w.shape == (32,) and unique == len(set(exp.tolist()))


def test_cli_profile_json(monkeypatch):
    monkeypatch.setattr(bw, "MIN_WORKING_SET", 16 << 20)
    monkeypatch.setattr(bw, "MEASURE_SECONDS", 0.05)
    res = CliRunner().invoke(main, ["profile", "--cpu-threads", "1", "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.output)
    assert r["threads"] == 1 and r["shape_key"] == "2048x768-bf16" and r["B_H"] > 0


def test_cli_profile_model(tmp_path, monkeypatch):
    ftw_writer = pytest.importorskip("ftw.writer")
    monkeypatch.setattr(bw, "MIN_WORKING_SET", 16 << 20)
    monkeypatch.setattr(bw, "MEASURE_SECONDS", 0.05)
    rng = np.random.default_rng(0)
    experts = [{k: (rng.standard_normal(s) * 0.02).astype(np.float32)
                for k, s in (("gate", (48, 160)), ("up", (48, 160)), ("down", (160, 48)))} for _ in range(4)]
    path = tmp_path / "m.ftw"
    ftw_writer.write(str(path), {"model.config": {"family": "qwen3_moe", "num_experts_per_tok": 2}},
                     [], [ftw_writer.bank_from_arrays(0, "fp32", experts)])
    res = CliRunner().invoke(main, ["profile", "--model", str(path), "--cpu-threads", "1"])
    assert res.exit_code == 0, res.output
    assert "D=160 I=48 fp32 top-2" in res.output and "saved to" in res.output


def test_pool_respects_cpu_threads():
    assert kernels.get_pool(1).num_threads == 1
