"""ExpertRuntime equals DenseReferenceExperts for every cache size x policy x phase, on random
host banks laid out per docs/INTERFACES.md section 3 (built here; no ftw reader needed)."""
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from freetoken.config import ModelConfig
from freetoken.experts.bank import TORCH_DTYPES
from freetoken.experts.reference import DenseReferenceExperts

PAGE = 4096


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """These tensors are tiny: an OpenMP team per op only adds waiting (badly so on a busy
    2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _round_up(n, a):
    return (n + a - 1) // a * a


def make_banks(layers, num_experts, hidden, inter, dtype="fp32", seed=0):
    """{layer: HostBank-like} with random experts; returns (banks, dense) where
    dense[layer][e] = (gate [I, D], up [I, D], down [D, I]) as fp32 torch tensors."""
    tdtype = TORCH_DTYPES[dtype]
    esize = torch.empty((), dtype=tdtype).element_size()
    shapes = [("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))]
    projections, off = [], 0
    for name, shape in shapes:
        nbytes = shape[0] * shape[1] * esize
        projections.append(SimpleNamespace(name=name, shape=shape, offset=off, nbytes=nbytes))
        off = _round_up(off + nbytes, 64)
    stride = _round_up(off, PAGE)
    gen = torch.Generator().manual_seed(seed)
    banks, dense = {}, {}
    for layer in layers:
        data = np.zeros(num_experts * stride, dtype=np.uint8)
        dense[layer] = []
        for e in range(num_experts):
            ws = []
            for p in projections:
                w = (torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5).to(tdtype)
                start = e * stride + p.offset
                data[start:start + p.nbytes] = w.reshape(-1).view(torch.uint8).numpy()
                ws.append(w.float())
            dense[layer].append(tuple(ws))
        crcs = tuple(zlib.crc32(data[e * stride:(e + 1) * stride]) for e in range(num_experts))
        info = SimpleNamespace(layer=layer, name=f"blk.{layer}.ffn_exps", offset=0,
                               num_experts=num_experts, slot_stride=stride, dtype=dtype,
                               projections=tuple(projections), slot_crc32=crcs)
        banks[layer] = SimpleNamespace(info=info, data=data)
    return banks, dense


def make_config(layers, num_experts, hidden, inter, top_k):
    return ModelConfig(family="qwen3_moe", vocab_size=32, hidden_size=hidden,
                       num_layers=max(layers) + 1, num_heads=2, num_kv_heads=1, head_dim=hidden // 2,
                       rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=128,
                       num_experts=num_experts, num_experts_per_tok=top_k,
                       moe_intermediate_size=inter, moe_layers=tuple(layers))


def random_routes(gen, T, E, K):
    """expert_ids [T, K] (distinct per token) and weights [T, K] fp32."""
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=gen)
    return ids, w / w.sum(-1, keepdim=True)


def naive_moe(dense, layer, x, ids, w):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            g, u, d = (m.double() for m in dense[layer][int(ids[t, k])])
            xt = x[t].double()
            out[t] += w[t, k].double() * (d @ (torch.nn.functional.silu(g @ xt) * (u @ xt)))
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_reference_equals_naive_loop(dtype):
    layers, E, D, I, K = [1, 3], 8, 16, 12, 3
    banks, dense = make_banks(layers, E, D, I, dtype, seed=1)
    ref = DenseReferenceExperts(banks, make_config(layers, E, D, I, K), "cpu", torch.float32)
    gen = torch.Generator().manual_seed(2)
    for layer in layers:
        x = torch.randn(5, D, generator=gen)
        ids, w = random_routes(gen, 5, E, K)
        got = ref.forward(layer, x, ids, w)
        assert got.dtype == torch.float32 and got.shape == (5, D)
        torch.testing.assert_close(got.double(), naive_moe(dense, layer, x, ids, w),
                                   atol=1e-5, rtol=1e-5)
    assert ref.stats["routes"] == 2 * 5 * K


# ---- ExpertRuntime vs the reference ------------------------------------------------------

from freetoken.config import EngineConfig, Tuning  # noqa: E402
from freetoken.errors import ConfigError  # noqa: E402
from freetoken.experts import create_expert_runtime  # noqa: E402
from freetoken.experts.executor import TorchCpuExecutor, create_executor  # noqa: E402
from freetoken.experts.runtime import ExpertRuntime  # noqa: E402

LAYERS, E, D, I, K = [0, 1, 3], 8, 16, 12, 2  # layer 2 is dense: not a bank
TOTAL = len(LAYERS) * E
CONFIG = make_config(LAYERS, E, D, I, K)


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def banks(request):
    return make_banks(LAYERS, E, D, I, request.param, seed=3)[0]


def make_runtime(banks, capacity, policy, **tuning):
    tuning = Tuning(**{"cpu_experts": "torch", **tuning})
    return ExpertRuntime(banks, CONFIG, EngineConfig(policy=policy, tuning=tuning), "cpu",
                         torch.float32, capacity=capacity)


def run_steps(rt, ref, steps, seed=0):
    """Forward each (phase, T) step through every MoE layer of both runtimes; returns the
    worst |ours - reference| and the distinct experts of every planned layer step."""
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for phase, T in steps:
        rt.begin_step(phase, T)
        ref.begin_step(phase, T)
        for layer in LAYERS:
            x = torch.randn(T, D, generator=gen)
            ids, w = random_routes(gen, T, E, K)
            ours = rt.forward(layer, x, ids, w)
            assert ours.shape == x.shape and ours.dtype == x.dtype
            worst = max(worst, float((ours - ref.forward(layer, x, ids, w)).abs().max()))
            rt.cache.check_integrity()
    return worst


DECODE = [("prefill", 20)] + [("decode", 1)] * 30 + [("prefill", 3)] + [("decode", 1)] * 10


@pytest.mark.parametrize("capacity", [0, 3, TOTAL // 2, TOTAL])
@pytest.mark.parametrize("policy", ["hybrid", "offload", "cpu"])
def test_runtime_equals_reference(banks, capacity, policy):
    rt = make_runtime(banks, capacity, policy)
    ref = DenseReferenceExperts(banks, CONFIG, "cpu", torch.float32)
    try:
        assert run_steps(rt, ref, DECODE) <= 1e-5
    finally:
        rt.close()
    s = rt.stats
    routes = sum(T for _, T in DECODE) * K * len(LAYERS)
    assert s["routes"] == routes == s["prefill_routes"] + s["decode_routes"]
    assert s["device_routes"] + s["cpu_routes"] == routes  # every route computed exactly once
    assert s["steps"] == len(DECODE)
    stride = banks[0].info.slot_stride
    assert s["bytes_filled"] == s["fills"] * stride
    assert s["fills"] - s["preloaded"] <= s["misses"]
    assert s["hits"] + s["misses"] == rt.cache.stats["hits"] + rt.cache.stats["misses"]
    assert rt.cache.num_resident() <= capacity
    if capacity == TOTAL:  # preloaded: nothing missed, nothing streamed, nothing on the CPU
        assert s["preloaded"] == TOTAL and s["misses"] == 0 and s["cpu_routes"] == 0
        assert s["prefill_layers_streamed"] == 0
    elif capacity == 0:  # no device tier: the plain CPU engine, everything on the CPU
        assert s["prefill_layers_streamed"] == 0 and s["cpu_routes"] == routes
    else:  # the 20-token prefill streams every MoE layer; the 3-token one is planned
        assert s["prefill_layers_streamed"] == len(LAYERS)
        assert s["bytes_streamed"] == len(LAYERS) * E * stride
    if capacity == 0 or policy == "cpu":
        assert s["fills"] == s["preloaded"]
    if policy == "offload" and capacity >= K:
        assert s["fills"] > 0
    if capacity < TOTAL and policy != "offload":
        assert s["cpu_routes"] > 0
    if capacity == TOTAL // 2 and policy != "cpu":
        assert s["hits"] > 0 and s["fills"] > 0


def test_resident_prefill_keeps_the_planned_steps_books(banks):
    """A runtime holding every expert runs many-token layers without a plan (run_resident): the
    same output, counters, cache counters and LRU stamps as the planned step (run) gives."""
    rts = [make_runtime(banks, TOTAL, "hybrid") for _ in range(2)]
    assert all(rt.all_resident for rt in rts)
    gen = torch.Generator().manual_seed(9)
    try:
        for T in (1, 7, 30):
            for layer in LAYERS:
                x = torch.randn(T, D, generator=gen)
                ids, w = random_routes(gen, T, E, K)
                outs = []
                for rt, step in zip(rts, (rts[0].host_step.run, rts[1].host_step.run_resident)):
                    out = torch.zeros(T, D)
                    step(layer, x, ids, w.reshape(-1), out)
                    outs.append(out)
                torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-6)
        planned, resident = (rt.stats for rt in rts)
        for key in ("hits", "misses", "fills", "device_routes", "cpu_routes"):
            assert resident[key] == planned[key], key
        assert rts[1].cache.stats == rts[0].cache.stats
        assert np.array_equal(rts[1].cache.stamps, rts[0].cache.stamps)
        assert rts[1].cache.clock == rts[0].cache.clock
    finally:
        for rt in rts:
            rt.close()


def test_prefill_streaming_leaves_the_cache_alone(banks):
    rt = make_runtime(banks, 5, "offload")
    ref = DenseReferenceExperts(banks, CONFIG, "cpu", torch.float32)
    run_steps(rt, ref, [("decode", 1)] * 6)
    books = (rt.cache.residency.clone(), rt.cache.last_used.clone())
    assert run_steps(rt, ref, [("prefill", 40), ("prefill", 40)], seed=1) <= 1e-5
    assert torch.equal(rt.cache.residency, books[0]) and torch.equal(rt.cache.last_used, books[1])
    assert rt.stats["prefill_layers_streamed"] == 2 * len(LAYERS)
    rt.close()


def test_prefill_below_threshold_and_streaming_off_are_planned(banks):
    rt = make_runtime(banks, 4, "hybrid", prefill_stream_min_tokens=64)
    ref = DenseReferenceExperts(banks, CONFIG, "cpu", torch.float32)
    assert run_steps(rt, ref, [("prefill", 40)]) <= 1e-5
    assert rt.stats["prefill_layers_streamed"] == 0 and rt.stats["misses"] > 0
    rt.close()
    plain = make_runtime(banks, 0, "hybrid")  # --device cpu, no cache: all on the CPU
    assert run_steps(plain, ref, [("prefill", 40), ("decode", 1)]) <= 1e-5
    assert plain.stats["prefill_layers_streamed"] == 0
    assert plain.stats["cpu_routes"] == plain.stats["routes"]
    plain.close()


def test_bf16_compute_close_to_reference(banks):
    rt = ExpertRuntime(banks, CONFIG, EngineConfig(policy="hybrid", tuning=Tuning(cpu_experts="torch")),
                       "cpu", torch.bfloat16, capacity=6)
    ref = DenseReferenceExperts(banks, CONFIG, "cpu", torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    for phase, T in [("prefill", 20)] + [("decode", 1)] * 8:
        rt.begin_step(phase, T)
        for layer in LAYERS:
            x = torch.randn(T, D, generator=gen).bfloat16()
            ids, w = random_routes(gen, T, E, K)
            ours = rt.forward(layer, x, ids, w)
            assert ours.dtype == torch.bfloat16
            torch.testing.assert_close(ours.float(), ref.forward(layer, x, ids, w).float(),
                                       atol=3e-2, rtol=3e-2)  # CPU part runs in fp32
    rt.close()


def test_empty_step_and_forward_order_independent(banks):
    rt = make_runtime(banks, 3, "hybrid")
    rt.begin_step("decode", 0)
    out = rt.forward(0, torch.zeros(0, D), torch.zeros(0, K, dtype=torch.int64), torch.zeros(0, K))
    assert out.shape == (0, D)
    rt.close()


def test_kernel_executor_matches_torch_executor(banks):
    import freetoken.kernels as kernels
    torch_ex = TorchCpuExecutor(banks)
    kern = create_executor(banks, "kernels", num_threads=2, has_gpu=False)
    torch.set_num_threads(1)  # the kernel executor set torch's threads for a real run
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(6, D, generator=gen)
    tok = torch.tensor([0, 0, 2, 3, 5, 5, 1])
    exp = torch.tensor([1, 4, 4, 7, 0, 2, 4])
    w = torch.rand(7, generator=gen)
    want = torch_ex.submit(1, x, tok, exp, w).wait()
    got = kern.submit(1, x, tok, exp, w).wait()
    tol = 2e-2 if banks[1].info.dtype == "bf16" and "avx512bf16" in kernels.available_isas() else 1e-5
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch_ex.close()


@pytest.mark.parametrize("capacity, policy", [(3, "hybrid"), (TOTAL // 2, "offload"), (TOTAL, "cpu")])
def test_cpu_tier_on_the_kernel_pool_equals_reference(banks, capacity, policy):
    import freetoken.kernels  # noqa: F401
    rt = make_runtime(banks, capacity, policy, cpu_experts="kernels")
    torch.set_num_threads(1)  # the kernel executor set torch's threads for a real run
    assert rt.tier_on_pool
    ref = DenseReferenceExperts(banks, CONFIG, "cpu", torch.float32)
    bf16_isa = banks[0].info.dtype == "bf16" and rt.executor.pool.isa == "avx512bf16"
    assert run_steps(rt, ref, DECODE[:20]) <= (2e-2 if bf16_isa else 1e-5)
    assert rt.stats["device_routes"] > 0
    rt.close()


def test_factory_and_bad_cache_size(banks):
    cfg = EngineConfig(expert_cache_frac=0.5, tuning=Tuning(cpu_experts="torch"))
    rt = create_expert_runtime(banks, CONFIG, cfg, "cpu", "fp32")
    assert isinstance(rt, ExpertRuntime) and rt.cache.capacity == TOTAL // 2
    assert "slots" in rt.split_info
    rt.close()
    none = create_expert_runtime(banks, CONFIG, EngineConfig(expert_cache_frac=0.0,
                                                             tuning=Tuning(cpu_experts="torch")),
                                 "cpu", "fp32")
    assert none.split_info == "no expert cache: every routed expert runs on the CPU"
    none.close()
    ref = create_expert_runtime(banks, CONFIG, EngineConfig(tuning=Tuning(reference_experts=True)),
                                "cpu", torch.float32)
    assert isinstance(ref, DenseReferenceExperts)
    with pytest.raises(ConfigError, match="larger than all the model's experts"):
        create_expert_runtime(banks, CONFIG, EngineConfig(expert_cache_gb=10), "cpu", torch.float32)


@pytest.mark.parametrize("backend", ["torch", "kernels"])
def test_runtime_under_inference_mode(banks, backend):
    """The engine runs under torch.inference_mode (per thread): CPU partials handed to the
    executor's worker thread are inference tensors there."""
    if backend == "kernels":
        import freetoken.kernels  # noqa: F401
    rt = make_runtime(banks, 3, "hybrid", cpu_experts=backend, tier_torch=True)
    ref = DenseReferenceExperts(banks, CONFIG, "cpu", torch.float32)
    try:
        with torch.inference_mode():
            assert run_steps(rt, ref, DECODE[:12]) <= (1e-5 if backend == "torch" else 1e-4)
    finally:
        rt.close()
    assert rt.stats["cpu_routes"] > 0 and rt.stats["device_routes"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("capacity", [0, 5, TOTAL])
@pytest.mark.parametrize("policy", ["hybrid", "offload", "cpu"])
def test_cuda_runtime_equals_reference(capacity, policy):
    """Copy stream, events and pinned banks on a real GPU; fp32 compute."""
    banks = make_banks(LAYERS, E, D, I, "bf16", seed=4)[0]
    for b in banks.values():
        torch.cuda.cudart().cudaHostRegister(b.data.ctypes.data, b.data.nbytes, 0)
    rt = ExpertRuntime(banks, CONFIG, EngineConfig(policy=policy, tuning=Tuning(cpu_experts="torch")),
                       "cuda", torch.float32, capacity=capacity)
    ref = DenseReferenceExperts(banks, CONFIG, "cuda", torch.float32)
    gen = torch.Generator().manual_seed(6)
    with torch.inference_mode():  # as the engine (the CPU partials cross to a worker thread)
        _cuda_steps(rt, ref, gen)
    torch.cuda.synchronize()
    rt.close()
    for b in banks.values():
        torch.cuda.cudart().cudaHostUnregister(b.data.ctypes.data)


def _cuda_steps(rt, ref, gen):
    for phase, T in DECODE + [("prefill", 64)] * 2:
        rt.begin_step(phase, T)
        for layer in LAYERS:
            x = torch.randn(T, D, generator=gen).cuda()
            ids, w = random_routes(gen, T, E, K)
            ours = rt.forward(layer, x, ids.cuda(), w.cuda())
            assert ours.device.type == "cuda"
            torch.testing.assert_close(ours, ref.forward(layer, x, ids.cuda(), w.cuda()),
                                       atol=1e-5, rtol=1e-5)
        rt.cache.check_integrity()


def test_default_admissions_only_where_a_background_gather_runs(banks):
    """runtime.admissions: hybrid on cuda with Triton admits 1 per step in steps of <= 3 misses
    by default; --fill-behind N (0 included) and Tuning.fill_behind_max_misses override; the cpu
    device, other policies and cuda without Triton admit nothing unless asked."""
    from freetoken.experts.runtime import (DEFAULT_FILL_BEHIND, DEFAULT_FILL_BEHIND_MAX_MISSES,
                                           admissions)
    default = (DEFAULT_FILL_BEHIND, DEFAULT_FILL_BEHIND_MAX_MISSES)
    assert default == (1, 3)
    from freetoken.cli import run  # its --help states the default
    help_text = " ".join(next(p.help for p in run.params if p.name == "fill_behind").split())
    assert f"of at most {DEFAULT_FILL_BEHIND_MAX_MISSES} cache misses" in help_text
    assert admissions(None, None, "hybrid", True) == default
    assert admissions(None, 2, "hybrid", True) == (1, 2)
    assert admissions(0, None, "hybrid", True) == (0, None)
    assert admissions(3, None, "hybrid", True) == (3, None)
    assert admissions(2, 5, "offload", False) == (2, 5)
    for policy, gather in (("hybrid", False), ("offload", True), ("cpu", True)):
        assert admissions(None, None, policy, gather) == (None, None)
    cfg = EngineConfig(expert_cache_frac=0.5, tuning=Tuning(cpu_experts="torch"))
    rt = create_expert_runtime(banks, CONFIG, cfg, "cpu", "fp32")
    assert rt.fill_behind == 0 and "admissions off" in rt.split_info
    rt.close()
