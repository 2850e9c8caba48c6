"""The CPU expert pool's mechanics (freetoken.kernels): tunings change speed, not results; the
per-item trace; thread counts and the large-pool defaults; submit/wait beside torch; reuse from
other threads; pinning; the STREAM-like read; the ISA choice. The kernels' numerics against torch
are tests/test_kernels.py's, whose banks and reference this file shares."""
import threading

import numpy as np
import pytest
import torch

from freetoken import kernels
from freetoken.errors import ConfigError
from test_kernels import (TUNINGS, ISAS, assert_close, make_bank, pools,  # noqa: F401 (pools: a fixture)
                          reference, routes, rtol_for)


@pytest.mark.parametrize("stage", ["staged", "direct"])
def test_trace_records_every_item_once_in_time_order(pools, stage, monkeypatch):
    """A traced job records each work item once, claimed before its wait ended and ended after;
    all inside submit .. done; tracing changes no result; off again, nothing is recorded."""
    monkeypatch.setattr(kernels, "STAGE_MAX_BYTES", kernels.STAGE_MAX_BYTES if stage == "staged" else 0)
    bank, layout, _, _ = make_bank(10, 150, 70, "bf16", seed=6)
    x = np.random.default_rng(7).standard_normal((3, 150)).astype(np.float32)
    tok, exp, w = routes(3, 4, 10, np.random.default_rng(8))
    pool = pools(2, kernels.CpuExpertPool(1).isa)
    pool.tuning = kernels.KernelTuning.parse("item_kb=4")  # several items per expert
    try:
        plain = pool.run(x, bank, layout, tok, exp, w, np.zeros_like(x)).copy()
        pool.set_trace(4096)
        traced = pool.run(x, bank, layout, tok, exp, w, np.zeros_like(x))
        t = pool.last_trace()
        pool.set_trace(0)
        pool.run(x, bank, layout, tok, exp, w, np.zeros_like(x))
    finally:
        pool.tuning = kernels.tuning_from_env()
    assert np.array_equal(traced, plain)
    r = t["records"]
    assert t["experts"] == len(set(exp.tolist())) and t["staged"] == (stage == "staged")
    assert t["items"] > t["g_items"] >= t["experts"] and sorted(r["item"].tolist()) == list(range(t["items"]))
    assert (r["claim_ns"] <= r["ready_ns"]).all() and (r["ready_ns"] <= r["end_ns"]).all()
    assert t["submit_ns"] <= r["claim_ns"].min() and r["end_ns"].max() <= t["done_ns"]
    assert set(r["tid"].tolist()) <= set(range(pool.num_threads + 1))
    assert pool.last_trace()["records"] is None


@pytest.mark.parametrize("isa", ISAS)
def test_tunings_change_speed_not_results(isa):
    """Rows per pass, prefetch, item size and the helping waiter leave each (row, input) sum's
    arithmetic alone: outputs are bit-identical to the default tuning's on 1 and 2 threads.
    Shapes leave tails everywhere: D, I not multiples of 32 or of the rows per pass, experts
    with more inputs than one pass takes, staged and direct down modes."""
    bank, layout, _, w3 = make_bank(6, 130, 75, "bf16", seed=8)
    x = torch.randn(11, 130)
    tok, exp, w = routes(11, 5, 6, np.random.default_rng(3))
    for threads in (1, 2):
        pool = kernels.CpuExpertPool(threads, isa=isa)
        want = pool.run(x.numpy(), bank, layout, tok, exp, w, np.zeros((11, 130), np.float32))
        assert_close(want, reference(x, w3, tok, exp, w), rtol_for(isa, "bf16"), f"{isa} default")
        for text in TUNINGS:
            pool.tuning = kernels.KernelTuning.parse(text)
            for cap in (kernels.STAGE_MAX_BYTES, 0):
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(kernels, "STAGE_MAX_BYTES", cap)
                    got = pool.run(x.numpy(), bank, layout, tok, exp, w, np.zeros((11, 130), np.float32))
                assert np.array_equal(got, want), f"{isa} threads={threads} {text} stage_max={cap}"


def test_kernel_tuning_parse_and_environment(monkeypatch):
    t = kernels.KernelTuning.parse(" rows=4, prefetch=1024,prefetch_hint=t1")
    assert (t.rows, t.prefetch, t.prefetch_hint, t.item_kb) == (4, 1024, "t1", kernels.KernelTuning().item_kb)
    assert kernels.KernelTuning.parse(str(t)) == t
    assert kernels.KernelTuning.parse("default") == kernels.KernelTuning()
    assert kernels.KernelTuning.parse("help=0", base=t) == kernels.KernelTuning(**{**vars(t), "help": 0})
    auto = kernels.KernelTuning.parse("help=auto")
    assert auto.help == -1 and kernels.KernelTuning.parse(str(auto)) == auto
    ncpu = len(__import__("os").sched_getaffinity(0))
    assert auto.helps(ncpu - 1) and not auto.helps(ncpu)  # only beside a free CPU
    assert kernels.KernelTuning(help=1).helps(ncpu) and not kernels.KernelTuning(help=0).helps(1)
    default = kernels.KernelTuning()
    assert "rows=auto" in str(default) and kernels.KernelTuning.parse(str(default)) == default
    assert kernels.KernelTuning.parse("rows=auto,prefetch=auto", base=t) == kernels.KernelTuning(
        **{**vars(t), "rows": -1, "prefetch": -1})
    pd = kernels.path_defaults
    r = default.resolved(pd("generic"))
    assert (r.item_kb, r.rows, r.down_rows, r.prefetch, r.help) == (192, 1, 1, 2048, -1)
    # a large pool prefetches further on the paths other than the avx2/avx512 bf16 kernel
    assert default.resolved(pd("generic", num_threads=15)).prefetch == 4096
    assert default.resolved(pd("avx2", num_threads=15)).prefetch == default.resolved(pd("avx2")).prefetch == 4096
    # the 4-bit types take rows in fours on the avx2 path only; q8_0 keeps the general defaults
    for isa, dtype, want in (("avx2", "q4_0", (1024, 4, 4)), ("avx2", "mxfp4", (1024, 4, 4)),
                             ("avx2", "q8_0", (192, 1, 1)), ("avx2", "nvfp4", (192, 1, 1)),
                             ("avx512", "q4_0", (192, 1, 1)), ("generic", "mxfp4", (192, 1, 1))):
        r = default.resolved(pd(isa, dtype))
        assert (r.item_kb, r.rows, r.down_rows) == want, (isa, dtype)
    r = kernels.KernelTuning(rows=2, prefetch=0).resolved(pd("avx2"))
    assert (r.item_kb, r.rows, r.down_rows, r.prefetch) == (1024, 2, 4, 0)
    # auto fields go as 0: the native side takes the defaults of the path it runs (avx512bf16
    # falls back to avx512 per call); explicit ones as given, the t1 hint in the low bits
    assert default.native_args(1, pd("avx512bf16"))[:4] == (0, 0, 0, 0)
    assert kernels.KernelTuning(item_kb=64, rows=2, prefetch=2048).native_args(1, pd("avx2"))[:4] == \
        (64, 2, 0, 2048 | 1)
    assert kernels.KernelTuning(prefetch_hint="t0").native_args(1, pd("avx2"))[3] == 4096  # t0: 0 bits
    assert kernels.KernelTuning(prefetch=0).native_args(1, pd("avx2"))[3] == -1  # off
    assert kernels.KernelTuning.parse("spread=24").native_args(1, pd("generic"))[5] == 24
    for bad in ("rows=3", "prefetch=100", "speed=11", "rows", "item_kb=x", "prefetch_hint=t2", "item_kb=0",
                "rows=0", "prefetch=-2", "spread=-1"):
        with pytest.raises(ConfigError, match="kernel tuning"):
            kernels.KernelTuning.parse(bad)
    monkeypatch.setenv(kernels.TUNE_ENV, "down_rows=2,item_kb=64")
    pool = kernels.CpuExpertPool(1)
    assert (pool.tuning.down_rows, pool.tuning.item_kb) == (2, 64)
    monkeypatch.setenv(kernels.TUNE_ENV, "rows=5")
    with pytest.raises(ConfigError, match="rows=5"):
        kernels.CpuExpertPool(1)


def test_kernels_split_out_modules_import_one_way():
    """kernels.py imports its split-out modules, never the reverse, not even lazily inside a
    function: the ISA paths' defaults reach KernelTuning as an argument (path_defaults)."""
    import ast
    from pathlib import Path
    pkg = Path(kernels.__file__).parent
    for name in ("kernel_tuning", "kernel_args", "cpu_topology", "serve_stats"):
        tree = ast.parse((pkg / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names] if node.level else [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not any(n.split(".")[-1] in ("kernels", "_expert_ffn") for n in names), \
                f"freetoken/{name}.py line {node.lineno} imports {names}"


def test_gpu_run_tuning_reads_the_environment_now(monkeypatch):
    """use_gpu_run_tuning (each executor on a GPU host) takes FREETOKEN_KERNEL_TUNE as it is at
    that call, over the shared pool's older tuning, then its own help and item_kb unless named."""
    from freetoken.experts.executor import GPU_ITEM_KB, use_gpu_run_tuning
    monkeypatch.delenv(kernels.TUNE_ENV, raising=False)
    pool = kernels.CpuExpertPool(1)
    monkeypatch.setenv(kernels.TUNE_ENV, "prefetch=8192")
    use_gpu_run_tuning(pool)
    assert (pool.tuning.prefetch, pool.tuning.help, pool.tuning.item_kb) == (8192, 0, GPU_ITEM_KB)
    monkeypatch.setenv(kernels.TUNE_ENV, "item_kb=64")
    use_gpu_run_tuning(pool)
    assert (pool.tuning.prefetch, pool.tuning.item_kb) == (-1, 64)


def test_submit_returns_before_wait_and_torch_runs_meanwhile():
    pool = kernels.CpuExpertPool(2)
    bank, layout, _, w3 = make_bank(16, 512, 384, "bf16", seed=1)
    x = torch.randn(16, 512)
    tok, exp, w = routes(16, 8, 16, np.random.default_rng(1))
    out = torch.zeros(16, 512)
    handle = pool.submit(x, bank, layout, tok, exp, w, out)
    a = torch.randn(256, 256)
    side = (a @ a).sum().item()  # the "GPU branch": other torch work while the pool runs
    assert np.isfinite(side)
    got = handle.wait()
    assert got is out and handle.done()
    assert handle.wait() is out
    assert_close(out, reference(x, w3, tok, exp, w), rtol_for(pool.isa, "bf16"), "submit/wait")


def test_pool_reuse_many_calls_and_threads():
    """One pool, many calls of changing shape, dtype and size; plus calls from another thread."""
    pool = kernels.CpuExpertPool(2)
    rng = np.random.default_rng(11)
    banks = {dt: make_bank(6, 96, 40, dt, seed=9) for dt in ("bf16", "fp32")}
    for i in range(150):
        dt = "bf16" if i % 3 else "fp32"
        bank, layout, _, w3 = banks[dt]
        T, K = int(rng.integers(1, 9)), int(rng.integers(1, 7))
        x = torch.randn(T, 96)
        tok, exp, w = routes(T, K, 6, rng)
        out = pool.run(x.numpy(), bank, layout, tok, exp, w, np.zeros((T, 96), np.float32))
        assert_close(out, reference(x, w3, tok, exp, w), rtol_for(pool.isa, dt), f"call {i}")
    results = []
    bank, layout, _, w3 = banks["bf16"]
    x = torch.randn(3, 96)
    tok, exp, w = routes(3, 4, 6, rng)
    th = threading.Thread(target=lambda: results.append(
        pool.run(x.numpy(), bank, layout, tok, exp, w, np.zeros((3, 96), np.float32))))
    th.start()
    th.join()
    assert_close(results[0], reference(x, w3, tok, exp, w), rtol_for(pool.isa, "bf16"), "other thread")


def test_two_threads_share_the_pool_one_job_at_a_time():
    """Two threads submit jobs to one pool at once (the scheduler's decode thread beside a
    prefill forward): each job holds the pool from submit to wait, the other's submit waits for
    it, and every result is right. The same thread submitting twice without a wait still raises;
    abandon() lets go of a job its thread never waited for."""
    pool = kernels.CpuExpertPool(2)
    bank, layout, _, w3 = make_bank(6, 96, 40, "bf16", seed=4)
    rng = np.random.default_rng(5)
    jobs = [(torch.randn(4, 96), *routes(4, 3, 6, rng)) for _ in range(2)]
    errors, outs = [], {0: [], 1: []}

    def worker(j):
        x, tok, exp, w = jobs[j]
        try:
            for _ in range(40):
                handle = pool.submit(x.numpy(), bank, layout, tok, exp, w, np.zeros((4, 96), np.float32))
                torch.randn(64, 64).sum()  # (other work while holding the pool)
                outs[j].append(handle.wait())
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(j,), daemon=True) for j in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "the two threads' jobs hung"
    assert not errors, errors
    for j, (x, tok, exp, w) in enumerate(jobs):
        want = reference(x, w3, tok, exp, w)
        for out in outs[j]:
            assert_close(out, want, rtol_for(pool.isa, "bf16"), f"thread {j}")
    x, tok, exp, w = jobs[0]
    pool.submit(x.numpy(), bank, layout, tok, exp, w, np.zeros((4, 96), np.float32))
    with pytest.raises(kernels.KernelArgumentError, match="not waited for"):
        pool.submit(x.numpy(), bank, layout, tok, exp, w, np.zeros((4, 96), np.float32))
    pool.abandon()
    got = []
    th = threading.Thread(target=lambda: got.append(
        pool.run(x.numpy(), bank, layout, tok, exp, w, np.zeros((4, 96), np.float32))), daemon=True)
    th.start()
    th.join(60)
    assert not th.is_alive() and got, "the abandoned job kept the pool"


@pytest.mark.parametrize("isa", ISAS)
def test_large_pool_defaults_give_the_same_results(pools, isa):
    """A pool of 8 threads takes the large-pool defaults (a longer prefetch on the non-avx2-bf16
    paths): the same bits as one thread, for every dtype."""
    for dt in ("bf16", "fp16", "fp32"):
        bank, layout, _, w3 = make_bank(10, 300, 130, dt, seed=12)
        x = torch.randn(5, 300)
        tok, exp, w = routes(5, 6, 10, np.random.default_rng(13))
        one = pools(1, isa).run(x.numpy(), bank, layout, tok, exp, w, np.zeros((5, 300), np.float32)).copy()
        many = pools(8, isa).run(x.numpy(), bank, layout, tok, exp, w, np.zeros((5, 300), np.float32))
        assert np.array_equal(one, many), f"{isa} {dt}: 8 threads differ from 1"
        assert_close(many, reference(x, w3, tok, exp, w), rtol_for(isa, dt), f"{isa} {dt} 8 threads")


def test_pool_threads_pinned_inside_allowed_set():
    allowed = set(__import__("os").sched_getaffinity(0))
    cores = kernels.physical_cores()
    assert cores and set(cores) <= allowed
    pool = kernels.CpuExpertPool(len(allowed))
    assert sorted(c for c in pool.pinned_cpus if c >= 0) == sorted(allowed)
    assert kernels.default_num_threads(has_gpu=False) == len(cores)
    assert kernels.default_num_threads(has_gpu=True) == max(1, len(cores) - 1)


@pytest.mark.parametrize("isa", ISAS)
def test_read_sum_reads_every_byte(isa):
    pool = kernels.CpuExpertPool(2)
    buf = np.random.default_rng(0).integers(0, 256, 3 * 4096 + 4000, dtype=np.uint8)
    want = int(buf[: buf.size // 8 * 8].view(np.uint64).sum(dtype=np.uint64))
    assert pool.read_sum(buf, isa=isa) == want
    for helps in (0, 1):  # the workers alone, and with the calling thread reading too
        pool.tuning = kernels.KernelTuning(help=helps)
        assert pool.read_sum(buf, isa=isa) == want


def test_isa_choice_from_environment(monkeypatch):
    monkeypatch.setenv("FREETOKEN_ISA", "avx9000")
    with pytest.raises(ConfigError, match="FREETOKEN_ISA"):
        kernels.CpuExpertPool(1)
    monkeypatch.setenv("FREETOKEN_ISA", "generic")
    assert kernels.CpuExpertPool(1).isa == "generic"
