"""The short calibration of profile.bandwidths_for: windowed concurrent pairs (warm-up window
discarded, median kept), the re-measure and flag of an inconsistent pair, the "calibrated"
marker and a full profile's precedence. Clocks and measurements are faked: nothing is timed."""
import json
import threading

import numpy as np
import pytest

from freetoken import bandwidth as bw
from freetoken import profile as prof
from freetoken.experts import executor
from freetoken.experts.transfer import zero_copy

GPU = "Test GPU 80GB"


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_timed_passes_discards_the_warm_up_call(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(bw, "_clock", clock)
    stop, calls = threading.Event(), []

    def fn():  # the first (warm-up) call takes 10 s, the rest 1 s; stop after 4 timed calls
        clock.now += 10.0 if not calls else 1.0
        calls.append(clock.now)
        if len(calls) == 5:
            stop.set()
    log = []
    assert bw._timed_passes(fn, 2e9, stop=stop, log=log) == 2.0  # counting the warm-up: 10e9 / 14 s
    assert log == [(10.0, 0), (11.0, 2e9), (12.0, 2e9), (13.0, 2e9), (14.0, 2e9)]


def test_concurrent_pair_drops_the_warm_up_window_and_keeps_the_median(monkeypatch):
    """Windows of 0.25 s: a 1 s warm-up call (1 GB/s), then 0.125 s calls of 1 GB (8 GB/s) but one
    0.5 s call (a noisy neighbour's window, 2 GB/s); copies at 1 GB/s during the warm-up, 4 after."""
    clock = FakeClock()
    monkeypatch.setattr(bw, "_clock", clock)
    durations = iter([1.0, 0.125, 0.125, 0.125, 0.125, 0.5] + [0.125] * 20)

    def host_work():
        clock.now += next(durations)
        return 1e9

    def fake_h2d(nbytes, seconds=None, stop=None, started=None, log=None, device="cuda"):
        started.set()
        stop.wait()  # the kernel's windows are done: write the copies' completions at once
        log.append((0.0, 0))
        log.extend((t / 8, 0.125e9 if t <= 8 else 0.5e9) for t in range(1, 100))
        return 1.0
    monkeypatch.setattr(bw, "time_h2d", fake_h2d)
    per_window = []
    P, C = bw.concurrent_bandwidths(None, None, None, 8, 1 << 20, 1.25, host_work=host_work,
                                    per_window=per_window)
    assert (P, C) == (4.0, 8.0)
    assert per_window == [(4.0, 8.0), (4.0, 8.0), (4.0, 2.0), (4.0, 8.0), (4.0, 8.0)]


def test_window_rates_interpolate_copies_longer_than_a_window():
    copies = [(0.0, 0), (1.0, 4e9), (2.0, 4e9)]  # the docstring's example
    assert bw.window_rates([(0.5, 1.5, 3e9)], copies) == (4.0, 3.0)


def test_consistency_problem():
    assert prof.consistency_problem(40.0, 80.0, 100.0) is None
    assert prof.consistency_problem(60.0, 40.0, 100.0) is None  # the copies took the bandwidth
    assert "C beside the copies 32.0 GB/s" in prof.consistency_problem(38.0, 32.0, 117.0)
    assert prof.consistency_problem(10.0, 20.0, None) is None


def fake_measurements(monkeypatch, pairs, gpu=GPU):
    """Fixed alone rates (B_H 100 GB/s) and concurrent pairs popped from `pairs` per fills kind;
    returns the list of (fills, seconds) of the concurrent calls."""
    monkeypatch.setattr(prof, "gpu_name", lambda device=None: gpu)
    monkeypatch.setattr(executor, "use_gpu_run_tuning", lambda pool: None)
    monkeypatch.setattr(zero_copy, "available", lambda: True)
    monkeypatch.setattr(bw, "synthetic_bank",
                        lambda layout, n, seed=0: np.zeros(4 * layout.slot_stride, np.uint8))
    monkeypatch.setattr(bw, "time_stream_read", lambda *a, **k: 120.0)
    monkeypatch.setattr(bw, "time_kernel", lambda *a, **k: 100.0)
    monkeypatch.setattr(bw, "time_route_flops", lambda *a, **k: 200.0)
    monkeypatch.setattr(bw, "time_h2d", lambda *a, **k: 50.0)
    monkeypatch.setattr(bw, "time_gather", lambda *a, **k: 45.0)
    calls = []

    def concurrent(pool, bank, layout, top_k, copy_bytes, seconds, host_work=None, fills="copy",
                   windows=bw.CONCURRENT_WINDOWS, per_window=None):
        calls.append((fills, seconds))
        pair = pairs[fills].pop(0)
        per_window.extend([pair] * windows)
        return pair
    monkeypatch.setattr(bw, "concurrent_bandwidths", concurrent)
    return calls


def stored(cache_home):
    return sorted(p.name for p in (cache_home / "freetoken" / "profiles").glob("*.json"))


def test_calibration_remeasures_an_inconsistent_pair_and_is_marked(monkeypatch, cache_home):
    calls = fake_measurements(monkeypatch, {"copy": [(40.0, 20.0), (40.0, 80.0)],
                                            "zero_copy": [(35.0, 75.0)]})
    P, C, src = prof.bandwidths_for(prof.ExpertShape(), "cuda", num_threads=1, calibrate=True)
    assert (P, C) == (40.0, 80.0) and src.startswith("calibration") and "INCONSISTENT" not in src
    assert calls == [("copy", 1.0), ("copy", 1.0), ("zero_copy", 1.0)]
    key = prof.profile_key(GPU, prof.cpu_model(), 1, "2048x768-bf16")
    assert stored(cache_home) == [f"{key}.calibration.json"]
    r = prof.load_profile(GPU, prof.cpu_model(), 1, "2048x768-bf16")
    assert r["calibrated"] is True and r["measure_seconds"] == 0.3 and r["concurrent_seconds"] == 1.0
    assert r["remeasured"] == ["beside the copies"] and "inconsistent" not in r
    assert r["windows"] == [[40.0, 80.0]] * bw.CONCURRENT_WINDOWS and r["q_frac_zc"] == 35 / 110
    assert r["wall_seconds"] >= 0
    # stored and found again: no second calibration
    again = prof.bandwidths_for(prof.ExpertShape(), "cuda", num_threads=1, calibrate=True)
    assert again[:2] == (40.0, 80.0)
    assert len(calls) == 3


def test_calibration_still_inconsistent_says_so_and_is_not_stored(monkeypatch, cache_home):
    calls = fake_measurements(monkeypatch, {"copy": [(40.0, 20.0), (38.0, 22.0)],
                                            "zero_copy": [(35.0, 75.0)]})
    P, C, src = prof.bandwidths_for(prof.ExpertShape(), "cuda", num_threads=1, calibrate=True)
    assert (P, C) == (38.0, 22.0)  # the re-measured pair, used for this run only
    assert "INCONSISTENT twice: C beside the copies 22.0 GB/s" in src and "not stored" in src
    assert len(calls) == 3 and not (cache_home / "freetoken" / "profiles").exists()


def test_full_profile_flags_but_stores_an_inconsistent_pair(monkeypatch, cache_home):
    fake_measurements(monkeypatch, {"copy": [(40.0, 80.0)], "zero_copy": [(35.0, 20.0), (30.0, 25.0)]})
    text = prof.run_profile(cpu_threads=1)
    assert "C beside the gather re-measured once" in text
    assert "INCONSISTENT after the re-measure: C beside the gather 25.0 GB/s" in text
    r = prof.load_profile(GPU, prof.cpu_model(), 1, "2048x768-bf16")
    assert r["calibrated"] is False and r["C_zc"] == 25.0 and "gather" in r["inconsistent"]
    got = prof.get_bandwidths("cuda", r["slot_bytes"], fills="zero_copy")
    assert "INCONSISTENT" in got["source"] and "not stored" not in got["source"]


def test_a_later_full_profile_takes_precedence(monkeypatch, cache_home):
    fake_measurements(monkeypatch, {"copy": [(40.0, 80.0), (45.0, 90.0)],
                                    "zero_copy": [(35.0, 75.0), (36.0, 76.0)]})
    shape = prof.ExpertShape()
    assert prof.bandwidths_for(shape, "cuda", num_threads=1, calibrate=True)[2].startswith("calibration")
    prof.run_profile(cpu_threads=1, shape=shape)
    assert len(stored(cache_home)) == 2  # both kept, the full one chosen
    P, C, src = prof.bandwidths_for(shape, "cuda", num_threads=1)
    assert (P, C) == (45.0, 90.0) and src.startswith("profile")
    assert prof.load_profile(GPU, prof.cpu_model(), 1, shape.key())["calibrated"] is False


def _store(name, threads, P, calibrated=None):
    d = prof.profile_dir()
    d.mkdir(parents=True, exist_ok=True)
    body = {"gpu": GPU, "cpu": prof.cpu_model(), "threads": threads, "shape_key": "2048x768-bf16",
            "P": P, "C": 80.0, "created": "2026-01-01T00:00:00", "slot_bytes": 9437184}
    if calibrated is not None:
        body["calibrated"] = calibrated
    (d / name).write_text(json.dumps(body))


def test_find_profile_prefers_full_profiles_deterministically(monkeypatch):
    monkeypatch.setattr(prof, "gpu_name", lambda device=None: GPU)
    find = lambda threads: prof._find_profile(GPU, lambda p: True, threads)["P"]
    _store("a.json", 4, 10.0)                        # full, stored before the marker existed
    _store("z.json", 8, 20.0, calibrated=True)       # sorts last, more threads: still loses
    assert find(15) == 10.0
    assert find(8) == 20.0                           # the exact thread count comes first
    _store("b.json", 8, 30.0, calibrated=False)
    assert find(8) == 30.0 and find(15) == 30.0
    _store("c.json", 8, 40.0, calibrated=False)      # two full ones alike: the last file name
    assert find(8) == 40.0


def test_cpu_only_calibration_is_marked(monkeypatch, cache_home):
    fake_measurements(monkeypatch, {}, gpu=None)
    P, C, src = prof.bandwidths_for((256, 96, "bf16"), "cpu", num_threads=1, calibrate=True)
    assert (P, C) == (0.0, 100.0) and src.startswith("no GPU: CPU-only; C from calibration")
    (name,) = stored(cache_home)
    r = json.loads((cache_home / "freetoken" / "profiles" / name).read_text())
    assert name.endswith(".calibration.json") and r["calibrated"] is True
    assert r["measure_seconds"] == 0.3 and "concurrent_seconds" not in r
