"""GPU-resident control (experts/captured/control.py): the plan kernel against the host decode
planner, step for step, on random decode traffic, down to the CPU's route count the finish
kernel goes by (Triton's interpreter on the CPU when there is no GPU; skipped without
Triton)."""
import os

import numpy as np
import pytest
import torch

from freetoken.experts.captured import device_plan as device_step
from freetoken.experts.cache import ExpertCache
from freetoken.experts.plan import apply_plan, make_decode_plan, make_plan
from freetoken.experts.split import qstar

pytestmark = pytest.mark.skipif(
    not device_step.available() or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs Triton on cuda, or TRITON_INTERPRET=1")


class _Info:
    def __init__(self, E):
        self.num_experts, self.slot_stride = E, 64


class _Tables:
    """A split that hands the planner fixed (q_of_m, b_of_m) tables."""

    def __init__(self, q_of_m, b_of_m):
        self.q, self.b = q_of_m, b_of_m

    def tables(self, K):
        return tuple(self.q), tuple(self.b)

    def decide(self, m, free):
        q = max(0, min(self.q[m], free))
        return q, max(0, min(self.b[m], free - q))


def check_lists_and_count(box, plan, cpu, totals, where):
    """The mailbox's fill and admission lists equal the host plan's; the plan's counts added
    to totals (cpu: the routes the CPU runs, a bool array)."""
    fills = [(e, s) for e, s, _, _ in plan.fills]
    got = [(int(e), int(s)) for e, s in zip(box.fsrc_d.cpu(), box.fdst_d.cpu()) if e >= 0]
    assert got == fills, f"{where}: fills"
    admitted = [(e, s) for e, s, _, _ in plan.behind]
    got = [(int(e), int(s)) for e, s in zip(box.asrc_d.cpu(), box.adst_d.cpu()) if e >= 0]
    assert got == admitted, f"{where}: admissions"
    totals["behind"] += len(plan.behind)
    totals["hits"] += len(plan.hits)
    totals["misses"] += plan.m
    totals["fills"] += plan.q + len(plan.behind)
    totals["evictions"] += sum(1 for f in plan.fills + plan.behind if f[2] >= 0)
    totals["cpu_experts"] += len(plan.cpu_experts)
    totals["cpu_routes"] += int(cpu.sum())
    totals["device_routes"] += int((~cpu).sum())


# the default run's cells (conftest.py: the others are marked slow): each policy, a full cache,
# admissions, batches of 2, 4 and 8 routes per token
SUITE_CELLS = {
    "test_plan_kernel_matches_host_planner": [
        {"policy": "hybrid", "capacity": 12}, {"policy": "cpu", "capacity": 9},
        {"capacity": 40}, {"policy": "offload", "capacity": 5}, {"behind": 2}],
    "test_batched_plan_kernel_matches_host_planner": [
        {"policy": "hybrid", "capacity": 12}, {"policy": "cpu"}, {"capacity": 40},
        {"policy": "offload", "capacity": 30}],
    "test_plan_kernel_reads_the_slot_count_across_resizes": [{"policy": "hybrid", "behind": 2}],
}


@pytest.mark.parametrize("policy,capacity,behind", [
    ("hybrid", 12, 0), ("offload", 12, 0), ("cpu", 9, 0), ("hybrid", 40, 0), ("offload", 5, 0),
    ("hybrid", 12, 1), ("hybrid", 7, 2), ("cpu", 10, 3)])
def test_plan_kernel_matches_host_planner(policy, capacity, behind):
    """Same hits, fills (slots), admissions (--fill-behind N), CPU routes, books and counters."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    L, E, K, D = 3, 16, 4, 40
    infos = {l: _Info(E) for l in range(L)}
    host = ExpertCache(infos, capacity, "cpu", with_storage=False)
    q_of_m = [qstar(m, 25.0, 50.0, policy) for m in range(K + 1)]
    b_of_m = [min(behind, m - q) for m, q in enumerate(q_of_m)]
    split = _Tables(q_of_m, b_of_m)
    books = device_step.DeviceBooks(host, q_of_m, dev, b_of_m)
    books.push()
    box = device_step.Mailbox(K, D, dev)
    rng = np.random.default_rng(capacity)
    totals = dict.fromkeys(device_step.COUNTERS, 0)
    for step in range(60):
        layer = int(rng.integers(L))
        ids = rng.choice(E if step % 3 else 6, size=K, replace=False).astype(np.int64)  # some reuse
        w = rng.random(K).astype(np.float32)
        x = torch.randn(D, dtype=torch.bfloat16, device=dev)
        plan = make_decode_plan(host, layer, ids[None], policy, 25.0, 50.0, split=split)
        apply_plan(host, plan)
        raise_ready = step % 2 == 1  # the kernel's last store (the default)
        box.flags.zero_()
        device_step.plan_layer(books, box, layer, torch.from_numpy(ids).to(dev),
                               torch.from_numpy(w).to(dev), x, raise_ready=raise_ready)
        if dev == "cuda":
            torch.cuda.synchronize()
        assert box.flags.tolist() == [int(raise_ready), 0], f"step {step}: ready"
        route_slot = plan.route_slot.numpy()
        cpu = route_slot < 0
        assert np.array_equal(books.res.cpu().numpy(), host.res), f"step {step}: residency"
        assert np.array_equal(books.own.cpu().numpy(), host.own), f"step {step}: owners"
        assert np.array_equal(books.stamps.cpu().numpy(), host.stamps), f"step {step}: stamps"
        assert int(books.clock.item()) == host.clock
        assert np.array_equal(box.slot_d.cpu().numpy(), np.where(cpu, 0, route_slot))
        assert np.array_equal(box.wdev_d.cpu().numpy(), np.where(cpu, 0, w))
        assert np.array_equal(box.ids.numpy(), np.where(cpu, ids, -1))
        assert int(box.ncpu_d.item()) == int(cpu.sum())  # the finish kernel waits iff > 0
        assert int(box.seq) == int(box.seq_d.item()) == step + 1  # the mailbox's number
        assert np.array_equal(box.w.numpy(), w)
        assert torch.equal(box.x, x.float().cpu())
        check_lists_and_count(box, plan, cpu, totals, f"step {step}")
        host.check_integrity()
    assert books.pull() == totals
    assert totals["fills"] > 0 or (policy == "cpu" and not behind)
    assert totals["behind"] > 0 or not behind
    assert books.pull() == dict.fromkeys(totals, 0)  # zeroed



@pytest.mark.parametrize("policy,capacity,behind,K", [
    ("hybrid", 12, 0, 4), ("offload", 6, 0, 4), ("offload", 30, 0, 2), ("cpu", 9, 2, 4),
    ("hybrid", 7, 2, 4), ("hybrid", 40, 1, 8), ("offload", 16, 0, 8)])
def test_batched_plan_kernel_matches_host_planner(policy, capacity, behind, K):
    """Steps of T = 1 .. max tokens (R = T*K routes, the mailbox holding the most): per
    distinct expert the host planner's plan over the union (make_plan, as the cut step plans a
    batch; make_decode_plan for one token), experts shared across tokens (each planned once,
    filled by the most routes first), full caches, admissions: the same books, device and CPU
    routes per (token, k), fill and admission lists, tokens' x and counters. A smaller step
    after a larger one leaves no stale fill or admission behind in the lists."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    L, E, D = 2, 24, 24
    max_tokens = device_step.MAX_ROUTES // K if K == 8 else 4
    R_max = K * max_tokens
    infos = {l: _Info(E) for l in range(L)}
    host = ExpertCache(infos, capacity, "cpu", with_storage=False)
    q_of_m = [qstar(m, 25.0, 50.0, policy) for m in range(R_max + 1)]
    b_of_m = [min(behind, m - q) for m, q in enumerate(q_of_m)]
    split = _Tables(q_of_m, b_of_m)
    books = device_step.DeviceBooks(host, q_of_m, dev, b_of_m)
    books.push()
    box = device_step.Mailbox(K, D, dev, max_tokens)
    rng = np.random.default_rng(capacity * 10 + K)
    totals = dict.fromkeys(device_step.COUNTERS, 0)
    shared = 0
    for step in range(40):
        layer = int(rng.integers(L))
        T = int(rng.integers(1, max_tokens + 1)) if step % 4 else max_tokens
        pool = E if step % 3 else K + 2  # a small pool: tokens share experts
        ids = np.stack([rng.choice(pool, size=K, replace=False) for _ in range(T)]).astype(np.int64)
        shared += T * K - len(np.unique(ids))
        w = rng.random(T * K).astype(np.float32)
        x = torch.randn(T, D, dtype=torch.bfloat16, device=dev)
        planner = make_decode_plan if T == 1 else make_plan
        plan = planner(host, layer, ids, policy, 25.0, 50.0, split=split)
        apply_plan(host, plan)
        box.flags.zero_()
        device_step.plan_layer(books, box, layer, torch.from_numpy(ids.reshape(-1)).to(dev),
                               torch.from_numpy(w).to(dev), x.reshape(-1), raise_ready=True)
        if dev == "cuda":
            torch.cuda.synchronize()
        R = T * K
        route_slot = plan.route_slot.numpy()
        cpu = route_slot < 0
        where = f"step {step} (T={T})"
        assert box.flags.tolist() == [1, 0], where
        assert np.array_equal(books.res.cpu().numpy(), host.res), f"{where}: residency"
        assert np.array_equal(books.own.cpu().numpy(), host.own), f"{where}: owners"
        assert np.array_equal(books.stamps.cpu().numpy(), host.stamps), f"{where}: stamps"
        assert int(books.clock.item()) == host.clock
        assert np.array_equal(box.slot_d[:R].cpu().numpy(), np.where(cpu, 0, route_slot)), where
        assert np.array_equal(box.wdev_d[:R].cpu().numpy(), np.where(cpu, 0, w)), where
        assert np.array_equal(box.ids[:R].numpy(), np.where(cpu, ids.reshape(-1), -1)), where
        assert np.array_equal(box.w[:R].numpy(), w)
        assert int(box.ncpu_d.item()) == int(cpu.sum()) and int(box.tokens) == T
        assert torch.equal(box.x[:T * D], x.float().reshape(-1).cpu())
        check_lists_and_count(box, plan, cpu, totals, where)
        host.check_integrity()
    assert books.pull() == totals
    assert shared > 0
    assert totals["fills"] > 0 and totals["evictions"] > 0 or policy == "cpu"
    assert totals["behind"] > 0 or not behind
    assert totals["cpu_experts"] > 0 or policy == "offload"


@pytest.mark.parametrize("policy,behind", [("hybrid", 0), ("offload", 0), ("hybrid", 2)])
def test_plan_kernel_reads_the_slot_count_across_resizes(policy, behind):
    """Books sized once for the most slots a fixed-address cache takes (M = 30, cache.py), the
    slot count read from books.num_slots: across host resizes, each pushed as
    ExpertRuntime.resize_cache pushes it, the kernel keeps to the host planner, takes no slot
    >= the count, and leaves the tail unowned and stamped NEVER."""
    from slot_memory_support import HostSlotMemory
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    L, E, K, D, M = 3, 16, 4, 40, 30
    infos = {l: _Info(E) for l in range(L)}
    host = ExpertCache(infos, 12, "cpu", memory=HostSlotMemory(M * 64, 12 * 64))
    assert host.max_slots == M
    q_of_m = [qstar(m, 25.0, 50.0, policy) for m in range(K + 1)]
    b_of_m = [min(behind, m - q) for m, q in enumerate(q_of_m)]
    split = _Tables(q_of_m, b_of_m)
    books = device_step.DeviceBooks(host, q_of_m, dev, b_of_m)
    assert books.own.shape == (M, 2) and books.stamps.shape == (M,)
    books.push()
    box = device_step.Mailbox(K, D, dev)
    rng = np.random.default_rng(7 + behind)
    sizes = {20: 5, 40: 25, 60: 1, 70: 18}  # step -> slots from then on
    counts = dict.fromkeys(device_step.COUNTERS, 0)
    for step in range(90):
        if step in sizes:
            counts = {k: v + counts[k] for k, v in books.pull().items()}
            host.resize(sizes[step])
            books.push()
        C = host.capacity
        assert int(books.num_slots.item()) == C
        layer = int(rng.integers(L))
        ids = rng.choice(E if step % 3 else 6, size=K, replace=False).astype(np.int64)
        w = rng.random(K).astype(np.float32)
        x = torch.randn(D, dtype=torch.float32, device=dev)
        plan = make_decode_plan(host, layer, ids[None], policy, 25.0, 50.0, split=split)
        apply_plan(host, plan)
        device_step.plan_layer(books, box, layer, torch.from_numpy(ids).to(dev),
                               torch.from_numpy(w).to(dev), x, raise_ready=False)
        assert np.array_equal(books.res.cpu().numpy(), host.res), f"step {step}: residency"
        assert np.array_equal(books.own[:C].cpu().numpy(), host.own), f"step {step}: owners"
        assert np.array_equal(books.stamps[:C].cpu().numpy(), host.stamps), f"step {step}: stamps"
        assert (books.own[C:] == -1).all() and (books.stamps[C:] == device_step._NEVER).all()
        assert int(books.clock.item()) == host.clock
        moved = [int(s) for e, s in zip(box.fsrc_d.cpu(), box.fdst_d.cpu()) if e >= 0]
        moved += [int(s) for e, s in zip(box.asrc_d.cpu(), box.adst_d.cpu()) if e >= 0]
        assert moved == [s for _, s, _, _ in plan.fills + plan.behind], f"step {step}: fills"
        assert all(s < C for s in moved)
        host.check_integrity()
    counts = {k: v + counts[k] for k, v in books.pull().items()}
    assert counts["fills"] > 0 and (counts["behind"] > 0 or not behind)


def test_books_made_after_a_resize_of_a_plain_cache_fit_it():
    """The fallback's cache (no fixed-address memory: max_slots follows each resize) grown after
    start: books made for it then (the step is captured again) hold every slot."""
    infos = {l: _Info(16) for l in range(3)}
    host = ExpertCache(infos, 5, "cpu", with_storage=False)
    host.resize(20)
    assert host.max_slots == 20
    books = device_step.DeviceBooks(host, [0, 1, 2, 3, 4], "cpu")
    books.push()
    assert books.own.shape == (20, 2) and int(books.num_slots) == 20
