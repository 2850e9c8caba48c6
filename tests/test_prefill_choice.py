"""Per-layer prefill choice (freetoken/experts/prefill/choice.py) between streaming a whole expert
layer and the slot path: the model's crossover on chosen numbers, the forward-level shortcut
from T alone, a skipped layer's buffer (sunk or withdrawn copy, copy on demand later), and the
runtime with some layers streamed and some planned equal to the reference over several
forwards, on the cpu tier."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from freetoken.config import EngineConfig, Tuning
from freetoken.errors import ConfigError
from freetoken.experts.prefill.choice import PrefillChoice
from freetoken.experts.reference import DenseReferenceExperts
from freetoken.experts.runtime import ExpertRuntime
from freetoken.experts.split import MissBandwidths, MissSplit
from test_expert_runtime import make_banks, make_config
from test_stream_pipeline import LAYERS as STREAM_LAYERS, fake_banks, make_streamer


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """The kernel executor sets torch to one thread (its thread rule); restore it after."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# ---- the model on chosen numbers ------------------------------------------------------------------
# Qwen3-30B-A3B bf16: E 128, s = 3 x 2048 x 768 x 2 bytes; B_P = P = 50, C = 90 (alone 120) GB/s;
# F = 600 GFLOP/s. Per slot: fill 188.74 µs, CPU 104.86 µs; a route 9437184 flops = 15.73 µs;
# the whole layer's copy 24159 µs.

S = 3 * 2048 * 768 * 2
QWEN = SimpleNamespace(num_experts=128, slot_stride=S, projections=(
    SimpleNamespace(shape=(768, 2048)), SimpleNamespace(shape=(768, 2048)), SimpleNamespace(shape=(2048, 768))))


def qwen_choice(mode="auto", with_flops=True, capacity=None):
    split = MissSplit("hybrid", MissBandwidths(50.0, 90.0, 50.0, 120.0))
    return PrefillChoice(mode, split, 50.0, 600.0, top_k=8, min_tokens=16, with_flops=with_flops)


def counts_of(u, n, E=128):
    c = np.zeros(E, dtype=np.int64)
    c[:u] = n
    return c


NONE = np.zeros(128, dtype=bool)


def test_crossover_in_routes_per_expert_matches_the_hand_computed_one():
    """Every expert routed n times, none cached: q = round(128 * 50/140) = 46 filled (gpu 8682
    µs), 82 on the CPU: 82 x 104.86 + 82 n x 15.73 µs against the copy's 24159 µs: the slot
    path up to n = 12, streaming from n = 13."""
    pc = qwen_choice()
    assert pc.copy_us(QWEN) == pytest.approx(24159.2, abs=0.1)
    assert pc.route_us(QWEN) == pytest.approx(15.729, abs=1e-3)
    got = {n: pc.choose(0, QWEN, counts_of(128, n), NONE, 1536, None, "auto") for n in range(1, 40)}
    assert [n for n, c in got.items() if c.streamed] == list(range(13, 40))
    c12, c13 = got[12], got[13]
    assert (c12.misses, c12.filled, c12.cpu_routes) == (128, 46, 82 * 12)
    assert c12.slot_us < c12.stream_us == c12.copy_us < c13.slot_us


def test_expert_biases_add_no_route_flops():
    """A bank with expert biases (gpt_oss: 1-D projections beside the matrices) costs the
    matrices' flops per route (a 1-D shape once broke the count on cuda)."""
    biased = SimpleNamespace(**{**vars(QWEN), "projections": QWEN.projections + (
        SimpleNamespace(shape=(768,)), SimpleNamespace(shape=(768,)), SimpleNamespace(shape=(2048,)))})
    assert qwen_choice().route_us(biased) == qwen_choice().route_us(QWEN)


def test_few_distinct_experts_take_the_slot_path_and_more_tokens_stream():
    """A short chunk (few distinct experts, few routes each) is cheaper through the slot path;
    the same experts with many routes each are not (the CPU's arithmetic grows)."""
    pc = qwen_choice()
    assert not pc.choose(0, QWEN, counts_of(40, 2), NONE, 1536, None, "auto").streamed
    assert pc.choose(0, QWEN, counts_of(40, 200), NONE, 1536, None, "auto").streamed
    # the distinct count decides at a fixed route count per expert
    flips = [u for u in range(1, 129) if pc.choose(0, QWEN, counts_of(u, 20), NONE, 1536, None, "auto").streamed]
    assert flips and flips == list(range(flips[0], 129)) and 1 < flips[0] < 128


def test_hits_and_an_overlapped_copy_move_the_choice():
    pc = qwen_choice()
    counts = counts_of(128, 10)  # slot path with no hits: ~21300 µs < 24159: slot
    assert not pc.choose(0, QWEN, counts, NONE, 1536, None, "auto").streamed
    # a copy already done costs nothing: stream (and leave the cache alone)
    done = pc.choose(0, QWEN, counts, NONE, 1536, 0.0, "auto")
    assert done.streamed and done.stream_us == 0.0
    # a copy half done: its rest (12000 µs) against the slot path sharing the link with it
    half = pc.choose(0, QWEN, counts, NONE, 1536, 12000.0, "auto")
    assert half.streamed and half.slot_us > 12000.0
    # every routed expert cached: the slot path is free
    all_hit = pc.choose(0, QWEN, counts_of(40, 50), counts_of(40, 1).astype(bool), 1536, None, "auto")
    assert not all_hit.streamed and all_hit.misses == 0 and all_hit.slot_us == 0.0


def test_the_cpu_arithmetic_term_and_forced_modes():
    """Without the F term (the cpu device) the bandwidths alone favour the slot path: P + C >
    B_P, so m <= E misses always cross faster than the whole layer."""
    bw_only = qwen_choice(with_flops=False)
    assert not any(bw_only.choose(0, QWEN, counts_of(128, n), NONE, 1536, None, "auto").streamed
                   for n in (1, 100, 10000))
    pc = qwen_choice()
    assert pc.choose(0, QWEN, counts_of(3, 1), NONE, 1536, None, "stream").streamed
    assert not pc.choose(0, QWEN, counts_of(128, 999), NONE, 1536, 0.0, "slot").streamed


def test_capacity_clamps_the_fills_as_the_plan_does():
    pc = qwen_choice()
    c = pc.choose(0, QWEN, counts_of(128, 1), NONE, 10, None, "auto")
    assert c.filled == 10 and c.cpu_routes == 118


def test_forward_mode_from_T_alone():
    """Below the threshold nothing streams; a short forward whose worst chunk (u = min(E, TK)
    all missing, routes spread evenly) still takes the slot path issues no copy; from the
    crossover on each layer decides."""
    pc = qwen_choice()
    infos = {0: QWEN, 1: QWEN}
    modes = {T: pc.forward_mode(T, infos, 1536) for T in (1, 15, 16, 64, 128, 256, 1024, 8192)}
    assert modes[1] == modes[15] == "slot"  # below prefill_stream_min_tokens
    assert modes[16] == modes[64] == "slot"  # 64: 512 routes, cpu 8598 + 5160 µs < 24159
    assert modes[256] == modes[1024] == modes[8192] == "auto"
    mixed = [pc.forward_mode(T, infos, 1536) for T in range(16, 400)]
    first = mixed.index("auto")
    assert set(mixed[:first]) == {"slot"} and set(mixed[first:]) == {"auto"}
    assert qwen_choice("stream").forward_mode(64, infos, 1536) == "stream"
    assert qwen_choice("stream").forward_mode(15, infos, 1536) == "slot"
    assert qwen_choice("slot").forward_mode(8192, infos, 1536) == "slot"


@pytest.mark.parametrize("kw, match", [({"mode": "fast"}, "prefill_choice must be one of"),
                                       ({"stream_gbps": 0}, "prefill_stream_gbps must be a number"),
                                       ({"cpu_gflops": "1"}, "prefill_cpu_gflops must be a number")])
def test_bad_settings_are_config_errors(kw, match):
    split = MissSplit("hybrid", MissBandwidths(1.0, 1.0, 1.0, 1.0))
    args = {**dict(mode="auto", split=split, stream_gbps=1.0, cpu_gflops=1.0, top_k=8, min_tokens=1), **kw}
    with pytest.raises(ConfigError, match=match):
        PrefillChoice(**args)


# ---- the streamer: a skipped layer ----------------------------------------------------------------

def test_skip_withdraws_a_copy_not_started_and_later_layers_copy_on_demand():
    banks = fake_banks(STREAM_LAYERS, seed=4)
    st = make_streamer(banks, 2)
    try:
        first, second, third = STREAM_LAYERS[:3]
        gate = st.pool.submit(lambda: None)  # warm the worker, then hold it
        gate.result()
        import threading
        hold = threading.Event()
        st.pool.submit(hold.wait)
        st.begin()  # copies of layers 0 and 1 queued behind the held worker
        assert st.copy_left_us(first) >= 1.0 and st.copy_left_us(third) is None
        assert st.skip(first) is False and st.holder[0] is None  # withdrawn: nothing moved
        hold.set()
        buf = st.acquire(second)
        assert np.array_equal(buf.numpy(), banks[second].data) and st.copy_left_us(second) == 0.0
        st.release(second)  # issues the fourth layer into buffer 1
        # the third layer's copy was never issued (its buffer's last layer was skipped): on demand
        assert st.holder[0] is None
        assert np.array_equal(st.acquire(third).numpy(), banks[third].data)
        st.release(third)
        # a copy that has landed cannot be withdrawn: skipping it sinks it
        fourth = STREAM_LAYERS[3]
        st.ready[1].result()
        assert st.skip(fourth) is True and st.holder[1] == fourth
        for layer in STREAM_LAYERS[4:]:
            assert np.array_equal(st.acquire(layer).numpy(), banks[layer].data)
            st.release(layer)
        assert st.in_use is None
    finally:
        st.close()


def test_release_without_ahead_leaves_the_next_copy_to_demand():
    """release(l, ahead=False): the layer N places on is not copied ahead (the runtime expects
    it to take the slot path); if it streams after all, acquire copies it then."""
    banks = fake_banks(STREAM_LAYERS, seed=5)
    st = make_streamer(banks, 2)
    try:
        st.begin()
        first, second, third, fourth = STREAM_LAYERS[:4]
        st.acquire(first)
        st.release(first, ahead=False)
        assert st.holder[0] == first and st.copy_left_us(third) is None  # third not issued
        st.acquire(second)
        st.release(second)  # the default: fourth is issued into buffer 1
        assert st.holder[1] == fourth
        assert np.array_equal(st.acquire(third).numpy(), banks[third].data)  # on demand
        st.release(third)
        for layer in STREAM_LAYERS[3:]:
            assert np.array_equal(st.acquire(layer).numpy(), banks[layer].data)
            st.release(layer)
    finally:
        st.close()


# ---- the runtime: mixed layers against the reference -----------------------------------------------

LAYERS, E, D, I, K = [0, 1, 3, 4, 6], 8, 16, 12, 2
CONFIG = make_config(LAYERS, E, D, I, K)


@pytest.fixture(scope="module")
def banks():
    return make_banks(LAYERS, E, D, I, "fp32", seed=7)[0]


def mixed_runtime(banks, n, cpu_experts="torch", capacity=10, rates=None, **tuning):
    """auto choice on the cpu tier: P = C = 1 GB/s (the cpu defaults), B_P = 2.9 GB/s so that
    the whole layer (8 slots) costs 2.76 slots' time: with no overlap a layer streams from 5
    misses (q = 3 filled, 2 on the CPU: 3 slots' time) and takes the slot path below."""
    tuning = {"prefill_choice": "auto", "prefill_stream_min_tokens": 1, "prefill_buffers": n,
              "prefill_stream_gbps": 2.9, "cpu_experts": cpu_experts,
              "tier_torch": cpu_experts != "kernels", **tuning}
    rt = ExpertRuntime(banks, CONFIG, EngineConfig(policy="hybrid", tuning=Tuning(**tuning)), "cpu",
                       torch.float32, capacity=capacity, rates=rates)
    if cpu_experts == "kernels":
        torch.set_num_threads(1)
    return rt


def routes(gen, T, u):
    """expert_ids [T, K] drawn from u (>= K) random experts, weights [T, K]."""
    assert u >= K
    pool = torch.randperm(E, generator=gen)[:u]
    ids = torch.stack([pool[torch.randperm(u, generator=gen)[:K]] for _ in range(T)])
    w = torch.rand(T, K, generator=gen)
    return ids, w / w.sum(-1, keepdim=True)


def run_forwards(rt, ref, steps, seed=0, tol=1e-5):
    """steps: [(phase, T, [u per layer])]; forward every MoE layer of both runtimes, check the
    outputs, the cache and the streamer after each step; returns the per-forward logs."""
    gen = torch.Generator().manual_seed(seed)
    logs = []
    for phase, T, us in steps:
        rt.begin_step(phase, T)
        for layer, u in zip(LAYERS, us):
            x = torch.randn(T, D, generator=gen)
            ids, w = routes(gen, T, u)
            want = ref.forward(layer, x, ids, w)
            got = rt.forward(layer, x, ids, w)
            assert float((got - want).abs().max()) <= tol * max(1.0, float(want.abs().max()))
        rt.cache.check_integrity()
        if rt.streamer is not None:
            assert rt.streamer.in_use is None
        log = rt.prefill_choice.log
        logs.append(list(log) if phase == "prefill" and log is not None else None)
    return logs


@pytest.mark.parametrize("n", [1, 2, 3])
def test_mixed_layers_equal_the_reference_and_the_model_decides(banks, n):
    """No overlap is credited (copy_left_us -> None: the choice is the model's alone, not the
    copy thread's timing): layers routed to few experts take the slot path, the others stream,
    within one forward, over several forwards with decode steps between."""
    rt = mixed_runtime(banks, n)
    rt.streamer.copy_left_us = lambda layer: None
    rt.prefill_choice.log = []
    ref = DenseReferenceExperts(banks, CONFIG, "cpu", torch.float32)
    mix = [2, 8, 3, 8, 2]
    steps = [("prefill", 12, mix), ("decode", 1, [8] * 5), ("prefill", 12, mix[::-1]),
             ("prefill", 30, [8] * 5), ("decode", 1, [8] * 5), ("prefill", 9, mix)]
    try:
        logs = run_forwards(rt, ref, steps)
    finally:
        rt.close()
    prefill = [log for log in logs if log is not None]
    assert [len(log) for log in prefill] == [len(LAYERS)] * 4
    for log in prefill:
        for c in log:
            assert c.streamed == (c.stream_us <= c.slot_us) and c.stream_us == c.copy_us
            assert c.streamed == (c.misses >= 5)  # the docstring's crossover
    first = prefill[0]
    assert [c.streamed for c in first] == [False, True, False, True, False]
    s = rt.stats
    num_streamed = sum(c.streamed for log in prefill for c in log)
    assert s["prefill_layers_streamed"] == num_streamed > 0
    assert s["prefill_layers_slot"] == 4 * len(LAYERS) - num_streamed > 0
    assert s["bytes_streamed"] == num_streamed * E * banks[0].info.slot_stride
    # only planned layers see the cache: hits + misses = their distinct experts (+ decode's)
    planned = sum(c.distinct for log in prefill for c in log if not c.streamed)
    assert s["hits"] + s["misses"] == planned + 2 * len(LAYERS) * K
    assert s["device_routes"] + s["cpu_routes"] == s["routes"]


@pytest.mark.parametrize("cpu_experts", ["torch", "kernels"])
@pytest.mark.parametrize("n", [1, 2])
def test_mixed_layers_with_real_copy_timing_stay_consistent(banks, n, cpu_experts):
    """The copy thread's real progress (done copies stream for free, withdrawn and sunk copies,
    copies on demand): whatever each layer picks, every forward equals the reference."""
    if cpu_experts == "kernels":
        import freetoken.kernels  # noqa: F401
    rt = mixed_runtime(banks, n, cpu_experts)
    rt.prefill_choice.log = []
    ref = DenseReferenceExperts(banks, CONFIG, "cpu", torch.float32)
    steps = [("prefill", T, us) for T, us in [(12, [2, 8, 3, 8, 2]), (20, [8, 2, 8, 3, 8]),
                                              (5, [2] * 5), (16, [8] * 5)]] * 2
    try:
        logs = run_forwards(rt, ref, steps, tol=1e-5 if cpu_experts == "torch" else 1e-4)
    finally:
        rt.close()
    for log in logs:  # a copy done streams for nothing; else the model decides
        for c in log:
            assert c.streamed == (c.stream_us <= c.slot_us) and 0.0 <= c.stream_us <= c.copy_us
    s = rt.stats
    assert s["prefill_layers_streamed"] == sum(c.streamed for log in logs for c in log)
    assert s["prefill_layers_streamed"] + s["prefill_layers_slot"] == len(steps) * len(LAYERS)
    assert s["prefill_copies_sunk"] <= s["prefill_layers_slot"]


def test_forced_slot_and_stream_and_the_threshold(banks):
    ref = DenseReferenceExperts(banks, CONFIG, "cpu", torch.float32)
    mix = [2, 8, 3, 8, 2]
    slot = mixed_runtime(banks, 2, prefill_choice="slot")
    stream = mixed_runtime(banks, 2, prefill_choice="stream")
    small = mixed_runtime(banks, 2, prefill_choice="stream", prefill_stream_min_tokens=13)
    try:
        for rt in (slot, stream, small):
            run_forwards(rt, ref, [("prefill", 12, mix)] * 2)
    finally:
        for rt in (slot, stream, small):
            rt.close()
    assert slot.stats["prefill_layers_streamed"] == 0 and slot.stats["prefill_layers_slot"] == 10
    assert slot.stats["misses"] > 0 and slot.streamer.holder == [None, None]  # never begun
    assert stream.stats["prefill_layers_streamed"] == 10 and stream.stats["prefill_layers_slot"] == 0
    assert stream.stats["hits"] + stream.stats["misses"] == 0  # streaming never touches the cache
    assert small.stats["prefill_layers_streamed"] == 0 and small.stats["prefill_layers_slot"] == 10


def test_cpu_device_default_streams_and_bad_choice_is_a_config_error(banks):
    rt = ExpertRuntime(banks, CONFIG, EngineConfig(tuning=Tuning(cpu_experts="torch")), "cpu",
                       torch.float32, capacity=10)
    assert rt.prefill_choice.mode == "stream" and not rt.prefill_choice.with_flops
    rt.close()
    with pytest.raises(ConfigError, match="prefill_choice must be one of"):
        mixed_runtime(banks, 2, prefill_choice="sometimes")


def test_runtime_takes_f_from_the_stored_profile(banks, tmp_path, monkeypatch):
    """Without prefill_cpu_gflops the runtime's F is the stored profile's (freetoken profile:
    expert_rates, which the engine reads and hands down), else the per-thread guess; an
    explicit tuning value wins over both."""
    import json

    from freetoken import profile as prof
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    rt = mixed_runtime(banks, 2)
    guess = rt.prefill_choice.cpu_gflops
    rt.close()
    d = prof.profile_dir()
    d.mkdir(parents=True)
    shape_key = "any"
    body = {"gpu": None, "cpu": prof.cpu_model(), "threads": 1, "shape_key": shape_key,
            "slot_bytes": banks[LAYERS[0]].info.slot_stride, "C": 1.0, "cpu_gflops": 321.0}
    (d / f"{prof.profile_key(None, prof.cpu_model(), 1, shape_key)}.json").write_text(json.dumps(body))
    rates = prof.expert_rates(banks, EngineConfig(cpu_threads=1), "cpu")
    assert rates.cpu_gflops == 321.0 and not rates.measured  # (no PCIe split on the cpu device)
    rt = mixed_runtime(banks, 2, rates=rates)
    assert rt.prefill_choice.cpu_gflops == 321.0 != guess
    rt.close()
    rt = mixed_runtime(banks, 2, rates=rates, prefill_cpu_gflops=55.0)
    assert rt.prefill_choice.cpu_gflops == 55.0
    rt.close()
