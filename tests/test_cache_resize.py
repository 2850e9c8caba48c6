"""Resizing the expert cache at run time: ExpertCache.resize on random traces (the most recent
residents survive a shrink with their bytes and recency order, a grow keeps every one, the
integrity check holds; where the new storage does not fit beside the old, the kept slots are
refilled from the host), and LLM.resize_expert_cache in the middle of a generation leaves the
greedy tokens unchanged, per policy, on the cpu device tier and on cuda (captured decode steps
kept where the slots sit at a fixed address, else captured again); past the plan's budget it
is refused. Fixed-address storage (cache.py, vmm.py; HostSlotMemory on the cpu): kept slots
past a shrink's end move in place before the tail is unmapped, a grow that cannot map leaves
the cache as it was."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from freetoken.api import LLM, plan_model
from freetoken.config import EngineConfig
from freetoken.errors import ConfigError
from freetoken.experts.cache import ExpertCache
from slot_memory_support import UNMAPPED, HostSlotMemory, fixed_slots

LAYERS, EXPERTS, STRIDE = 3, 8, 16


def infos():
    return {l: SimpleNamespace(num_experts=EXPERTS, slot_stride=STRIDE) for l in range(LAYERS)}


def fingerprint(layer, expert):
    return torch.full((STRIDE,), layer * EXPERTS + expert + 1, dtype=torch.uint8)


def residents(cache) -> dict:
    """{(layer, expert): stamp} of every resident, checking its slot holds its bytes."""
    out = {}
    for s in np.flatnonzero(cache.own[:, 0] >= 0):
        key = tuple(int(v) for v in cache.own[s])
        assert torch.equal(cache.storage[s], fingerprint(*key)), (key, s)
        out[key] = int(cache.stamps[s])
    return out


def make_cache(capacity, fixed):
    """fixed: the slots in fixed-address memory (a HostSlotMemory reserving every expert)."""
    memory = HostSlotMemory(LAYERS * EXPERTS * STRIDE, capacity * STRIDE) if fixed else None
    return ExpertCache(infos(), capacity, memory=memory)


@settings(max_examples=80, deadline=None)
@given(st.integers(0, LAYERS * EXPERTS),
       st.lists(st.tuples(st.integers(0, LAYERS - 1), st.integers(0, EXPERTS - 1)), max_size=60),
       st.lists(st.integers(0, LAYERS * EXPERTS), min_size=1, max_size=4), st.booleans())
def test_resize_keeps_the_most_recent_with_their_bytes(capacity, trace, sizes, fixed):
    """fixed: the kept slots past the new end move in place, before the tail is unmapped (its
    bytes then read 0xFF), and the storage keeps its address and shape."""
    cache = make_cache(capacity, fixed)
    address = cache.storage.data_ptr()
    for layer, expert in trace:  # LRU fills, as the planner does them
        slot = int(cache.res[layer, expert])
        if slot < 0 and cache.capacity:
            slot = int(np.argmin(cache.stamps))
            cache.assign(slot, layer, expert)
            cache.slot(slot).copy_(fingerprint(layer, expert))
        if slot >= 0:
            cache.touch([slot])
    for size in sizes:
        before = residents(cache)
        evicted = cache.resize(size)
        cache.check_integrity()
        after = residents(cache)
        recent = sorted(before, key=before.get, reverse=True)[:size]
        assert after == {k: before[k] for k in recent}  # stamps, hence LRU order, kept
        assert evicted == len(before) - len(after)
        assert cache.capacity == len(cache.stamps) == size
        if fixed:
            assert cache.storage.data_ptr() == address
            assert cache.storage.shape[0] == cache.max_slots == LAYERS * EXPERTS
            assert cache.memory.nbytes == size * STRIDE
            assert (cache.storage[size:] == UNMAPPED).all()
            assert (cache.storage[:size][cache.own[:, 0] < 0] == 0).all()  # grown slots zeroed
        else:
            assert cache.storage.shape[0] == size
        if size:  # the torch views follow the new arrays
            assert np.shares_memory(cache.owner.numpy(), cache.own)
            assert np.shares_memory(cache.last_used.numpy(), cache.stamps)


def test_a_fixed_address_shrink_copies_only_the_kept_slots_past_the_end():
    cache = make_cache(6, fixed=True)
    for slot, (layer, expert) in enumerate([(0, 1), (1, 2), (2, 3), (0, 7), (1, 0), (2, 2)]):
        cache.assign(slot, layer, expert)
        cache.slot(slot).copy_(fingerprint(layer, expert))
    cache.touch([4, 0, 5, 2, 1, 3])  # most recent last: slots 0 and 4 go, 5 moves into 0
    assert cache.resize(4) == 2
    cache.check_integrity()
    assert residents(cache).keys() == {(2, 3), (0, 7), (1, 2), (2, 2)}  # bytes checked
    assert cache.res[0, 1] == -1 and cache.res[1, 0] == -1  # the two oldest evicted
    assert cache.res[2, 2] == 0 and cache.res[1, 2] == 1  # moved into slot 0; 1 stays put
    assert cache.memory.calls == [4 * STRIDE]  # one unmap, no map


def test_a_fixed_address_grow_that_cannot_map_leaves_the_cache_as_it_was():
    from freetoken.experts import vmm
    cache = make_cache(4, fixed=True)
    cache.assign(3, 1, 5)
    cache.slot(3).copy_(fingerprint(1, 5))
    cache.touch([3])
    real = cache.memory.resize

    def no_memory(nbytes):
        if nbytes > cache.memory.nbytes:
            raise vmm.VmmError("cuMemCreate of 67108864 bytes failed: CUDA_ERROR_OUT_OF_MEMORY (2)")
        real(nbytes)
    cache.memory.resize = no_memory
    before = (cache.res.copy(), cache.own.copy(), cache.stamps.copy())
    with pytest.raises(torch.OutOfMemoryError, match="growing the expert cache to 10 slots"):
        cache.resize(10)
    cache.check_integrity()
    assert cache.capacity == 4 and cache.memory.nbytes == 4 * STRIDE
    assert all(np.array_equal(a, b) for a, b in zip(before, (cache.res, cache.own, cache.stamps)))
    assert residents(cache) == {(1, 5): cache.clock}
    small = ExpertCache(infos(), 4, memory=HostSlotMemory(10 * STRIDE, 4 * STRIDE))
    with pytest.raises(ConfigError, match="fixed-address storage holds at most 10 slots, not 11"):
        small.resize(11)


def test_a_shrink_that_does_not_fit_beside_the_old_storage_refills_from_the_host(monkeypatch):
    cache = ExpertCache(infos(), 10)
    for slot, (layer, expert) in enumerate([(0, 1), (1, 2), (2, 3), (0, 7), (1, 0)]):
        cache.assign(slot, layer, expert)
        cache.slot(slot).copy_(fingerprint(layer, expert))
        cache.touch([slot])
    zeros, calls = torch.zeros, []

    def short_once(*args, **kwargs):  # the first allocation beside the old storage fails
        calls.append(args)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("simulated")
        return zeros(*args, **kwargs)

    def refill(slots):
        assert cache.storage is not None and cache.storage.shape[0] == 3
        for s in slots:
            cache.slot(s).copy_(fingerprint(*(int(v) for v in cache.own[s])))

    monkeypatch.setattr(torch, "zeros", short_once)
    assert cache.resize(3, refill=refill) == 2
    cache.check_integrity()
    assert set(residents(cache)) == {(2, 3), (0, 7), (1, 0)}  # the 3 most recent, bytes checked
    assert len(calls) == 2


@pytest.fixture(scope="module")
def greedy_24():
    """The bundled model's greedy 24 tokens per policy, with no resize."""
    out = {}
    for policy in ("hybrid", "offload", "cpu"):
        with LLM(device="cpu", expert_cache_frac=0.5, policy=policy) as llm:
            out[policy] = llm.generate("def fibonacci(n):", temperature=0, max_tokens=24)
    return out


@pytest.mark.parametrize("fixed", [False, True], ids=["tensor", "fixed"])
@pytest.mark.parametrize("policy", ["hybrid", "offload", "cpu"])
def test_greedy_tokens_unchanged_across_resizes_mid_generation(greedy_24, policy, fixed,
                                                                monkeypatch):
    """fixed: the slots in a HostSlotMemory (cuda's fixed-address form; unmapped bytes NaN)."""
    made = fixed_slots(monkeypatch) if fixed else None
    with LLM(device="cpu", expert_cache_frac=0.5, policy=policy) as llm:
        stride = llm.engine.experts.cache.slot_stride
        total = llm.engine.memory_plan.num_experts
        pieces = []
        for i, piece in enumerate(llm.stream("def fibonacci(n):", temperature=0, max_tokens=24)):
            pieces.append(piece)
            if i in (4, 8, 12):  # shrink to a quarter, grow past the start, shrink to 2 slots
                slots = {4: total // 4, 8: 3 * total // 4, 12: 2}[i]
                llm.resize_expert_cache((slots + 0.5) * stride / 1e9)
                cache = llm.engine.experts.cache
                cache.check_integrity()
                assert cache.capacity == slots == llm.engine.memory_plan.num_slots
                mapped = made[0].nbytes if fixed else cache.storage.nbytes
                assert mapped == llm.engine.memory_plan.expert_cache
        assert "".join(pieces) == greedy_24[policy]
        if policy != "cpu":  # (cpu runs every miss on the CPU: never fills)
            assert llm.stats.experts["fills"] > 0  # the grown cache filled on demand


def test_resize_past_the_budget_is_refused():
    options = dict(device="cpu", ctx_size=256, parallel=1)
    p = plan_model(None, EngineConfig(gpu_mem_gb=1.0, **options))
    cap = (p.weights + p.kv + p.buffers + p.num_experts * p.slot_bytes / 2) / 0.95 / 1e9
    with LLM(gpu_mem_gb=cap, expert_cache_frac=0.25, **options) as llm:
        plan = llm.engine.memory_plan
        room = (plan.budget - plan.context_part) / 1e9
        all_gb = plan.num_experts * plan.slot_bytes / 1e9
        assert room < all_gb  # the cap leaves room for part of the experts
        with pytest.raises(ConfigError, match=r"exceed [0-9.]+ GB \(--gpu-mem-gb"):
            llm.resize_expert_cache(room + 2 * plan.slot_bytes / 1e9)
        with pytest.raises(ConfigError, match="larger than all the model's experts"):
            llm.resize_expert_cache(all_gb * 2)
        llm.resize_expert_cache(room)
        assert llm.engine.memory_plan.total <= plan.budget
        assert llm.generate("def f(x):", temperature=0, max_tokens=4)


@pytest.mark.gpu
@pytest.mark.parametrize("storage", ["fixed", "realloc", "realloc-refill"])
@pytest.mark.parametrize("policy", ["hybrid", "offload"])
def test_greedy_tokens_unchanged_across_resizes_on_cuda(policy, storage, monkeypatch):
    """As on the cpu tier, with captured decode steps and GPU-resident control. fixed: the
    slots at a fixed address (experts/vmm.py, the default where the driver allows it): the
    captured step is kept (no capture again) wherever ExpertRuntime.keeps_captured says so, and
    the storage keeps its address. realloc: the fallback, a new storage
    at each resize and the steps captured again; realloc-refill: no room beside the old one
    (the kept slots refilled from the host)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from freetoken.experts import cache as cache_mod, runtime as runtime_mod
    options = dict(device="cuda", dtype="fp32", expert_cache_frac=0.5, policy=policy)
    with LLM(**options) as llm:
        ref = llm.generate("def fibonacci(n):", temperature=0, max_tokens=24)
    if storage != "fixed":
        def no_vmm(bank_infos, capacity, device):
            return None, "expert cache slots reallocated at each resize (the test)"
        monkeypatch.setattr(cache_mod, "create_slot_memory", no_vmm)
        monkeypatch.setattr(runtime_mod, "create_slot_memory", no_vmm)
    if storage == "realloc-refill":
        zeros = torch.zeros

        def short(*args, device=None, **kwargs):  # every cache allocation beside the old fails
            if device is not None and torch.device(device).type == "cuda" and not short.freed:
                short.freed = True
                raise torch.OutOfMemoryError("simulated")
            return zeros(*args, device=device, **kwargs)
        short.freed = True  # allocations pass until a resize arms it
        monkeypatch.setattr(torch, "zeros", short)
    with LLM(**options) as llm:
        graphs, rt = llm.engine.graphs, llm.engine.experts
        assert graphs is not None
        assert rt.cache.fixed_address == (storage == "fixed"), rt.storage_info
        stride = rt.cache.slot_stride
        total = llm.engine.memory_plan.num_experts
        address = rt.cache.storage.data_ptr()
        pieces, kept, captures = [], [], None
        for i, piece in enumerate(llm.stream("def fibonacci(n):", temperature=0, max_tokens=24)):
            pieces.append(piece)
            if i in (4, 8, 12):
                captures = graphs.captures if captures is None else captures
                slots = {4: total // 4, 8: 3 * total // 4, 12: 2}[i]
                if storage == "realloc-refill":
                    short.freed = False
                step, keeps = rt.graph_step, rt.keeps_captured(slots)
                llm.resize_expert_cache((slots + 0.5) * stride / 1e9)
                kept.append(keeps)
                assert (rt.graph_step is step) == keeps
                cache = rt.cache
                cache.check_integrity()
                assert cache.capacity == slots and cache.storage.is_cuda
        assert "".join(pieces) == ref
        assert graphs.captured  # decode ran from captured graphs after the resizes
        # one span: each resize that did not keep the step captured it once more
        assert captures >= 1 and graphs.captures == captures + kept.count(False)
        if storage == "fixed":
            assert kept == [True] * 3
            control = rt.graph_step.control
            if control is not None and control.admissions is not None:  # hybrid
                # 2 slots need the joins its step was captured without: admissions off
                assert not control.admissions.join_each_layer
                assert int(control.books.btab.sum()) == 0
            assert rt.cache.storage.data_ptr() == address
            assert rt.cache.memory.nbytes == rt.cache.capacity * stride
        else:
            assert kept == [False] * 3
