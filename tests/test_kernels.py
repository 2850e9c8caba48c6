"""CPU expert kernels (freetoken.kernels) against a torch fp32 reference, on every ISA path this
CPU supports, with banks laid out here per docs/INTERFACES.md section 3."""
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from freetoken import kernels
from freetoken.errors import ConfigError

ISAS = kernels.available_isas()
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ACT_REF = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}


def _round_up(n, m):
    return (n + m - 1) // m * m


def make_bank(E, D, I, dtype, seed=0):
    """A bank of E experts with random weights -> (bank uint8, layout, info, (gate, up, down) fp32)."""
    g = torch.Generator().manual_seed(seed)
    tdt = TORCH_DTYPES[dtype]
    gate = (torch.randn(E, I, D, generator=g) / D ** 0.5).to(tdt)
    up = (torch.randn(E, I, D, generator=g) / D ** 0.5).to(tdt)
    down = (torch.randn(E, D, I, generator=g) / I ** 0.5).to(tdt)
    nbytes = D * I * gate.element_size()
    og, ou = 0, _round_up(nbytes, 64)
    od = ou + _round_up(nbytes, 64)
    stride = _round_up(od + nbytes, 4096)
    bank = np.zeros(E * stride, np.uint8)
    for e in range(E):
        for off, w in ((og, gate[e]), (ou, up[e]), (od, down[e])):
            bank[e * stride + off:e * stride + off + nbytes] = w.contiguous().view(torch.uint8).numpy().ravel()
    projs = (SimpleNamespace(name="gate", shape=(I, D), offset=og, nbytes=nbytes),
             SimpleNamespace(name="up", shape=(I, D), offset=ou, nbytes=nbytes),
             SimpleNamespace(name="down", shape=(D, I), offset=od, nbytes=nbytes))
    info = SimpleNamespace(name="blk.0.ffn_exps", slot_stride=stride, dtype=dtype, projections=projs)
    return bank, kernels.layout_from_bank_info(info), info, (gate.float(), up.float(), down.float())


def reference(x, weights3, tok, exp, w, act="silu"):
    gate, up, down = weights3
    out = torch.zeros_like(x)
    for t, e, wt in zip(tok.tolist(), exp.tolist(), w.tolist()):
        h = ACT_REF[act](gate[e] @ x[t]) * (up[e] @ x[t])
        out[t] += wt * (down[e] @ h)
    return out


def assert_close(got, want, rtol, what):
    """Max error relative to the output's scale; on failure name the worst element."""
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    err = (got - want).abs()
    scale = want.abs().max().item() + 1e-6
    worst = int(err.argmax())
    t, d = divmod(worst, want.shape[1])
    assert err.max().item() <= rtol * scale, (
        f"{what}: worst element out[{t}, {d}] = {got.flatten()[worst].item():.6g}, reference "
        f"{want.flatten()[worst].item():.6g} (error {err.max().item():.3g}, scale {scale:.3g}, rtol {rtol})")


def rtol_for(isa, dtype):
    # avx512bf16 rounds x and the hidden activations to bf16 (cython/ffn_dot_impl.c).
    return 2e-2 if (isa == "avx512bf16" and dtype == "bf16") else 1e-4


def routes(T, K, E, rng):
    """Top-K distinct experts per token (as a router gives them), flattened to R = T*K routes."""
    exp = np.stack([rng.choice(E, size=K, replace=False) for _ in range(T)]).astype(np.int32)
    tok = np.repeat(np.arange(T, dtype=np.int32), K)
    w = rng.random(T * K, dtype=np.float32)
    return tok, exp.ravel(), w


@pytest.fixture(scope="module")
def pools():
    made = {}

    def get(threads, isa):
        if (threads, isa) not in made:
            made[threads, isa] = kernels.CpuExpertPool(threads, isa=isa)
        return made[threads, isa]
    return get


# (D, I, T, K, E): D and I not multiples of 8/16/32, tokens 1..64, top-k 1..8
CASES = [(100, 37, 1, 1, 3), (129, 67, 5, 8, 10), (72, 200, 64, 4, 6), (33, 17, 17, 8, 8), (250, 95, 3, 2, 2)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_torch_reference(pools, isa, dtype, threads):
    pool = pools(threads, isa)
    rng = np.random.default_rng(7)
    for i, (D, I, T, K, E) in enumerate(CASES):
        bank, layout, _, w3 = make_bank(E, D, I, dtype, seed=i)
        x = torch.randn(T, D, generator=torch.Generator().manual_seed(i))
        tok, exp, w = routes(T, K, E, rng)
        out = np.zeros((T, D), np.float32)
        pool.run(x.numpy(), bank, layout, tok, exp, w, out)
        assert_close(out, reference(x, w3, tok, exp, w), rtol_for(isa, dtype),
                     f"{isa} {dtype} threads={threads} D={D} I={I} T={T} K={K}")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_activations_and_duplicate_routes(pools, isa, act):
    """Several routes of the same (token, expert) and unsorted routes all accumulate."""
    bank, layout, _, w3 = make_bank(5, 70, 45, "bf16", seed=3)
    x = torch.randn(4, 70)
    tok = np.array([3, 0, 0, 3, 1, 0, 2, 2], np.int32)
    exp = np.array([4, 1, 1, 0, 4, 4, 2, 2], np.int32)
    w = np.linspace(0.1, 0.8, 8).astype(np.float32)
    out = np.zeros((4, 70), np.float32)
    pools(2, isa).run(x.numpy(), bank, layout, tok, exp, w, out, act=act)
    assert_close(out, reference(x, w3, tok, exp, w, act), rtol_for(isa, "bf16"), f"{isa} {act}")


@pytest.mark.parametrize("isa", ISAS)
def test_staged_and_direct_modes_agree_bit_for_bit(pools, isa, monkeypatch):
    """The staged down mode (decode-sized calls) and the direct mode (large calls) add the same
    terms in the same order, on any thread count: results are identical, and match torch."""
    bank, layout, _, w3 = make_bank(12, 150, 70, "bf16", seed=4)
    x = torch.randn(9, 150)
    tok, exp, w = routes(9, 6, 12, np.random.default_rng(5))
    outs = {}
    for mode, cap in (("staged", kernels.STAGE_MAX_BYTES), ("direct", 0)):
        monkeypatch.setattr(kernels, "STAGE_MAX_BYTES", cap)
        for threads in (1, 2):
            out = np.zeros((9, 150), np.float32)
            outs[mode, threads] = pools(threads, isa).run(x.numpy(), bank, layout, tok, exp, w, out)
    first = outs["staged", 1]
    assert_close(first, reference(x, w3, tok, exp, w), rtol_for(isa, "bf16"), f"{isa} staged")
    for key, out in outs.items():
        assert np.array_equal(out, first), f"{isa} {key} differs from staged on 1 thread"


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


# Tunings that change the blocking, prefetching, work-item size and who runs items.
TUNINGS = ("rows=2,down_rows=2", "rows=4,down_rows=4,prefetch=1024", "rows=4,prefetch=512,prefetch_hint=t1,item_kb=4",
           "help=0,item_kb=8,down_rows=4", "help=1,prefetch=0", "rows=1,down_rows=1,item_kb=192,prefetch=2048",
           "item_kb=4,spread=2")


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


@pytest.mark.parametrize("isa", ISAS)
def test_many_inputs_per_expert_and_long_rows(isa):
    """Experts with 1, 5 and over 16 inputs (the avx2 bf16 kernel's input groups, odd ones
    included) and rows long enough to be cut in several K-chunks, with a tail: every path
    matches torch, and every tuning gives the same bits."""
    D, I, T = 1203, 45, 37
    bank, layout, _, w3 = make_bank(4, D, I, "bf16", seed=11)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(2))
    # expert 0: every token; 1: all but 5; 2: 5 tokens; 3: one token
    exp = [0] * T + [1] * (T - 5) + [2] * 5 + [3]
    tok = list(range(T)) + list(range(5, T)) + list(range(5)) + [7]
    tok, exp = np.array(tok, np.int32), np.array(exp, np.int32)
    w = np.random.default_rng(1).random(len(tok), dtype=np.float32)
    pool = kernels.CpuExpertPool(2, isa=isa)
    want = pool.run(x.numpy(), bank, layout, tok, exp, w, np.zeros((T, D), np.float32))
    assert_close(want, reference(x, w3, tok, exp, w), rtol_for(isa, "bf16"), f"{isa} many inputs")
    for text in TUNINGS[:3] + TUNINGS[5:6]:  # rows 2 and 4, 1 row pair, items of 4 KiB
        pool.tuning = kernels.KernelTuning.parse(text)
        got = pool.run(x.numpy(), bank, layout, tok, exp, w, np.zeros((T, D), np.float32))
        assert np.array_equal(got, want), f"{isa} {text}"


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
    r = default.resolved("generic")
    assert (r.item_kb, r.rows, r.down_rows, r.prefetch, r.help) == (192, 1, 1, 2048, -1)
    # a large pool prefetches further on the paths other than the avx2/avx512 bf16 kernel
    assert default.resolved("generic", num_threads=15).prefetch == 4096
    assert default.resolved("avx2", num_threads=15).prefetch == default.resolved("avx2").prefetch == 4096
    r = kernels.KernelTuning(rows=2, prefetch=0).resolved("avx2")
    assert (r.item_kb, r.rows, r.down_rows, r.prefetch) == (1024, 2, 4, 0)
    # auto fields go as 0: the native side takes the defaults of the path it runs (avx512bf16
    # falls back to avx512 per call); explicit ones as given, the t1 hint in the low bits
    assert default.native_args(1, "avx512bf16", "bf16")[:4] == (0, 0, 0, 0)
    assert kernels.KernelTuning(item_kb=64, rows=2, prefetch=2048).native_args(1, "avx2", "bf16")[:4] == \
        (64, 2, 0, 2048 | 1)
    assert kernels.KernelTuning(prefetch_hint="t0").native_args(1, "avx2", "bf16")[3] == 4096  # t0: 0 bits
    assert kernels.KernelTuning(prefetch=0).native_args(1, "avx2", "bf16")[3] == -1  # off
    assert kernels.KernelTuning.parse("spread=24").native_args(1, "generic", "bf16")[5] == 24
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


def test_bf16_path_is_close_when_x_is_bf16(pools):
    if "avx512bf16" not in ISAS:
        pytest.skip("CPU lacks AVX-512-BF16")
    bank, layout, _, w3 = make_bank(8, 256, 96, "bf16", seed=5)
    x = torch.randn(2, 256).bfloat16().float()  # what a bf16 compute dtype hands over
    tok, exp, w = routes(2, 8, 8, np.random.default_rng(0))
    out = pools(2, "avx512bf16").run(x.numpy(), bank, layout, tok, exp, w, np.zeros((2, 256), np.float32))
    assert_close(out, reference(x, w3, tok, exp, w), 1e-2, "avx512bf16 with bf16 x")


def test_auto_path_takes_bf16_dot_only_for_bf16_exact_x(monkeypatch):
    monkeypatch.delenv("FREETOKEN_ISA", raising=False)
    pool = kernels.CpuExpertPool(1)
    bank, layout, _, w3 = make_bank(4, 64, 32, "bf16")
    tok, exp, w = routes(2, 2, 4, np.random.default_rng(0))
    for x in (torch.randn(2, 64), torch.randn(2, 64).bfloat16().float()):
        out = pool.run(x.numpy(), bank, layout, tok, exp, w, np.zeros((2, 64), np.float32))
        is_bf16 = bool((x.bfloat16().float() == x).all())
        want = "avx512bf16" if (pool.isa == "avx512bf16" and is_bf16) else \
            ("avx512" if pool.isa == "avx512bf16" else pool.isa)
        assert pool.last_isa == want
        assert_close(out, reference(x, w3, tok, exp, w), 1e-2 if want == "avx512bf16" else 1e-4, want)


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


def test_empty_routes_and_bad_arguments():
    pool = kernels.CpuExpertPool(1)
    bank, layout, _, _ = make_bank(3, 40, 24, "bf16")
    x = np.ones((2, 40), np.float32)
    out = np.zeros((2, 40), np.float32)
    none = np.zeros(0, np.int32)
    assert pool.run(x, bank, layout, none, none, np.zeros(0, np.float32), out) is out
    assert not out.any()
    ok = (np.array([0], np.int32), np.array([2], np.int32), np.array([1.0], np.float32))
    bad = {
        "expert id": (x, np.array([0], np.int32), np.array([3], np.int32), ok[2], out),
        "token id": (x, np.array([2], np.int32), ok[1], ok[2], out),
        "float64 x": (x.astype(np.float64), *ok, out),
        "strided x": (np.ones((2, 80), np.float32)[:, ::2], *ok, out),
        "int64 ids": (x, ok[0].astype(np.int64), *ok[1:], out),
        "out shape": (x, *ok, np.zeros((3, 40), np.float32)),
    }
    for what, (xx, t, e, w, o) in bad.items():
        with pytest.raises(kernels.KernelArgumentError):
            pool.run(xx, bank, layout, t, e, w, o)
    with pytest.raises(kernels.KernelArgumentError):
        pool.run(x, bank, layout, *ok, out, act="relu")
    handle = pool.submit(x, bank, layout, *ok, out)
    with pytest.raises(kernels.KernelArgumentError, match="not waited"):
        pool.submit(x, bank, layout, *ok, out)
    handle.wait()


def test_layout_from_bank_info_checks_shapes():
    _, layout, info, _ = make_bank(2, 40, 24, "fp16")
    assert (layout.D, layout.I, layout.dtype, layout.offset_gate) == (40, 24, "fp16", 0)
    assert layout.offset_down == info.projections[2].offset
    wrong = SimpleNamespace(slot_stride=info.slot_stride, dtype="fp16", projections=(
        info.projections[0], info.projections[1],
        SimpleNamespace(name="down", shape=(24, 40), offset=info.projections[2].offset, nbytes=1920)))
    with pytest.raises(kernels.KernelArgumentError, match="shapes disagree"):
        kernels.layout_from_bank_info(wrong)
    with pytest.raises(kernels.KernelArgumentError, match="slot_stride"):
        kernels.ExpertLayout(4096, "bf16", 64, 64, 0, 8192, 16384)


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
