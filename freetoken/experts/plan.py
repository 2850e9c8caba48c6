"""The plan of one MoE layer step as plain data: which routed experts hit the device cache,
which misses are filled into which slots (evicting whom), which run on the CPU, and where each
route is computed. make_plan decides without mutating anything; apply_plan commits it to the
cache's books (the bytes are moved later, by the runtime).

Shape legend: T tokens, K routes per token, R = T*K routes (route r = t*K + k), U distinct
routed experts. "Grouped order" is the order of group_routes (ffn.py): routes sorted by expert.
"""
from dataclasses import dataclass

import numpy as np
import torch

from .ffn import group_routes
from .policy import BaseEvictionPolicy, LRUPolicy
from .split import qstar

try:  # the native decode planner (cython/plan.pyx); without it, make_decode_plan's Python body
    from ..kernels import native_decode_plan
except ImportError:
    native_decode_plan = None


@dataclass
class MoEPlan:
    layer: int
    experts: list          # [U] distinct routed experts, ascending
    counts: list           # [U] routes per expert
    expert_slot: list      # [U] device slot that computes the expert, -1 = the CPU
    hits: list             # [(expert, slot)], ascending expert
    fills: list            # [(expert, slot, evicted_layer, evicted_expert)], -1 -1 = empty slot
    cpu_experts: list      # experts computed on the CPU, ascending
    token_ids: torch.Tensor  # [R] int64, grouped order: the token of each route
    route_ids: torch.Tensor  # [R] int64, grouped order: the route index t*K + k
    route_slot: torch.Tensor  # [R] int64, route order: device slot or -1 (CPU)
    m: int = 0             # misses
    q: int = 0             # misses filled
    behind: list = None    # [(expert, slot, evicted_layer, evicted_expert)]: CPU experts also
                           # copied into the cache after the fills, for later steps (fill-behind)

    def starts(self) -> list:
        """Offset of each expert's run of routes in grouped order."""
        out, s = [], 0
        for n in self.counts:
            out.append(s)
            s += n
        return out

    def __str__(self):
        fills = ", ".join(f"{e}->{s}" + (f" (evicts {el}:{ee})" if el >= 0 else "")
                          for e, s, el, ee in self.fills)
        return (f"MoEPlan(layer {self.layer}: {len(self.route_ids)} routes, {len(self.experts)} "
                f"experts; hits [{', '.join(f'{e}@{s}' for e, s in self.hits)}]; m={self.m} "
                f"q={self.q}; fills [{fills}]; cpu {self.cpu_experts})")


def make_plan(cache, layer: int, expert_ids, policy: str, P: float, C: float,
              eviction: BaseEvictionPolicy = None, behind: int = 0, split=None) -> MoEPlan:
    """Plan one layer step for expert_ids [T, K]. Hits: routed experts resident in `cache`.
    Of the m misses, q = qstar(m, P, C, policy, free slots) are filled: those with the most
    routes first, ties by lower expert id. Victims come from `eviction` (LRU by default) and
    never include this step's hits, so a step never evicts an expert it needs. The rest of the
    misses run on the CPU. Pure: the cache is read, not changed. expert_ids: a CPU tensor or a
    numpy array (the runtime hands the host copy it made once for the layer).
    behind: fill-behind: in a step that fills nothing (q = 0), up to this many of its misses
    (in the same order) are still copied into the cache, for later steps, while they run on
    the CPU in this one; the copy engine has nothing else to do in such a step (in every step
    it delays the next layers' fills: docs/MEASUREMENTS.md#admissions).

    split: a MissSplit (split.py) decides q and the admissions (`behind` experts, in any step)
    instead of policy / P / C / behind: what the runtime passes.

    Example: cache {5: slot 0}, capacity 2, expert_ids [[5, 2], [2, 7]], offload ->
    hits [(5, 0)], m=2, q=1 (one free slot), fills [(2, 1, -1, -1)] (2 has two routes),
    cpu [7], route_slot [0, 1, 1, -1].
    """
    eviction = eviction or LRUPolicy()
    g = group_routes(expert_ids)
    experts, counts = g.experts, g.counts
    slots = cache.lookup(layer, experts)
    hits = [(e, s) for e, s in zip(experts, slots) if s >= 0]
    misses = [(e, n) for e, n, s in zip(experts, counts, slots) if s < 0]
    m = len(misses)
    q, b = _split(m, cache.capacity - len(hits), policy, P, C, behind, split)
    misses.sort(key=lambda en: (-en[1], en[0]))
    to_fill = sorted(e for e, _ in misses[:q])
    victims = eviction.victims(cache.stamps, q + b, [s for _, s in hits])
    owners = cache.own[victims].tolist() if victims else []
    fills = [(e, s, el, ee) for e, s, (el, ee) in zip(to_fill, victims, owners)]
    later = sorted(e for e, _ in misses[q:q + b])
    behind_fills = [(e, s, el, ee) for e, s, (el, ee) in zip(later, victims[q:], owners[q:])]
    fill_slot = {e: s for e, s, _, _ in fills}
    expert_slot = [s if s >= 0 else fill_slot.get(e, -1) for e, s in zip(experts, slots)]
    cpu_experts = [e for e, s in zip(experts, expert_slot) if s < 0]
    route_slot = np.empty(len(g.expert_index), dtype=np.int64)  # [R] route order
    route_slot[g.route_ids.numpy()] = np.asarray(expert_slot, dtype=np.int64)[g.expert_index]
    return MoEPlan(layer, experts, counts, expert_slot, hits, fills, cpu_experts,
                   g.token_ids, g.route_ids, torch.from_numpy(route_slot), m, q, behind_fills)


def _split(m, free_slots, policy, P, C, behind, miss_split):
    """(q, b): by the MissSplit when there is one, else q by split.qstar and, in a step with
    q = 0, up to `behind` admissions."""
    if miss_split is not None:
        return miss_split.decide(m, free_slots)
    q = qstar(m, P, C, policy, free_slots=free_slots)
    return q, (min(behind, m, max(0, free_slots)) if q == 0 else 0)


def make_decode_plan(cache, layer: int, expert_ids, policy: str, P: float, C: float,
                     eviction: BaseEvictionPolicy = None, behind: int = 0, split=None) -> MoEPlan:
    """make_plan for one token (expert_ids [1, K], K distinct experts), the same plan with
    less work: no grouping (every expert has one route), misses filled in ascending expert
    order, plain lists (numpy's per-call cost dominates at K = 8). Anything else goes to
    make_plan. Runs once per MoE layer of a decode step.

    With the default LRU eviction the plan comes from the native planner (cython/plan.pyx,
    through kernels.py), equal to this function's Python body field by field: the body is the
    reference (the tests' oracle) and the fallback without the compiled modules; the native
    planner hands back to it whatever it does not plan itself (see its module)."""
    if native_decode_plan is not None and (eviction is None or type(eviction) is LRUPolicy):
        tables = split.tables(expert_ids.shape[-1]) if split is not None else None
        out = native_decode_plan(cache.res, cache.own, cache.stamps, expert_ids, layer, policy,
                                  P, C, cache.capacity, behind, tables)
        if out is not None:
            experts, expert_slot, hits, fills, cpu, m, q, behind_fills, tok, rid, rsl = out
            return MoEPlan(layer, experts, [1] * len(experts), expert_slot, hits, fills, cpu,
                           torch.from_numpy(tok), torch.from_numpy(rid), torch.from_numpy(rsl),
                           m, q, behind_fills)
    flat = np.asarray(expert_ids).reshape(-1).tolist()  # [K]
    K = len(flat)
    if expert_ids.shape[0] != 1 or len(set(flat)) != K:
        return make_plan(cache, layer, expert_ids, policy, P, C, eviction, behind, split)
    order = sorted(range(K), key=flat.__getitem__)  # route ids in grouped (ascending) order
    experts = [flat[r] for r in order]
    slots = cache.res[layer, experts].tolist()  # [K]
    hits = [(e, s) for e, s in zip(experts, slots) if s >= 0]
    miss_at = [j for j, s in enumerate(slots) if s < 0]
    m = len(miss_at)
    q, b = _split(m, cache.capacity - len(hits), policy, P, C, behind, split)
    victims = (eviction or LRUPolicy()).victims(cache.stamps, q + b, [s for _, s in hits])
    owners = cache.own[victims].tolist() if victims else []
    fills = [(experts[j], s, el, ee) for j, s, (el, ee) in zip(miss_at[:q], victims, owners)]
    behind_fills = [(experts[j], s, el, ee) for j, s, (el, ee) in
                    zip(miss_at[q:q + b], victims[q:], owners[q:])]
    expert_slot = list(slots)
    for j, s in zip(miss_at[:q], victims):
        expert_slot[j] = s
    route_slot = [0] * K  # route order
    for j, r in enumerate(order):
        route_slot[r] = expert_slot[j]
    return MoEPlan(layer, experts, [1] * K, expert_slot, hits, fills,
                   [experts[j] for j in miss_at[q:]], torch.from_numpy(np.zeros(K, dtype=np.int64)),
                   torch.from_numpy(np.array(order, dtype=np.int64)),  # (cheaper than torch.tensor)
                   torch.from_numpy(np.array(route_slot, dtype=np.int64)), m, q, behind_fills)


def apply_plan(cache, plan: MoEPlan) -> None:
    """Commit a plan to the cache's books: hits touched (ascending expert), then each fill
    assigned and touched in fill order, then the fill-behind ones; hit/miss counters advance."""
    cache.touch([s for _, s in plan.hits])
    for e, s, _, _ in plan.fills:
        cache.assign(s, plan.layer, e)
    cache.touch([s for _, s, _, _ in plan.fills])
    for e, s, _, _ in plan.behind or ():
        cache.assign(s, plan.layer, e)
    cache.touch([s for _, s, _, _ in plan.behind or ()])
    cache.stats["hits"] += len(plan.hits)
    cache.stats["misses"] += plan.m
