"""The native server of a GPU-controlled decode step (cython/serve.h, kernels.CpuExpertPool.serve):
a thread stands in for the GPU, filling each layer's mailbox and raising its ready flag; the
server must run exactly the listed routes, write the partial and raise done, layer by layer, and
leave a layer with no CPU routes alone (no done, the partial untouched: the GPU neither waits
nor reads then)."""
import threading
from types import SimpleNamespace
import time

import numpy as np
import pytest
import torch

from freetoken import kernels
from freetoken.config import Tuning
from freetoken.experts.captured.device_plan import Mailbox
from freetoken.experts.captured.control import DeviceControl

from test_kernels import make_bank


def _until(cond, what):
    """The fake GPU's wait for the server (the test's own pacing): yield until cond() holds; a
    server that never gets there fails the test after a minute instead of hanging it."""
    end = time.monotonic() + 60
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"the server never {what}")
        time.sleep(0)  # a yield to the server's threads, no delay


def _fake_gpu(boxes, steps, rng, log, late=lambda n: False, stale_reads=None):
    """For each step and layer: fill the mailbox, number it, raise ready; with CPU routes wait
    for done, record the partial, clear done (what the graph does); without, go on once the
    server took ready (every third layer step has none). late(n): the n-th layer step raises
    ready first and writes the mailbox and its number only once the server has seen the ready
    with the old number (stale_reads(), the table's count, has moved on): ready reaching the
    host before the plan's stores."""
    n = stale = 0
    for step in range(steps):
        for i, (box, E) in enumerate(boxes):
            ids = rng.choice(E, size=box.K, replace=False)
            cpu = rng.random(box.K) < 0.6 if n % 3 else np.zeros(box.K, bool)
            early = late(n)
            if early:
                box.flags[0] = 1
                stale += 1
                _until(lambda: stale_reads() == stale, "counted a ready that came before its stores")
            n += 1
            box.ids.copy_(torch.from_numpy(np.where(cpu, ids, -1)))
            box.w.copy_(torch.from_numpy(rng.random(box.K).astype(np.float32)))
            box.x.copy_(torch.randn(box.D))
            box.partial.fill_(float("nan"))  # the server must overwrite it (when it runs)
            box.seq += 1  # the plan's number of the mailbox, its last store
            if not early:
                box.flags[0] = 1
            if not cpu.any():
                _until(lambda: int(box.flags[0]) == 0, "took ready")
                log.append((i, box.ids.clone(), box.w.clone(), box.x.clone(), box))
                continue
            _until(lambda: int(box.flags[1]) == 1, "raised done")
            log.append((i, box.ids.clone(), box.w.clone(), box.x.clone(), box.partial.clone()))
            box.flags[1] = 0


def _check_partials(pool, layers, log):
    """Each logged layer step with CPU routes has the partial of exactly its listed routes."""
    for i, ids, w, x, partial in log:
        bank, lay = layers[i][:2]
        on = ids >= 0
        if not on.any():
            assert int(partial.flags[1]) == 0  # no done raised ...
            continue  # (... and the partial, left alone, may already be the next layer step's)
        want = torch.zeros(1, x.shape[0])  # the kernel itself, on the same routes (checked
        tok = np.zeros(int(on.sum()), np.int32)  # against torch elsewhere)
        pool.run(x[None].contiguous().numpy(), bank, lay, tok, ids[on].numpy().astype(np.int32),
                 w[on].numpy(), want.numpy())
        assert torch.isfinite(partial).all()
        torch.testing.assert_close(partial, want[0], rtol=1e-5, atol=1e-6)


def test_serve_waits_for_a_mailbox_whose_stores_come_after_ready():
    """A ready seen while the mailbox's number has not moved on since the layer was last
    served came before the plan's stores: the server counts it and waits for the number, so it
    runs the routes the plan wrote, not the last step's; the count goes with
    stats(reset=True)."""
    pool = kernels.CpuExpertPool(2, spin_us=0)
    bank, lay, _, _ = make_bank(6, 40, 24, "bf16", 0)
    box = Mailbox(4, lay.D, "cpu")
    table = pool.serve_table([(bank, lay, "silu", box)])
    log = []
    gpu = threading.Thread(target=_fake_gpu, args=([(box, 6)], 6, np.random.default_rng(2), log,
                                                   lambda n: n in (2, 4), table.stale_reads))
    gpu.start()
    for _ in range(6):
        pool.serve(table, timeout_s=30)
    gpu.join()
    assert len(log) == 6 and table.stale_reads() == 2 and int(box.seq) == 6
    _check_partials(pool, [(bank, lay)], log)
    table.stats(reset=True)
    assert table.stale_reads() == 0


def _serve_one_layer(pool, E, K, steps, seed, trace=False, skip_jobs=False):
    """One layer of E experts (D 40, I 24) served for `steps` steps against _fake_gpu: its
    bank, layout, serve table (trace, skip_jobs: the table's diagnostics) and the fake GPU's
    log."""
    bank, lay, _, _ = make_bank(E, 40, 24, "bf16", 0)
    box = Mailbox(K, lay.D, "cpu")
    table = pool.serve_table([(bank, lay, "silu", box)], trace, skip_jobs)
    log = []
    gpu = threading.Thread(target=_fake_gpu,
                           args=([(box, E)], steps, np.random.default_rng(seed), log))
    gpu.start()
    for _ in range(steps):
        pool.serve(table, timeout_s=30)
    gpu.join()
    return bank, lay, table, log


@pytest.mark.parametrize("traced", [False, True])
def test_serve_runs_listed_routes_layer_by_layer(traced):
    pool = kernels.CpuExpertPool(2, spin_us=0)
    D, I, K = 40, 24, 4
    layers = []
    for seed, E in ((0, 8), (1, 6)):
        bank, lay, _, w3 = make_bank(E, D, I, "bf16", seed)
        layers.append((bank, lay, w3, Mailbox(K, D, "cpu"), E))
    table = pool.serve_table([(bank, lay, "silu", box) for bank, lay, _, box, _ in layers],
                             trace=traced)  # traced: the jobs' items traced, summed
    log = []
    gpu = threading.Thread(target=_fake_gpu, args=([(b, E) for *_, b, E in layers], 3,
                                                   np.random.default_rng(0), log))
    gpu.start()
    for _ in range(3):
        pool.serve(table, timeout_s=30)
    gpu.join()
    assert len(log) == 6
    assert sum(not bool((ids >= 0).any()) for _, ids, *_ in log) == 2
    times = kernels.job_summary([table.job_times()])  # the jobs' diagnostics, same counts
    assert times["jobs"] == 4 and times["prep_us"] > 0 and 0 < times["p50"] <= times["p99"]
    control = DeviceControl.__new__(DeviceControl)  # (its describe() over this table)
    control.tables = {(0, 1): table}
    control.admissions = None
    text = control.describe()
    assert "ready to done" in text and "(0.67 per layer step; p50/p90/p99" in text, text
    assert "; stale mailbox reads 0;" in text and table.stale_reads() == 0
    tr = kernels.trace_summary([table.trace_times()])
    assert ("traced jobs 4:" in text) == traced and bool(tr) == traced
    if tr:
        assert tr["jobs"] == 4 and 0 < tr["job"] and tr["g_gbs"] > 0 and tr["d_gbs"] > 0
        assert min(tr["wake"], tr["spread"], tr["signal"], tr["dwait"]) >= 0
        assert tr["wake"] <= tr["wake_max"] < tr["job"]
    stats = table.stats(reset=True)  # per layer: waits, job ns, jobs, times served
    assert [s[3] for s in stats] == [3, 3] and sum(s[2] for s in stats) == 4
    assert all(s[1] > 0 for s in stats if s[2]) and all(s[0] >= 0 for s in stats)
    assert table.stats() == [(0, 0, 0, 0)] * 2
    assert table.job_times()[0] == 0 and not any(table.job_times()[1])
    assert not kernels.trace_summary([table.trace_times()])
    _check_partials(pool, layers, log)
    assert all(int(box.flags[0]) == 0 for *_, box, _ in layers)  # the server cleared ready


def test_serve_skipping_jobs_zeroes_the_partials():
    """Tuning.serve_skip_jobs (benchmarks: a step without the CPU's compute): each layer with
    CPU routes gets a zero partial and its done, no job runs; layers without CPU routes are
    left alone as before; the captured step's description says so."""
    pool = kernels.CpuExpertPool(1, spin_us=0)
    with pytest.warns(RuntimeWarning, match="outputs are wrong"):  # (traced: nothing to trace)
        bank, lay, table, log = _serve_one_layer(pool, E=8, K=4, steps=4, seed=2, trace=True,
                                                 skip_jobs=True)
    assert table.skip_jobs
    box = table.refs[0][1]
    ran = [partial for _, ids, _, _, partial in log if (ids >= 0).any()]
    assert len(ran) == 2 and all(bool((p == 0).all()) for p in ran)  # (the GPU left NaN there)
    assert kernels.job_summary([table.job_times()])["jobs"] == 2
    assert not kernels.trace_summary([table.trace_times()])
    control = DeviceControl.__new__(DeviceControl)
    control.tables, control.admissions = {(0,): table}, None
    assert "CPU jobs SKIPPED" in control.describe()
    assert not pool.serve_table([(bank, lay, "silu", box)]).skip_jobs


@pytest.mark.parametrize("never", ["ready", "stores"])
def test_serve_times_out_and_releases_the_gpu(never):
    """Layer 1's ready never comes, or comes with a mailbox whose number never moves on: the
    server gives up after the timeout, says which, and raises the remaining done flags."""
    pool = kernels.CpuExpertPool(1, spin_us=0)
    bank, lay, _, _ = make_bank(4, 32, 16, "bf16")
    boxes = [Mailbox(2, 32, "cpu") for _ in range(3)]
    boxes[0].ids.copy_(torch.tensor([-1, -1]))
    boxes[0].flags[0] = 1  # layer 0 ready; layer 1 never, or without its stores
    boxes[0].seq += 1
    boxes[1].flags[0] = int(never == "stores")
    table = pool.serve_table([(bank, lay, "silu", b) for b in boxes])
    what = "did not hand over" if never == "ready" else "raised ready but never wrote the mailbox of"
    with pytest.raises(kernels.KernelError, match=f"{what} layer 1") as info:
        pool.serve(table, timeout_s=0.05)
    assert info.value.waited_for == 1 and info.value.host_routes == 0
    # layer 0 had no CPU routes (no done); the rest are raised: a waiting GPU ends
    assert [int(b.flags[1]) for b in boxes] == [0, 1, 1]


@pytest.mark.parametrize("where", ["table", "serve"])
def test_a_failed_step_releases_the_gpu_and_stops_the_control(where):
    """DeviceControl.serve: whatever fails on the host's side (here building the serve table,
    or the server raising, as Ctrl-C would), every done is raised, so a GPU waiting on one ends
    its step, and the control refuses the next step."""
    def fail(*_):
        raise KeyboardInterrupt

    ok = SimpleNamespace(serve_table=lambda layers, trace, skip_jobs: "table", serve=fail)
    control = DeviceControl.__new__(DeviceControl)
    control.rt = SimpleNamespace(executor=ok if where == "serve" else
                                 SimpleNamespace(serve_table=fail, serve=fail), tuning=Tuning())
    control.boxes = {layer: Mailbox(2, 8, "cpu") for layer in (3, 5, 7)}
    control.tables, control.broken = {}, None
    with pytest.raises(KeyboardInterrupt):
        control.serve((3, 5))
    assert [int(control.boxes[layer].flags[1]) for layer in (3, 5, 7)] == [1, 1, 0]
    with pytest.raises(RuntimeError, match="load the model again"):
        control._check_unbroken()


def test_serve_names_the_failing_layer_and_serves_the_rest():
    """A kernel error in one layer (here an expert id outside the bank) zeroes its partial and
    raises its done; the later layers are still served, and the error names the failing layer,
    not the last one served."""
    pool = kernels.CpuExpertPool(1, spin_us=0)
    D, I, K, E = 32, 16, 2, 4
    bank, lay, _, _ = make_bank(E, D, I, "bf16", 0)
    boxes = [Mailbox(K, D, "cpu") for _ in range(3)]
    table = pool.serve_table([(bank, lay, "silu", b) for b in boxes])
    x = torch.randn(D, generator=torch.Generator().manual_seed(0))
    for box, ids in zip(boxes, ([1, -1], [E, -1], [2, 3])):  # layer 1: expert E is not there
        box.ids.copy_(torch.tensor(ids))
        box.w.copy_(torch.tensor([0.5, 0.25]))
        box.x.copy_(x)
        box.partial.fill_(float("nan"))
        box.seq += 1  # (the plan's number, then ready)
        box.flags[0] = 1
    with pytest.raises(kernels.KernelError, match="layer 1 failed: an expert id"):
        pool.serve(table, timeout_s=30)
    assert [int(b.flags[1]) for b in boxes] == [1, 1, 1]
    assert bool((boxes[1].partial == 0).all())
    want = np.zeros((1, D), np.float32)
    pool.run(x[None].numpy(), bank, lay, np.zeros(2, np.int32), np.array([2, 3], np.int32),
             np.array([0.5, 0.25], np.float32), want)
    torch.testing.assert_close(boxes[2].partial, torch.from_numpy(want[0]), rtol=1e-5, atol=1e-6)


def test_serve_table_checks_the_mailbox():
    pool = kernels.get_pool(1, spin_us=0)
    bank, lay, _, _ = make_bank(4, 32, 16, "bf16")
    with pytest.raises(kernels.KernelArgumentError, match="mailbox"):
        pool.serve_table([(bank, lay, "silu", Mailbox(2, 48, "cpu"))])


def test_job_summary_reads_the_buckets():
    hist = [0] * 64
    hist[2], hist[3], hist[63] = 50, 49, 1  # 20-30 µs, 30-40 µs, >= 630 µs
    t = kernels.job_summary([(3000, hist, 10), (1000, [0] * 64, 10)])
    assert (t["jobs"], t["prep_us"], t["p50"], t["p90"], t["p99"]) == (100, 0.04, 30, 40, 40)
    assert (t["over"], t["over_us"]) == (1, 630)
    assert kernels.job_summary([])["jobs"] == 0


def test_traced_serve_gives_the_pool_its_own_trace_back():
    """A traced serve records into a buffer of its own and then puts back the job's trace
    setting: a pool tracing its jobs (set_trace) still records the next job it runs."""
    pool = kernels.CpuExpertPool(1, spin_us=0)
    pool.set_trace(256)
    bank, lay, table, _ = _serve_one_layer(pool, E=6, K=2, steps=2, seed=1, trace=True)
    assert kernels.trace_summary([table.trace_times()])["jobs"] >= 1
    x = np.zeros((1, lay.D), np.float32)
    pool.run(x, bank, lay, np.zeros(1, np.int32), np.array([3], np.int32),
             np.ones(1, np.float32), np.zeros((1, lay.D), np.float32))
    info, recs = pool._native.trace()
    assert recs is not None and len(recs) > 0 and info[1] >= info[0] > 0
    pool.set_trace(0)


def test_trace_summary_means_per_job():
    t = dict(jobs=2, job_ns=200_000, wake_ns=4_000, wake_max_ns=10_000, dwait_ns=6_000,
             spread_ns=20_000, signal_ns=2_000, g_busy_ns=1_000_000, d_busy_ns=500_000,
             g_bytes=7_000_000, d_bytes=3_000_000)
    s = kernels.trace_summary([t, dict(t, jobs=0, **{k: 0 for k in t if k != "jobs"})])
    assert s == {"jobs": 2, "job": 100.0, "wake": 2.0, "wake_max": 5.0, "dwait": 3.0,
                 "spread": 10.0, "signal": 1.0, "g_gbs": 7.0, "d_gbs": 6.0}
    assert kernels.trace_summary([]) == {} and kernels.trace_summary([dict(t, jobs=0)]) == {}


def test_serve_runs_a_batched_steps_routes_per_token():
    """A step of T tokens (the mailbox sized for 4, T = the plan's `tokens` word): the server
    runs the listed routes r = t*K + k as token r // K's, an expert several tokens route to
    once over them, and writes T partials (the rows past T left alone), each the kernel's own
    result for that token's CPU routes."""
    pool = kernels.CpuExpertPool(2, spin_us=0)
    K, E = 3, 6
    bank, lay, _, _ = make_bank(E, 40, 24, "bf16", 1)
    box = Mailbox(K, lay.D, "cpu", max_tokens=4)
    table = pool.serve_table([(bank, lay, "silu", box)])
    rng = np.random.default_rng(5)
    for step, T in enumerate((3, 1, 4, 2)):
        ids = np.stack([rng.choice(4, size=K, replace=False) for _ in range(T)])  # shared
        cpu = rng.random(T * K) < 0.7
        cpu[0] = True
        box.ids[:T * K] = torch.from_numpy(np.where(cpu, ids.reshape(-1), -1))
        box.ids[T * K:] = 2  # past the step's routes: not read
        box.w[:T * K] = torch.from_numpy(rng.random(T * K).astype(np.float32))
        x = torch.randn(T, lay.D)
        box.x[:T * lay.D] = x.reshape(-1)
        box.partial.fill_(float("nan"))
        box.tokens.fill_(T)
        box.seq += 1
        box.flags[0] = 1
        pool.serve(table, timeout_s=30)
        assert box.flags.tolist() == [0, 1], f"step {step}: ready taken, done raised"
        box.flags[1] = 0
        want = torch.zeros(T, lay.D)
        tok = (np.arange(T * K) // K).astype(np.int32)[cpu]
        pool.run(x.numpy(), bank, lay, tok, ids.reshape(-1)[cpu].astype(np.int32),
                 box.w[:T * K].numpy()[cpu], want.numpy())
        got = box.partial.view(4, lay.D)
        torch.testing.assert_close(got[:T], want, rtol=1e-5, atol=1e-6)
        assert torch.isnan(got[T:]).all()
    assert table.stats()[0][2:] == (4, 4)  # jobs, served
