"""The native decode planner (cython/plan.pyx, freetoken._plan) against the Python planners:
make_decode_plan through it gives make_plan's plan field by field and leaves the same books,
and equals make_decode_plan's Python body; inputs it does not plan itself go to Python."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from freetoken.experts import plan as plan_mod
from freetoken.experts.cache import ExpertCache
from freetoken.experts.plan import apply_plan, make_decode_plan, make_plan
from freetoken.experts.policy import LRUPolicy

pytestmark = pytest.mark.skipif(plan_mod.native_decode_plan is None, reason="freetoken._plan is not built")

L, E = 3, 12  # layers, experts per layer of the test caches
FIELDS = ("layer", "experts", "counts", "expert_slot", "hits", "fills", "cpu_experts", "m", "q",
          "behind")
TENSORS = ("token_ids", "route_ids", "route_slot")


class Info:
    num_experts, slot_stride = E, 64


def make_caches(capacity, warmup, n=3):
    """n ExpertCaches in one random state: `warmup` steps of random routing planned and applied
    by make_plan (several tokens, repeats, every policy), so residency and stamps are mixed."""
    caches = [ExpertCache({layer: Info() for layer in range(L)}, capacity, with_storage=False)
              for _ in range(n)]
    for layer, ids, policy, behind in warmup:
        for c in caches:
            apply_plan(c, make_plan(c, layer, np.array(ids), policy, 2.0, 1.0, behind=behind))
    return caches


def assert_same_plan(a, b):
    for field in FIELDS:
        assert getattr(a, field) == getattr(b, field), field
    for field in TENSORS:
        ta, tb = getattr(a, field), getattr(b, field)
        assert isinstance(tb, torch.Tensor) and tb.dtype == torch.int64, field
        assert ta.tolist() == tb.tolist(), field


def assert_same_books(a, b):
    assert (a.res == b.res).all() and (a.own == b.own).all() and (a.stamps == b.stamps).all()
    assert a.clock == b.clock and a.stats == b.stats
    a.check_integrity()


warmup_step = st.tuples(st.integers(0, L - 1),
                        st.lists(st.lists(st.integers(0, E - 1), min_size=2, max_size=2),
                                 min_size=1, max_size=3),
                        st.sampled_from(["hybrid", "offload", "cpu"]), st.integers(0, 2))
decode_step = st.tuples(st.integers(0, L - 1),
                        st.lists(st.integers(0, E - 1), min_size=1, max_size=8, unique=True),
                        st.sampled_from(["hybrid", "offload", "cpu"]),
                        st.sampled_from([1.0, 2.0, 3.0, 25.0, 50.0, 1e-3, 0.0, 7]),
                        st.sampled_from([1.0, 2.0, 3.0, 50.0, 0.1, 0.0, 7]),
                        st.integers(0, 3))


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(0, 24), warmup=st.lists(warmup_step, max_size=8),
       steps=st.lists(decode_step, min_size=1, max_size=6))
def test_native_decode_plan_equals_make_plan(capacity, warmup, steps):
    """Over random cache states, capacities 0..24 (below K too), every policy, fill-behind
    0..3, bandwidths that round halves (P = C) and ints: the native plan is make_plan's and
    the Python body's, and the books stay equal after each step."""
    ref, nat, py = make_caches(capacity, warmup)
    for layer, ids, policy, P, C, behind in steps:
        ids = np.array([ids], dtype=np.int64)  # [1, K]
        raw = plan_mod.native_decode_plan(nat.res, nat.own, nat.stamps, ids, layer, policy, P, C,
                                           nat.capacity, behind)
        assert raw is not None  # planned natively, not handed back to Python
        a = make_plan(ref, layer, ids, policy, P, C, behind=behind)
        b = make_decode_plan(nat, layer, ids, policy, P, C, behind=behind)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(plan_mod, "native_decode_plan", None)
            c = make_decode_plan(py, layer, ids, policy, P, C, behind=behind)
        assert_same_plan(a, b)
        assert_same_plan(c, b)
        before = nat.stamps.copy(), nat.res.copy(), nat.own.copy()
        assert (before[0] == ref.stamps).all()  # planning did not touch the books
        for cache, p in ((ref, a), (nat, b), (py, c)):
            apply_plan(cache, p)
        assert_same_books(ref, nat)
        assert_same_books(py, nat)


def test_native_example_and_half_rounding():
    """cache {5: slot 0} of 3 slots, token [5, 2, 7, 9], hybrid with P = C: m = 3, q =
    floor(1.5 + 0.5) = 2 (halves round up), the misses filled in ascending order."""
    (cache,) = make_caches(3, [(0, [[5]], "offload", 0)], n=1)
    p = make_decode_plan(cache, 0, np.array([[5, 2, 9, 7]]), "hybrid", 10.0, 10.0)
    assert p.experts == [2, 5, 7, 9] and p.hits == [(5, 0)] and (p.m, p.q) == (3, 2)
    assert p.fills == [(2, 1, -1, -1), (7, 2, -1, -1)] and p.cpu_experts == [9]
    assert p.route_ids.tolist() == [1, 0, 3, 2] and p.route_slot.tolist() == [0, 1, -1, 2]
    assert p.token_ids.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("ids", [[[3, 3, 1]], [[1, 2], [2, 4]], [[4, 1, 2, 1]]])
def test_repeats_and_several_tokens_go_to_make_plan(ids):
    ref, nat = make_caches(4, [(1, [[1, 2], [5, 6]], "offload", 0)], n=2)
    ids = np.array(ids, dtype=np.int64)
    assert plan_mod.native_decode_plan(nat.res, nat.own, nat.stamps, ids, 1, "offload", 1.0,
                                        1.0, nat.capacity, 1) is None
    a = make_plan(ref, 1, ids, "offload", 1.0, 1.0, behind=1)
    b = make_decode_plan(nat, 1, ids, "offload", 1.0, 1.0, behind=1)
    assert_same_plan(a, b)


@pytest.mark.parametrize("ids", [np.array([[7, 1, 4]], dtype=np.int32), torch.tensor([[7, 1, 4]]),
                                 np.array([[7, 1, 4]])[:, ::-1]])
def test_other_id_arrays_are_planned_by_python(ids):
    """int32, a torch tensor, a non-contiguous view: the Python body plans them, the same."""
    ref, nat = make_caches(5, [(0, [[1, 2], [3, 4]], "offload", 0)], n=2)
    a = make_plan(ref, 0, ids, "hybrid", 2.0, 1.0)
    b = make_decode_plan(nat, 0, ids, "hybrid", 2.0, 1.0)
    assert_same_plan(a, b)


def test_out_of_range_ids_raise_not_crash(monkeypatch):
    """An expert id past the layer's experts raises IndexError on both paths, as numpy does;
    a negative one is planned as the Python body plans it (numpy wraps it)."""
    (cache,) = make_caches(4, [], n=1)
    for native in (plan_mod.native_decode_plan, None):
        monkeypatch.setattr(plan_mod, "native_decode_plan", native)
        with pytest.raises(IndexError):
            make_decode_plan(cache, 0, np.array([[1, E]]), "offload", 1.0, 1.0)
        with pytest.raises(IndexError):
            make_decode_plan(cache, 0, np.array([[1, 10 ** 6]]), "offload", 1.0, 1.0)
        with pytest.raises(IndexError):
            make_decode_plan(cache, L, np.array([[1, 2]]), "offload", 1.0, 1.0)
    monkeypatch.setattr(plan_mod, "native_decode_plan", None)
    expect = make_decode_plan(cache, 0, np.array([[1, -1]]), "cpu", 1.0, 1.0)
    monkeypatch.undo()
    assert_same_plan(expect, make_decode_plan(cache, 0, np.array([[1, -1]]), "cpu", 1.0, 1.0))


def test_bad_policy_and_bandwidths_raise_as_python():
    (cache,) = make_caches(4, [], n=1)
    with pytest.raises(ValueError, match="unknown policy"):
        make_decode_plan(cache, 0, np.array([[1, 2]]), "greedy", 1.0, 1.0)
    with pytest.raises((ValueError, OverflowError)):  # math.floor(inf) in split.qstar
        make_decode_plan(cache, 0, np.array([[1, 2]]), "hybrid", float("inf"), 1.0)
    assert make_decode_plan(cache, 0, np.array([[1, 2]]), "hybrid", float("nan"), 1.0).q == 0


def test_other_eviction_policies_use_python():
    """A policy other than the plain LRUPolicy (here most recently used first) is asked for
    its victims: the native LRU planner is not used for it."""
    class MRU(LRUPolicy):
        def victims(self, stamps, n, protected):
            order = [int(s) for s in np.argsort(-stamps) if int(s) not in protected]
            return order[:n]
    warm = [(0, [[1, 2], [3, 4]], "offload", 0), (1, [[5, 6]], "offload", 0)]
    ref, nat = make_caches(6, warm, n=2)
    a = make_plan(ref, 2, np.array([[7, 8, 9]]), "offload", 1.0, 1.0, eviction=MRU())
    b = make_decode_plan(nat, 2, np.array([[7, 8, 9]]), "offload", 1.0, 1.0, eviction=MRU())
    assert_same_plan(a, b)
    lru = make_decode_plan(nat, 2, np.array([[7, 8, 9]]), "offload", 1.0, 1.0)
    assert [s for _, s, *_ in b.fills] != [s for _, s, *_ in lru.fills]


split_step = st.tuples(st.integers(0, L - 1),
                       st.lists(st.integers(0, E - 1), min_size=1, max_size=8, unique=True))


@settings(max_examples=100, deadline=None)
@given(capacity=st.integers(0, 24), warmup=st.lists(warmup_step, max_size=8),
       steps=st.lists(split_step, min_size=1, max_size=8),
       policy=st.sampled_from(["hybrid", "offload", "cpu"]),
       bw=st.sampled_from([(38.6, 81.3, 47.5, 117.0), (48.0, 92.0, 42.0, 117.0), (1.0, 1.0, 1.0, 1.0),
                           (25.0, 50.0, 30.0, 60.0)]),
       behind=st.sampled_from([None, 0, 2]), cap=st.sampled_from([None, 1, 3]))
def test_native_decode_plan_with_a_miss_split(capacity, warmup, steps, policy, bw, behind, cap):
    """With a MissSplit (the runtime's way: q and the admissions from its tables, any step),
    the native plan equals make_plan's and the Python body's, step after step, and the books
    stay equal."""
    from freetoken.experts.split import MissBandwidths, MissSplit
    ref, nat, py = make_caches(capacity, warmup)
    split = MissSplit(policy, MissBandwidths(*bw), behind=behind, behind_max_misses=cap)
    for layer, ids in steps:
        ids = np.array([ids], dtype=np.int64)
        a = make_plan(ref, layer, ids, policy, 0.0, 0.0, split=split)
        b = make_decode_plan(nat, layer, ids, policy, 0.0, 0.0, split=split)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(plan_mod, "native_decode_plan", None)
            c = make_decode_plan(py, layer, ids, policy, 0.0, 0.0, split=split)
        assert_same_plan(a, b)
        assert_same_plan(c, b)
        assert len(b.behind) <= b.m - b.q and set(e for e, *_ in b.behind) <= set(b.cpu_experts)
        for cache, p in ((ref, a), (nat, b), (py, c)):
            apply_plan(cache, p)
        assert_same_books(ref, nat)
        assert_same_books(py, nat)
