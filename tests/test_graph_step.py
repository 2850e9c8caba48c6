"""Captured decode steps (freetoken/graphs.py, experts/captured/graph_step.py) on tiny random models.

cpu: the inline step (the capture's structure run for real: static KV span with a mask, grouped
decode attention, gathered device experts, the host's part of each layer in place) equals the
eager decode step, logits and cache books, for every cache size x policy.
cpu, GPU-resident control (captured/control.py) run inline with its kernels in Triton's
interpreter: the same; the in-place Triton experts and the zero-copy gather there too; with
the slots in fixed-address memory (slot_memory_support.py), the step kept across expert cache
resizes (device books pushed at once, admissions off under the joins' line) equals eager decode
with the same resizes.
gpu: decode steps replayed from CUDA graphs equal the eager ones (logits, greedy tokens, the
cache books), across KV spans, and the cache stays consistent over long runs.
"""
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

import make_tiny_model as mtm
from freetoken.config import EngineConfig, Tuning
from freetoken.engine import Engine
from freetoken.graphs import StaticKV
from freetoken.sampling import SamplingParams

from fused_support import DEVICES  # cpu: Triton's interpreter; cuda: marked gpu

PROMPT = [5, 77, 300, 12, 9, 141, 250, 33, 61, 199, 8, 120, 45, 370, 17, 3, 99, 64]
CACHES = {"none": 0.0, "few": 0.125, "half": 0.5, "all": 1.0}

# the default run's cells of the interpreted grids (conftest.py: the others are marked slow): the
# host-planned steps all; under GPU-resident control each policy once and each family once, the
# admissions' deferring and joining branches once each
SUITE_CELLS = {
    "test_inline_step_equals_eager": [
        {"control": "host"},
        {"model_path": "qwen3_moe", "cache": "few", "policy": "hybrid", "control": "device"},
        {"model_path": "qwen3_moe", "cache": "half", "policy": "offload", "control": "device"},
        {"model_path": "qwen3_moe", "cache": "none", "policy": "cpu", "control": "device"},
        {"model_path": "qwen2_moe", "cache": "half", "policy": "hybrid", "control": "device"}],
    "test_inline_step_kept_across_fixed_address_resizes": [
        {"model_path": "qwen3_moe", "policy": "hybrid"}],
    "test_inline_step_with_admissions": [
        {"model_path": "qwen3_moe", "cache": "half", "behind": 1, "defer": 2},
        {"model_path": "qwen2_moe", "cache": "few", "behind": 2, "defer": 0}],
    "test_batched_inline_steps_equal_eager": [
        {"control": "host"},
        {"model_path": "qwen3_moe", "control": "device", "cache": "few"},
        {"model_path": "qwen2_moe", "control": "device", "cache": "half", "policy": "offload"}],
    "test_batched_inline_steps_with_admissions": [
        {"model_path": "qwen3_moe", "cache": "half", "behind": 1},
        {"model_path": "qwen2_moe", "cache": "few"}],
}


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe"])
def model_path(request, tmp_path_factory):
    return mtm.build_ftw(tmp_path_factory.mktemp(request.param), request.param, seed=3)[1]


def device_control_runs_on_cpu() -> bool:
    """Whether GPU-resident control runs on the cpu here: Triton, in its interpreter
    (conftest.py sets TRITON_INTERPRET=1 without CUDA; with CUDA the gpu tests hold it)."""
    from freetoken.config import triton_interpreted
    from freetoken.experts.captured import control
    return control.available() and triton_interpreted()


def force_host_planning(monkeypatch):
    """Captured steps take the host-planned form (cut_step.py), as where GPU-resident control
    cannot run (control.reason_off)."""
    from freetoken.experts.captured import control as device_step
    monkeypatch.setattr(device_step, "reason_off", lambda runtime: "the test plans on the host")


def engine(path, device="cpu", **options):
    return Engine(path, EngineConfig(device=device, dtype="fp32", ctx_size=64, **options))


def books(e):
    e.experts.sync_books()  # decode planned on the GPU keeps its books there
    c = e.experts.cache
    return c.res.copy(), c.stamps.copy()


def inline_decode(e, ids, prefill, control="host", between=None):
    """Logits of ids[prefill:] decoded one token at a time through GraphStep's inline mode,
    under GPU-resident control (control "device": Triton's interpreter on the cpu) or planned
    on the host. between(i, step): after the i-th decoded token (the step is fetched again
    for the next: a resize may drop it, as DecodeGraphs.reset does on cuda)."""
    t = torch.tensor(ids)
    with e.sequence(ids) as (_, seq_kv):
        e.model(t[:prefill], torch.arange(prefill), seq_kv)
        pos = torch.zeros(1, dtype=torch.int64)
        rows = []
        for i in range(prefill, len(ids)):
            step = e.experts.decode_graph_step()
            assert (step.control is not None) == (control == "device"), step.why_host
            pos.fill_(seq_kv.num_tokens)
            seq_kv.reserve(1)  # the page for pos (the graphs' forward reserves before a replay)
            e.experts.begin_step("decode", 1)
            step.begin("inline")
            try:
                kv = StaticKV(seq_kv, pos, 32, e.model_config.sliding_window)
                rows.append(e.model(t[i:i + 1], pos, kv, 1))
            finally:
                step.end()
            seq_kv.commit(1)
            if between is not None:
                between(i - prefill, step)
    return torch.cat(rows)


def eager_decode(e, ids, prefill, between=None):
    t = torch.tensor(ids)
    with e.sequence(ids) as (_, kv):
        e.model(t[:prefill], torch.arange(prefill), kv)
        rows = []
        for i in range(prefill, len(ids)):
            rows.append(e.forward(kv, t[i:i + 1]))
            if between is not None:
                between(i - prefill, None)
        return torch.cat(rows)


INLINE = ([(cache, policy, "host") for cache in CACHES
           for policy in ("hybrid", "offload", "cpu", "cpu+behind")]
          # GPU-resident control plans where some expert is not resident, without admissions
          + [(cache, policy, "device") for cache in ("none", "few", "half")
             for policy in ("hybrid", "offload", "cpu")])


@pytest.mark.parametrize("cache, policy, control", INLINE)
def test_inline_step_equals_eager(model_path, cache, policy, control, monkeypatch):
    """The inline step, planned on the host (cut_step.py) or under GPU-resident control
    (captured/control.py: the plan, zero-copy fill and finish kernels in Triton's interpreter
    on the cpu, the host serving the CPU routes through the mailboxes), equals eager decode."""
    if control == "host":
        force_host_planning(monkeypatch)
    elif not device_control_runs_on_cpu():
        pytest.skip("GPU-resident control on the cpu needs Triton and TRITON_INTERPRET=1")
    opts = dict(expert_cache_frac=CACHES[cache], policy=policy.split("+")[0],
                fill_behind=2 if policy.endswith("+behind") else None)
    with torch.no_grad():
        with engine(model_path, **opts) as e:
            ref = eager_decode(e, PROMPT, 4)
            ref_books, ref_stats = books(e), dict(e.experts.stats)
        with engine(model_path, **opts) as e:
            ours = inline_decode(e, PROMPT, 4, control)
            our_books, our_stats = books(e), dict(e.experts.stats)
            e.experts.cache.check_integrity()
    assert float((ours - ref).abs().max()) <= 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    assert (our_books[0] == ref_books[0]).all()
    if cache != "all":  # a cache holding every expert never evicts: its step keeps no LRU stamps
        assert (our_books[1] == ref_books[1]).all()
    for key in ("routes", "decode_routes", "hits", "misses", "fills", "fills_behind", "cpu_routes",
                "device_routes"):
        assert our_stats[key] == ref_stats[key], key
    if policy == "cpu+behind" and cache in ("few", "half"):  # q = 0 in every step
        assert our_stats["fills_behind"] > 0  # the fill-behind path really ran


@pytest.mark.parametrize("policy, storage", [("hybrid", "fixed"), ("offload", "plain")])
def test_inline_step_kept_across_fixed_address_resizes(model_path, policy, storage,
                                                       monkeypatch):
    """fixed: slots at a fixed address (the tests' stand-in for vmm.SlotMemory, whose unmapped
    bytes read as NaN): each resize keeps the decode step, its GPU-resident control and device
    books (run inline in Triton's interpreter), pushing the books at once: they equal the
    host's after every resize. plain (the fallback): each resize drops the step and a new one
    is made. Either way the logits and books equal eager decode with the same resizes."""
    from slot_memory_support import fixed_slots
    if not device_control_runs_on_cpu():
        pytest.skip("GPU-resident control on the cpu needs Triton and TRITON_INTERPRET=1")
    opts = dict(expert_cache_frac=0.5, policy=policy)
    ids = PROMPT + PROMPT[:6]

    def resizes(e, checks):
        total = e.memory_plan.num_experts
        stride = e.experts.cache.slot_stride
        sizes = {3: total // 4, 7: 3 * total // 4, 11: 2, 15: total // 2}

        def between(i, step):
            if i in sizes:
                e.resize_expert_cache((sizes[i] + 0.5) * stride / 1e9)
                assert e.experts.cache.capacity == sizes[i]
                checks(step)
        return between

    with torch.no_grad():
        with engine(model_path, **opts) as e:
            ref = eager_decode(e, ids, 4, resizes(e, lambda step: None))
            ref_books = books(e)
        made = fixed_slots(monkeypatch) if storage == "fixed" else None
        with engine(model_path, **opts) as e:
            rt = e.experts
            kept = []

            def checks(step):
                if storage == "plain":
                    assert rt.graph_step is None  # dropped: the next step is a new one
                    kept.append(step.control)
                    return
                assert rt.graph_step is step and step.control is not None  # kept, not rebuilt
                dev, c = step.control.books, rt.cache
                assert rt.books_on_device is dev  # pushed by the resize
                C = c.capacity
                assert int(dev.num_slots) == C
                assert torch.equal(dev.res, c.residency)
                assert torch.equal(dev.own[:C], c.owner) and (dev.own[C:] == -1).all()
                assert torch.equal(dev.stamps[:C], c.last_used)
                assert int(dev.clock) == c.clock
                kept.append(step.control)
            ours = inline_decode(e, ids, 4, "device", resizes(e, checks))
            our_books = books(e)
            rt.cache.check_integrity()
            assert len(kept) == 4
            if storage == "fixed":
                assert all(k is kept[0] for k in kept)
                assert rt.cache.storage.data_ptr() == made[0].buf.data_ptr()
                assert len(made) == 1
                assert made[0].nbytes == rt.cache.capacity * rt.cache.slot_stride
            else:
                assert len({id(k) for k in kept}) == 4  # a new control after each resize
    assert float((ours - ref).abs().max()) <= 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    assert (our_books[0] == ref_books[0]).all() and (our_books[1] == ref_books[1]).all()


@pytest.mark.parametrize("defer", [0, 2])
@pytest.mark.parametrize("behind", [1, 2])
@pytest.mark.parametrize("cache", ["few", "half"])
def test_inline_step_with_admissions(model_path, cache, behind, defer):
    """--fill-behind N under GPU-resident control run inline (cpu: Triton's interpreter, each
    admission gathered in place; with Tuning.admit_defer N the last N layers' at the next
    step's start, the last step's when the books are read): the same logits, books and stats
    as eager decode, and every resident slot (admitted ones too) holds its host expert."""
    if not device_control_runs_on_cpu():
        pytest.skip("GPU-resident control on the cpu needs Triton and TRITON_INTERPRET=1")
    opts = dict(expert_cache_frac=CACHES[cache], policy="cpu", fill_behind=behind,
                tuning=Tuning(admit_defer=defer))  # cpu: q = 0 in every step, each step admits
    with torch.no_grad():
        with engine(model_path, **opts) as e:
            ref = eager_decode(e, PROMPT, 4)
            ref_books, ref_stats = books(e), dict(e.experts.stats)
        with engine(model_path, **opts) as e:
            ours = inline_decode(e, PROMPT, 4, "device")
            adm = e.experts.decode_graph_step().control.admissions
            assert adm is not None
            assert len(adm.defer) == (0 if adm.join_each_layer else defer)
            if (cache, behind) == ("half", 1):  # 12 slots > 3 layers x (2 routes + 1): it defers
                assert len(adm.defer) == defer
            our_books, our_stats = books(e), dict(e.experts.stats)
            e.experts.cache.check_integrity()
            _resident_bytes_match(e)
    assert float((ours - ref).abs().max()) <= 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    assert (our_books[0] == ref_books[0]).all() and (our_books[1] == ref_books[1]).all()
    for key in ("hits", "misses", "fills", "fills_behind", "cpu_routes", "device_routes"):
        assert our_stats[key] == ref_stats[key], key
    assert our_stats["fills_behind"] > 0


def test_a_kept_step_admits_nothing_while_the_cache_needs_joins_it_lacks(model_path, monkeypatch):
    """Fixed-address slots, --fill-behind 1 under GPU-resident control run inline: the step is
    captured at 12 slots, without the admissions' joins before each layer's fills (admissions.py:
    12 > 3 layers x (2 routes + 1)); a shrink to 5 keeps it and turns its admissions off (the b
    table zeroed on the device), a grow to 16 turns them on again. Logits equal eager decode with
    the same resizes, and every resident slot holds its host expert."""
    if "qwen3_moe" not in str(model_path):
        pytest.skip("one family is enough (the suite's time): the rule is the runtime's")
    from slot_memory_support import fixed_slots
    if not device_control_runs_on_cpu():
        pytest.skip("GPU-resident control on the cpu needs Triton and TRITON_INTERPRET=1")
    opts = dict(expert_cache_frac=0.5, policy="cpu", fill_behind=1)  # cpu: each step admits
    ids = PROMPT + PROMPT[:6]
    sizes = {3: 5, 9: 16}

    def resizes(e, seen):
        stride = e.experts.cache.slot_stride

        def between(i, step):
            if i in sizes:
                e.resize_expert_cache((sizes[i] + 0.5) * stride / 1e9)
                seen.append((e.experts.stats["fills_behind"], step))
        return between

    with torch.no_grad():
        with engine(model_path, **opts) as e:
            ref = eager_decode(e, ids, 4, resizes(e, []))
        fixed_slots(monkeypatch)
        with engine(model_path, **opts) as e:
            assert e.experts.cache.capacity == 12
            seen = []
            ours = inline_decode(e, ids, 4, "device", resizes(e, seen))
            control = e.experts.graph_step.control
            assert all(step is e.experts.graph_step for _, step in seen)
            assert not control.admissions.join_each_layer
            assert int(control.books.btab.sum()) > 0  # on again at 16 slots
            end = e.experts.stats["fills_behind"]
            e.experts.cache.check_integrity()
            _resident_bytes_match(e)
    (small, _), (large, _) = seen
    assert small > 0 and large == small  # none admitted at 5 slots
    assert end > large  # admitted again at 16
    assert float((ours - ref).abs().max()) <= 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_static_kv_masks_the_span_and_window_and_pages():
    """Position 3 with pages of 2 slots, page table [3, 1, 0, 2]: page 1, row 1 = slot 3."""
    from freetoken.kv_cache import KVPages
    pages = KVPages(SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=2), 4, 2, "cpu",
                    torch.float32)
    table = SimpleNamespace(page_table=[3, 1, 0, 2])
    seq_kv = SimpleNamespace(pages=pages, page_size=2, table=table)
    pos = torch.tensor([3])
    kv = StaticKV(seq_kv, pos, 8, sliding_window=2)
    assert kv.attention_mask().tolist() == [[False, False, True, True, False, False, False, False]]
    assert kv.reserve(1) is pos and kv.slot.tolist() == [3]
    keys, values = kv.store(0, pos, torch.ones(1, 1, 2), 2 * torch.ones(1, 1, 2))
    assert keys.shape == (1, 8, 2) and float(keys[0, 3, 0]) == 1 and float(values[0, 3, 1]) == 2
    assert float(keys.sum()) == 2  # only slot 3 written
    kv = StaticKV(seq_kv, torch.tensor([4]), 8)
    kv.reserve(1)
    assert kv.slot.tolist() == [0]  # position 4: page 0, row 0
    keys, _ = kv.gather(keys, values)  # [KV, span, hd] in position order
    assert keys[0, :, 0].tolist() == [0, 0, 0, 1, 0, 0, 0, 0]


# ---- cuda ---------------------------------------------------------------------------------------

def cuda_decode(e, ids, prefill):
    """Teacher-forced decode on cuda through Engine._decode (graphs when the engine has them)."""
    t = torch.tensor(ids, device="cuda")
    with torch.no_grad(), e.sequence(ids) as (_, kv):
        e.forward(kv, t[:prefill])
        return torch.cat([e.decode(kv, t[i:i + 1]).clone()
                          for i in range(prefill, len(ids))]).cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("control", ["device", "host"])
@pytest.mark.parametrize("policy", ["hybrid", "offload", "cpu"])
@pytest.mark.parametrize("cache", CACHES)
def test_graph_decode_equals_eager_cuda(model_path, cache, policy, control, monkeypatch):
    """Graph decode under GPU-resident control (captured/control.py: plan on the GPU, the host
    serving CPU routes through mailboxes) and with the host planning between cuts: the same
    logits, tokens and cache books (slots and stamps) as eager decode."""
    if control == "host":
        force_host_planning(monkeypatch)
    ids = PROMPT * 3  # 54 tokens: crosses the span boundary at 32
    opts = dict(expert_cache_frac=CACHES[cache], policy=policy)
    with engine(model_path, "cuda", cuda_graphs=False, **opts) as e:
        ref, ref_books = cuda_decode(e, ids, 4), books(e)
    with engine(model_path, "cuda", **opts) as e:
        assert e.graphs is not None, e.graphs_off
        e.graphs.min_span = 32
        step = e.experts.decode_graph_step()
        if control != "host" and cache not in ("none", "all"):
            assert step.control is not None, step.why_host
        ours, our_books = cuda_decode(e, ids, 4), books(e)
        e.experts.cache.check_integrity()
        if cache not in ("none", "all") and policy != "cpu":  # (cpu: nothing is ever filled)
            _resident_bytes_match(e)
        assert len(e.graphs.captured) == 2  # spans 32 and 64
    assert float((ours - ref).abs().max()) <= 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    assert (our_books[0] == ref_books[0]).all()
    if cache != "all":
        assert (our_books[1] == ref_books[1]).all()


def test_defer_layers_takes_the_last_ones():
    """Tuning.admit_defer: the last N MoE layers (never the first), None half, 0 none."""
    from freetoken.experts.captured.admissions import defer_layers
    order = [1, 3, 5, 7, 9, 11, 13, 15]
    assert defer_layers(order, 3) == (11, 13, 15)
    assert defer_layers(order, None) == (9, 11, 13, 15)
    assert defer_layers(order, 0) == () and defer_layers(order[:3], None) == (5,)
    assert defer_layers(order[:1], None) == () and defer_layers(order[:1], 5) == ()
    assert defer_layers(order, 99) == tuple(order[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("defer", ["0", "1", "2"])
@pytest.mark.parametrize("behind", [1, 2])
@pytest.mark.parametrize("cache", ["few", "half"])
def test_graph_decode_with_admissions_cuda(model_path, cache, behind, defer, monkeypatch):
    """--fill-behind N under GPU-resident control (the admissions gathered on a side stream
    beside the step; with Tuning.admit_defer N the last N layers' at the next step's start):
    the same logits, tokens and books as eager decode, and every resident slot (admitted ones
    too, the last step's deferred ones once the books are read) holds its host expert."""
    ids = PROMPT * 3
    opts = dict(expert_cache_frac=CACHES[cache], policy="hybrid", fill_behind=behind,
                tuning=Tuning(admit_defer=int(defer)))
    with engine(model_path, "cuda", cuda_graphs=False, **opts) as e:
        ref, ref_books = cuda_decode(e, ids, 4), books(e)
    with engine(model_path, "cuda", **opts) as e:
        e.graphs.min_span = 32
        step = e.experts.decode_graph_step()
        assert step.control is not None and step.control.admissions is not None, step.why_host
        ctl = step.control.admissions
        assert len(ctl.defer) == (0 if ctl.join_each_layer else int(defer))
        if (cache, behind) == ("half", 1):  # 12 slots > 3 layers x (2 routes + 1): it defers
            assert len(ctl.defer) == int(defer)
        ours, our_books = cuda_decode(e, ids, 4), books(e)
        e.experts.cache.check_integrity()
        _resident_bytes_match(e)
        assert e.experts.stats["fills_behind"] > 0
    assert float((ours - ref).abs().max()) <= 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    assert (our_books[0] == ref_books[0]).all() and (our_books[1] == ref_books[1]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("defer", ["0", "2"])
@pytest.mark.parametrize("cache", ["few", "half"])
def test_graph_generate_long_run_cuda(model_path, cache, defer, monkeypatch):
    """Repeated generations (a prefill, host-planned, between them: deferred admissions
    land first) give eager decode's tokens and keep the cache consistent."""
    params = SamplingParams(temperature=0, max_tokens=40)
    opts = dict(expert_cache_frac=CACHES[cache], policy="hybrid",
                tuning=Tuning(admit_defer=int(defer)))
    with engine(model_path, "cuda", cuda_graphs=False, **opts) as e:
        ref = list(e.generate(PROMPT, params))
    with engine(model_path, "cuda", **opts) as e:
        for _ in range(3):  # repeated generations reuse the captured spans
            assert list(e.generate(PROMPT, params)) == ref
            e.experts.cache.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(0, 24), st.sampled_from(["hybrid", "offload", "cpu"]),
       st.integers(0, 2))
def test_decode_plan_equals_make_plan(seed, capacity, policy, behind):
    """make_decode_plan (one token) gives make_plan's plan, field by field, on caches in
    random states, with and without fill-behind; committing it leaves the same books. The
    fill-behind experts are CPU experts, on slots no hit or fill of the step uses."""
    import numpy as np
    from freetoken.experts.cache import ExpertCache
    from freetoken.experts.plan import apply_plan, make_decode_plan, make_plan

    class Info:
        num_experts, slot_stride = 8, 64
    rng = np.random.default_rng(seed)
    caches = [ExpertCache({layer: Info() for layer in range(3)}, capacity, with_storage=False)
              for _ in range(2)]
    for _ in range(12):
        layer = int(rng.integers(3))
        ids = rng.choice(8, size=(1, 4), replace=False)
        P, C = float(rng.uniform(1, 50)), float(rng.uniform(1, 50))
        a = make_plan(caches[0], layer, ids, policy, P, C, behind=behind)
        b = make_decode_plan(caches[1], layer, ids, policy, P, C, behind=behind)
        for field in ("experts", "counts", "expert_slot", "hits", "fills", "cpu_experts", "m", "q",
                      "behind"):
            assert getattr(a, field) == getattr(b, field), field
        assert len(a.behind) <= behind and {e for e, *_ in a.behind} <= set(a.cpu_experts)
        used = [s for _, s in a.hits] + [s for _, s, *_ in a.fills] + [s for _, s, *_ in a.behind]
        assert len(used) == len(set(used))
        if policy == "hybrid" and capacity >= 4:  # room for every route: behind is what it can be
            assert len(a.behind) == (min(behind, a.m) if a.q == 0 else 0)
        for field in ("token_ids", "route_ids", "route_slot"):
            assert getattr(a, field).tolist() == getattr(b, field).tolist(), field
        apply_plan(caches[0], a)
        apply_plan(caches[1], b)
    assert (caches[0].res == caches[1].res).all() and (caches[0].stamps == caches[1].stamps).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_triton_experts_equal_the_gather(dtype, device):
    """The in-place Triton experts (read each slot where it is, skip weight-0 routes) against
    the gather + batched matmul path, on an odd shape with projections not back to back (cpu:
    the kernels in Triton's interpreter, taken by hand: GatheredExperts takes them on cuda)."""
    from ftw.reader import BankInfo, ProjInfo
    from freetoken.experts.compute import triton_experts
    from freetoken.experts.compute.gathered import GatheredExperts
    assert triton_experts.available()
    tdt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    I, D, C, T = 40, 300, 6, 2
    size = torch.empty(0, dtype=tdt).element_size()
    n = I * D * size
    projs = (ProjInfo("gate", (I, D), 0, n), ProjInfo("up", (I, D), n + 64, n),
             ProjInfo("down", (D, I), 2 * n + 64, n))
    info = BankInfo(0, "blk.0.ffn_exps", 0, C, 3 * n + 192, dtype, projs, ())
    gen = torch.Generator().manual_seed(0)
    storage = torch.zeros(C, info.slot_stride, dtype=torch.uint8)
    for c in range(C):
        storage[c, :3 * n + 64].view(tdt)[:] = (torch.randn((3 * n + 64) // size, generator=gen) * 0.1).to(tdt)
    storage = storage.to(device)
    x = torch.randn(T, D, generator=gen).to(tdt).to(device)
    slots = torch.tensor([0, 3, 5, 2, 2, 1], device=device)
    w = torch.tensor([0.5, 0.0, 0.25, 1.0, 0.125, 0.3], device=device)
    ours = GatheredExperts(storage, {0: info})
    assert ours.use_triton == (device == "cuda")
    ours.use_triton = True
    ref = GatheredExperts(storage, {0: info})
    ref.use_triton = False  # the torch gather: the cpu device's path and the oracle
    a, b = ours.run(0, x, slots, w), ref.run(0, x, slots, w)
    tol = 1e-5 if dtype == "fp32" else 2e-2 * float(b.abs().max())
    assert float((a - b).abs().max()) <= tol


def _resident_bytes_match(e):
    """Every resident expert's slot holds its host bank bytes."""
    rt = e.experts
    rt.sync_books()
    storage = rt.cache.storage[:rt.cache.capacity].cpu()  # (fixed-address: the tail is unmapped)
    layers, experts = (rt.cache.res >= 0).nonzero()
    assert len(layers) > 0
    for layer, expert in zip(layers.tolist(), experts.tolist()):
        stride = rt.infos[layer].slot_stride
        host = rt.host[layer][expert * stride:(expert + 1) * stride]
        assert torch.equal(storage[rt.cache.res[layer, expert], :stride], host), (layer, expert)


@pytest.mark.gpu
@pytest.mark.parametrize("fills", ["auto", "copy"])
def test_captured_fills_land_in_their_slots_cuda(model_path, fills, monkeypatch):
    """Zero-copy fills inside B (the default on cuda with Triton) and copy-stream fills (the
    host-planned step's without Triton) leave every resident slot equal to its host expert,
    with the same tokens."""
    from freetoken.experts.transfer import zero_copy
    if fills == "copy":
        force_host_planning(monkeypatch)
        monkeypatch.setattr(zero_copy, "enabled", lambda device, cuda_graphs=True: False)
    params = SamplingParams(temperature=0, max_tokens=30)
    opts = dict(expert_cache_frac=0.125, policy="offload")
    with engine(model_path, "cuda", cuda_graphs=False, **opts) as e:
        ref = list(e.generate(PROMPT, params))
    with engine(model_path, "cuda", **opts) as e:
        assert list(e.generate(PROMPT, params)) == ref
        step = e.experts.decode_graph_step()
        assert step.zero_copy == (fills == "auto" and zero_copy.available())
        e.experts.cache.check_integrity()
        _resident_bytes_match(e)
        assert e.experts.stats["fills"] > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("programs", [None, 3])
def test_zero_copy_gather(programs, device):
    """zero_copy.gather from a host bank (pinned on cuda; cpu: Triton's interpreter), by one
    program per block or by a few looping programs (the admissions' background gather): only
    the listed slots change, -1 entries copy nothing, and (cuda) a captured graph replays with
    new indices."""
    from freetoken.experts.transfer import zero_copy
    assert zero_copy.available()
    E, C, stride = 6, 4, 4 * 5000 + 64  # a stride that is not a multiple of the block
    host = torch.randint(0, 255, (E * stride,), dtype=torch.uint8)
    if device == "cuda":
        host = host.pin_memory()
    storage = torch.zeros((C, stride + 128), dtype=torch.uint8, device=device)
    words = storage.view(torch.int32)
    src, dst = torch.tensor([4, -1, 1], device=device), torch.tensor([2, 0, 3], device=device)
    zero_copy.gather(zero_copy.host_words(host, E, stride), words, src, dst, stride,
                     programs=programs)
    if device == "cpu":
        got = storage
    else:
        torch.cuda.synchronize()
        got = storage.cpu()
    assert torch.equal(got[2, :stride], host[4 * stride:5 * stride])
    assert torch.equal(got[3, :stride], host[1 * stride:2 * stride])
    assert not got[0].any() and not got[1].any() and not got[2:, stride:].any()
    if device == "cpu":
        return  # (the replay below needs CUDA graphs)
    g = torch.cuda.CUDAGraph()
    src_h = torch.tensor([-1, -1, -1]).pin_memory()
    with torch.cuda.graph(g):
        src.copy_(src_h, non_blocking=True)
        zero_copy.gather(zero_copy.host_words(host, E, stride), words, src, dst, stride,
                         programs=programs)
    src_h.copy_(torch.tensor([-1, 5, -1]))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(storage[0, :stride].cpu(), host[5 * stride:6 * stride])


# ---- batched steps (graphs.DecodeGraphs.forward_batch: T = B tokens, the step cut for the host)

BATCH = [PROMPT, PROMPT[5:] + PROMPT[:3], PROMPT[::-1]]
SCHEDULE = [[0, 1, 2], [0], [0, 1, 2], [1, 2], [0, 1, 2], [2], [0, 1, 2]]  # rows per step
BATCH4 = BATCH + [PROMPT[7:] + PROMPT[:7]]
SCHEDULE4 = [[0, 1, 2, 3], [0], [0, 1], [0, 1, 2, 3], [2, 3], [1], [0, 1, 2, 3], [1, 3]]


def scheduled_decode(e, inline: bool, prefill: int = 6, device="cpu", control=None,
                     batch=BATCH, schedule=SCHEDULE):
    """Each of batch prefilled (its first `prefill` tokens), then a decode step per schedule
    entry over those rows (one forward for all of them), each row fed its next prompt token:
    eager (model.forward_batch on the sequences' KV) or through GraphStep's inline mode
    (StaticKV rows on static positions and page tables, T = the rows; under GPU-resident
    control where it runs: control "device" asserts every step is, "host" that none is); on cuda
    (not inline) the engine's own decode and decode_batch (graphs when it has them). Logits of
    every step, concatenated."""
    from freetoken.sequence import Sequence
    seqs = []
    for ids in batch:
        seq = Sequence.from_prompt(ids)
        e.kv_manager.admit(seq, use_cache=False)
        kv = e.sequence_kv(seq)
        e.forward(kv, torch.tensor(ids[:prefill], device=device))
        seqs.append((ids, kv))
    step = e.experts.decode_graph_step()
    pos = torch.zeros(len(batch), dtype=torch.int64)
    tables = torch.zeros(len(batch), 16, dtype=torch.int64)
    out = []
    for rows in schedule:
        tokens = torch.tensor([seqs[b][0][seqs[b][1].num_tokens] for b in rows], device=device)
        kvs = [seqs[b][1] for b in rows]
        if device != "cpu":
            out.append((e.decode_batch(tokens, kvs, [None] * len(kvs)) if len(rows) > 1
                        else e.decode(kvs[0], tokens)).clone())
            continue
        if not inline:
            out.append(e.model.forward_batch(tokens, kvs) if len(rows) > 1
                       else e.forward(kvs[0], tokens))
            continue
        static = []
        for j, kv in enumerate(kvs):
            pos[j] = kv.num_tokens
            kv.reserve(1)
            tables[j, :len(kv.table.page_table)] = torch.tensor(kv.table.page_table)
            static.append(StaticKV(kv, pos[j:j + 1], 32, e.model_config.sliding_window, tables[j]))
        e.experts.begin_step("decode", len(rows))
        step.begin("inline", T=len(rows))
        if control is not None:
            assert (step.control is not None and not step.needs_host) == (control == "device")
        try:
            out.append(e.model.forward_batch(tokens, static) if len(rows) > 1
                       else e.model(tokens, pos[:1], static[0], 1))
        finally:
            step.end()
        for kv in kvs:
            kv.commit(1)
    for _, kv in seqs:
        e.kv_manager.release(kv.table)
    return torch.cat(out).cpu()


@pytest.mark.parametrize("cache, policy, control", [
    ("few", "hybrid", "host"), ("half", "offload", "host"), ("all", "hybrid", "host"),
    ("none", "cpu", "host"), ("few", "hybrid", "device"), ("half", "hybrid", "device"),
    ("half", "offload", "device"), ("none", "cpu", "device")])
def test_batched_inline_steps_equal_eager(model_path, cache, policy, control, monkeypatch):
    """Batched steps of 1 to 3 sequences through the captured structure, planned on the host
    (the B tokens' union of experts: make_plan) or under GPU-resident control (the plan kernel
    over the B tokens' routes, the native server's per-token partials; Triton's interpreter on
    the cpu), equal eager batched decode: logits, cache books and counters."""
    if control == "host":
        force_host_planning(monkeypatch)
    elif not device_control_runs_on_cpu():
        pytest.skip("GPU-resident control on the cpu needs Triton and TRITON_INTERPRET=1")
    opts = dict(expert_cache_frac=CACHES[cache], policy=policy, kv_tokens=192)
    with torch.no_grad():
        with engine(model_path, **opts) as e:
            ref = scheduled_decode(e, inline=False)
            ref_books, ref_stats = books(e), dict(e.experts.stats)
        with engine(model_path, **opts) as e:
            ours = scheduled_decode(e, inline=True, control=control if cache != "all" else None)
            our_books, our_stats = books(e), dict(e.experts.stats)
            e.experts.cache.check_integrity()
            e.kv_manager.check_idle()
    assert float((ours - ref).abs().max()) <= 1e-4
    assert (our_books[0] == ref_books[0]).all()
    if cache != "all":
        assert (our_books[1] == ref_books[1]).all()
    for key in ("routes", "decode_routes", "hits", "misses", "fills", "cpu_routes", "device_routes"):
        if not (key == "hits" and cache == "all"):  # counted per route there (count_resident_step)
            assert our_stats[key] == ref_stats[key], key


@pytest.mark.parametrize("cache, behind, defer", [("half", 1, 2), ("few", 2, 0), ("half", 2, 1)])
def test_batched_inline_steps_with_admissions(model_path, cache, behind, defer):
    """--fill-behind N in batched steps under GPU-resident control (inline; cpu: Triton's
    interpreter), one-token steps between them deferring their last layers' admissions
    (Tuning.admit_defer) to the batched step after, which gathers them before its first plan:
    logits, books and stats of eager batched decode, and every resident slot (admitted ones
    too) holds its host expert."""
    if not device_control_runs_on_cpu():
        pytest.skip("GPU-resident control on the cpu needs Triton and TRITON_INTERPRET=1")
    opts = dict(expert_cache_frac=CACHES[cache], policy="cpu", fill_behind=behind, kv_tokens=192,
                tuning=Tuning(admit_defer=defer))  # cpu: q = 0 in every step, each step admits
    with torch.no_grad():
        with engine(model_path, **opts) as e:
            ref = scheduled_decode(e, inline=False)
            ref_books, ref_stats = books(e), dict(e.experts.stats)
        with engine(model_path, **opts) as e:
            ours = scheduled_decode(e, inline=True, control="device")
            our_books, our_stats = books(e), dict(e.experts.stats)
            e.experts.cache.check_integrity()
            _resident_bytes_match(e)
            e.kv_manager.check_idle()
    assert float((ours - ref).abs().max()) <= 1e-4
    assert (our_books[0] == ref_books[0]).all() and (our_books[1] == ref_books[1]).all()
    for key in ("routes", "hits", "misses", "fills", "fills_behind", "cpu_routes", "device_routes"):
        assert our_stats[key] == ref_stats[key], key
    assert our_stats["fills_behind"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("control", ["device", "host"])
@pytest.mark.parametrize("cache, policy", [("few", "hybrid"), ("half", "offload"), ("all", "hybrid"),
                                           ("none", "cpu")])
def test_batched_graph_decode_equals_eager_cuda(model_path, cache, policy, control, monkeypatch):
    """Batched decode steps replayed from graphs captured per batch size (1 to 3 rows; under
    GPU-resident control where it runs, else cut for the host's plan) equal eager batched
    decode: logits and cache books."""
    if control == "host":
        force_host_planning(monkeypatch)
    opts = dict(expert_cache_frac=CACHES[cache], policy=policy, kv_tokens=192, parallel=3)
    with torch.no_grad():
        with engine(model_path, "cuda", cuda_graphs=False, **opts) as e:
            ref, ref_books = scheduled_decode(e, False, device="cuda"), books(e)
        with engine(model_path, "cuda", **opts) as e:
            assert e.graphs is not None and e.graphs.max_batch == 3, e.graphs_off
            e.graphs.min_span = 32
            ours, our_books = scheduled_decode(e, False, device="cuda"), books(e)
            e.experts.cache.check_integrity()
            assert {B for B, _ in e.graphs.captured} == {1, 2, 3}
    assert float((ours - ref).abs().max()) <= 1e-4
    assert (our_books[0] == ref_books[0]).all()
    if cache != "all":
        assert (our_books[1] == ref_books[1]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("cache, policy, behind", [
    ("few", "hybrid", None), ("half", "hybrid", 1), ("half", "offload", None), ("none", "cpu", None)])
def test_batched_graphs_under_device_control_cuda(model_path, cache, policy, behind, monkeypatch):
    """Graphs captured at B = 1, 2 and 4 under GPU-resident control (each step one graph, no
    cut: the plan kernel over the B tokens' routes, the host serving their CPU routes) equal
    the same steps cut for the host's plan and eager batched decode: logits, greedy tokens,
    cache books."""
    opts = dict(expert_cache_frac=CACHES[cache], policy=policy, fill_behind=behind, kv_tokens=256,
                parallel=4)
    run = dict(inline=False, device="cuda", batch=BATCH4, schedule=SCHEDULE4)
    with torch.no_grad():
        with engine(model_path, "cuda", cuda_graphs=False, **opts) as e:
            ref, ref_books = scheduled_decode(e, **run), books(e)
        got = {}
        for control in ("device", "host"):
            with monkeypatch.context() as mp:
                if control == "host":
                    force_host_planning(mp)
                with engine(model_path, "cuda", **opts) as e:
                    assert e.graphs is not None and e.graphs.max_batch == 4, e.graphs_off
                    assert (e.graphs.step.control is not None) == (control == "device")
                    e.graphs.min_span = 32
                    got[control] = scheduled_decode(e, **run), books(e)
                    e.experts.cache.check_integrity()
                    assert {B for B, _ in e.graphs.captured} == {1, 2, 4}
                    if control == "device":  # one graph per step: no cut at the routers
                        assert all(len(segments) == 1 for segments, _, _ in e.graphs.captured.values())
    for control, (ours, our_books) in got.items():
        assert float((ours - ref).abs().max()) <= 1e-4, control
        assert (ours.argmax(-1) == ref.argmax(-1)).all(), control
        assert (our_books[0] == ref_books[0]).all() and (our_books[1] == ref_books[1]).all(), control


@pytest.mark.gpu
def test_batched_greedy_on_cuda_equals_alone(model_path):
    """Four requests through the scheduler on cuda (graphs per batch size, under GPU-resident
    control): each one's greedy tokens equal its own alone."""
    params = SamplingParams(temperature=0, max_tokens=12)
    with engine(model_path, "cuda", expert_cache_frac=0.25, parallel=4) as e:
        alone = [list(e.generate(ids, params)) for ids in BATCH4]
        reqs = [e.submit(ids, params) for ids in BATCH4]
        while not all(r.finished for r in reqs):
            e.step()
        assert [r.take() for r in reqs] == alone
        e.kv_manager.check_idle()


@pytest.mark.gpu
def test_decode_beside_a_streamed_prefill_cuda(model_path):
    """A sequence decoding while another's prompt streams its expert layers: its steps run
    between the prefill's MoE layers (graphs under GPU-resident control, the plan's q and b
    tables zeroed: nothing filled or admitted while the link streams), and both requests' greedy
    tokens equal their own alone."""
    params = SamplingParams(temperature=0, max_tokens=10)
    long_prompt = (PROMPT * 3)[:40]
    with engine(model_path, "cuda", expert_cache_frac=0.25, parallel=2, prefill_chunk=64,
                tuning=Tuning(prefill_choice="stream")) as e:
        short_alone = list(e.generate(PROMPT, params))
        long_alone = list(e.generate(long_prompt, params))
        e.kv_manager.radix.evict(e.kv_manager.num_evictable_pages)
        short = e.submit(PROMPT, params)
        e.step()
        first = short.take()
        long = e.submit(long_prompt, params)
        before = dict(e.experts.stats)
        e.step()
        during = short.take()
        after = dict(e.experts.stats)
        assert len(during) >= 2
        assert after["prefill_layers_streamed"] > before["prefill_layers_streamed"]
        assert after["fills"] == before["fills"] and after["fills_behind"] == before["fills_behind"]
        assert after["cpu_experts"] > before["cpu_experts"]
        while not e.scheduler.idle:
            e.step()
        assert first + during + short.take() == short_alone
        assert long.take() == long_alone
        e.experts.cache.check_integrity()
        e.kv_manager.check_idle()
