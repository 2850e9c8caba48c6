"""Properties of the expert cache, the miss split and the plan on random routing traces
(hypothesis), checked against a ten-line naive LRU model."""
from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from freetoken.config import EngineConfig
from freetoken.errors import ConfigError
from freetoken.experts.cache import ExpertCache, cache_capacity
from freetoken.experts.plan import apply_plan, make_plan
from freetoken.experts.split import qstar as split

FEW = settings(max_examples=60, deadline=None)


def infos(num_experts_by_layer, stride=4096):
    return {l: SimpleNamespace(num_experts=e, slot_stride=stride)
            for l, e in num_experts_by_layer.items()}


class NaiveLRU:
    """Recency order of (layer, expert) keys; the oldest first."""

    def __init__(self, capacity):
        self.capacity, self.order = capacity, OrderedDict()

    def step(self, layer, counts, policy, P, C):
        hits = [e for e in sorted(counts) if (layer, e) in self.order]
        for e in hits:
            self.order.move_to_end((layer, e))
        misses = sorted((e for e in counts if (layer, e) not in self.order),
                        key=lambda e: (-counts[e], e))
        q = split(len(misses), P, C, policy, self.capacity - len(hits))
        fills, evicted = sorted(misses[:q]), []
        for e in fills:
            full = len(self.order) >= self.capacity
            evicted.append(self.order.popitem(last=False)[0] if full else (-1, -1))
            self.order[(layer, e)] = True
        return hits, fills, evicted


@st.composite
def traces(draw):
    layers = {l: draw(st.integers(2, 8)) for l in draw(st.sets(st.integers(0, 4), min_size=1, max_size=3))}
    total = sum(layers.values())
    capacity = draw(st.integers(0, total))
    policy = draw(st.sampled_from(["hybrid", "offload", "cpu"]))
    P, C = draw(st.sampled_from([(1.0, 1.0), (25.0, 50.0), (3.0, 1.0)]))
    steps = []
    for _ in range(draw(st.integers(1, 25))):
        layer = draw(st.sampled_from(sorted(layers)))
        E = layers[layer]
        K = draw(st.integers(1, min(4, E)))
        T = draw(st.integers(1, 4))
        rows = [draw(st.permutations(range(E)))[:K] for _ in range(T)]
        steps.append((layer, torch.tensor(rows, dtype=torch.int64)))
    return layers, capacity, policy, (P, C), steps


def run_trace(layers, capacity, policy, PC, steps, check=None):
    cache = ExpertCache(infos(layers), capacity, with_storage=False)
    plans = []
    for layer, ids in steps:
        plan = make_plan(cache, layer, ids, policy, *PC)
        if check:
            check(cache, plan, ids)
        apply_plan(cache, plan)
        cache.check_integrity()
        plans.append(plan)
    return cache, plans


def check_plan(cache, plan, ids):
    """Invariants of one plan against the cache it was made from (before apply)."""
    routed = sorted(set(ids.reshape(-1).tolist()))
    hit_e = [e for e, _ in plan.hits]
    fill_e = [e for e, _, _, _ in plan.fills]
    assert plan.experts == routed
    assert sorted(hit_e + fill_e + plan.cpu_experts) == routed  # a partition of the experts
    assert len(plan.hits) + plan.m == len(routed)
    assert 0 <= plan.q <= plan.m and plan.q == len(plan.fills)
    assert plan.q <= cache.capacity - len(plan.hits)
    assert all(cache.lookup(plan.layer, [e])[0] == s for e, s in plan.hits)
    hit_slots = {s for _, s in plan.hits}
    fill_slots = [s for _, s, _, _ in plan.fills]
    assert len(set(fill_slots)) == len(fill_slots) and not hit_slots & set(fill_slots)
    slot_of = dict(plan.hits) | {e: s for e, s, _, _ in plan.fills}
    flat = ids.reshape(-1).tolist()
    # every route in exactly one of hit / fill / cpu, computed where its expert is planned
    assert plan.route_slot.tolist() == [slot_of.get(e, -1) for e in flat]
    assert sorted(plan.route_ids.tolist()) == list(range(len(flat)))
    assert [flat[r] for r in plan.route_ids.tolist()] == sorted(flat)
    assert (plan.token_ids == plan.route_ids // ids.shape[1]).all()


@FEW
@given(traces())
def test_plan_invariants_and_integrity(trace):
    layers, capacity, policy, PC, steps = trace
    cache, _ = run_trace(layers, capacity, policy, PC, steps, check=check_plan)
    assert cache.num_resident() <= capacity
    assert cache.stats["hits"] + cache.stats["misses"] == sum(
        len(set(ids.reshape(-1).tolist())) for _, ids in steps)


@FEW
@given(traces())
def test_lru_equals_naive_model(trace):
    layers, capacity, policy, PC, steps = trace
    naive = NaiveLRU(capacity)
    cache = ExpertCache(infos(layers), capacity, with_storage=False)
    for layer, ids in steps:
        flat = ids.reshape(-1).tolist()
        counts = {e: flat.count(e) for e in set(flat)}
        hits, fills, evicted = naive.step(layer, counts, policy, *PC)
        plan = make_plan(cache, layer, ids, policy, *PC)
        apply_plan(cache, plan)
        assert [e for e, _ in plan.hits] == hits
        assert [e for e, _, _, _ in plan.fills] == fills
        assert [(el, ee) for _, _, el, ee in plan.fills] == evicted
        resident = {tuple(x) for x in (cache.residency >= 0).nonzero().tolist()}
        assert resident == set(naive.order)


@FEW
@given(traces())
def test_plans_are_deterministic(trace):
    _, plans_a = run_trace(*trace)
    _, plans_b = run_trace(*trace)
    assert [str(p) for p in plans_a] == [str(p) for p in plans_b]
    assert all(torch.equal(a.route_slot, b.route_slot) for a, b in zip(plans_a, plans_b))


@FEW
@given(st.integers(0, 300), st.floats(0.01, 100), st.floats(0.01, 100),
       st.sampled_from(["hybrid", "offload", "cpu"]), st.one_of(st.none(), st.integers(-3, 300)))
def test_split_within_bounds(m, P, C, policy, free):
    q = split(m, P, C, policy, free)
    assert 0 <= q <= m
    if free is not None:
        assert q <= max(0, free)
    expect = {"offload": m, "cpu": 0, "hybrid": int(m * P / (P + C) + 0.5)}[policy]
    assert q == (expect if free is None else min(expect, max(0, free)))


def test_split_examples():
    assert split(8, 25, 50, "hybrid") == 3  # 8/3 = 2.67
    assert split(3, 1, 1, "hybrid") == 2  # halves round up
    assert split(8, 1, 1, "offload", free_slots=0) == 0  # zero capacity: nothing to fill
    with pytest.raises(ValueError):
        split(1, 1, 1, "gpu")


def test_plan_docstring_example():
    cache = ExpertCache(infos({0: 8}), 2, with_storage=False)
    apply_plan(cache, make_plan(cache, 0, torch.tensor([[5]]), "offload", 1, 1))
    plan = make_plan(cache, 0, torch.tensor([[5, 2], [2, 7]]), "offload", 1, 1)
    assert plan.hits == [(5, 0)] and plan.fills == [(2, 1, -1, -1)] and plan.cpu_experts == [7]
    assert plan.route_slot.tolist() == [0, 1, 1, -1]
    assert "evicts" not in str(plan) and "cpu [7]" in str(plan)


def test_a_step_never_evicts_its_own_hits():
    cache = ExpertCache(infos({0: 8, 1: 8}), 3, with_storage=False)
    for layer, e in [(0, 0), (0, 1), (1, 0)]:  # (0, 0) is now least recently used
        apply_plan(cache, make_plan(cache, layer, torch.tensor([[e]]), "offload", 1, 1))
    plan = make_plan(cache, 0, torch.tensor([[0, 5]]), "offload", 1, 1)
    assert [e for e, _ in plan.hits] == [0]
    assert plan.fills[0][2:] == (0, 1)  # evicts (0, 1), the oldest that is not a hit


def test_capacity_from_config():
    bi = infos({0: 10, 1: 10}, stride=8192)
    assert cache_capacity(EngineConfig(expert_cache_frac=0.25), bi, "cpu") == 5
    assert cache_capacity(EngineConfig(expert_cache_frac=1.0), bi, "cpu") == 20
    assert cache_capacity(EngineConfig(expert_cache_gb=0), bi, "cpu") == 0
    assert cache_capacity(EngineConfig(expert_cache_gb=20 * 8192 / 1e9), bi, "cpu") == 20
    assert cache_capacity(EngineConfig(), bi, "cpu") == 0
    with pytest.raises(ConfigError, match=r"larger than all the model's experts.*0\.000163 GB"):
        cache_capacity(EngineConfig(expert_cache_gb=1), bi, "cpu")
    with pytest.raises(ConfigError):
        ExpertCache(bi, 21, with_storage=False)


def test_storage_shape_and_slot_view():
    cache = ExpertCache(infos({0: 4, 2: 4}, stride=4096), 3)
    assert cache.storage.shape == (3, 4096) and cache.storage.dtype == torch.uint8
    assert cache.residency.shape == (3, 4)
    assert cache.slot(2).shape == (4096,)
