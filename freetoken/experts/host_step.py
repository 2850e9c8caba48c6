"""HostStep: a layer step planned on the host and run at once, for ExpertRuntime.forward
outside captured decode steps and streamed prefill layers: plan (plan.py) -> run (CPU part
submitted first, fills, device experts on hits and fresh fills) -> combine (device partial +
CPU partial, fp32).

On cuda the device part runs on the GPU, fills are async copies from pinned host banks on a
copy stream; on cpu the same plan, fills and combine run against a CPU tensor slot pool (the
"device tier"), so CI exercises all of it; with the native kernels the tier's experts run on
the kernel pool too, reading the slot pool as a bank (run_on_pool: small torch ops per expert
cost more than the experts themselves).

Shape legend: T tokens, K routes per token, R = T*K routes, D hidden.
"""
import numpy as np
import torch

from .bank import pool_bytes, pool_views
from .ffn import ExpertWeights, group_routes_on_device, run_expert_runs
from .plan import apply_plan, make_decode_plan, make_plan


class HostStep:
    """The host-planned layer step of one ExpertRuntime (its cache, filler, executor, books)."""

    def __init__(self, runtime):
        self.rt = runtime
        self.views = {}  # layer -> pool_views of the cache storage (made on first use)
        self.slot_weights = {}  # (layer, slot) -> (gate, up, down) views: no view ops per step

    def run(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, w_flat: torch.Tensor,
            out: torch.Tensor) -> None:
        """Adds the layer's routed experts into out fp32 [T, D]. x [T, D] compute dtype on the
        device; expert_ids [T, K] int64; w_flat [R] fp32 on the device."""
        rt = self.rt
        ids_h, w_h, x_h = self._to_host(x, expert_ids, w_flat)  # the step's one device sync
        planner = make_decode_plan if expert_ids.shape[0] == 1 else make_plan
        plan = rt.plan(planner, layer, ids_h)
        apply_plan(rt.cache, plan)
        if rt.tier_on_pool:  # cpu tier on the kernel pool: run and combine into `out`
            self._run_on_pool(layer, x, ids_h, plan, w_h, out)
            rt._count(plan)
            return
        cpu_job = self._submit_cpu(layer, x_h, plan, w_h)  # run: CPU part first, returns at once
        cpu_out = None
        if cpu_job is not None and not rt.is_cuda:
            cpu_out = cpu_job.wait()  # cpu tier: the cores are shared; do not oversubscribe them
        fill_done = rt.filler.fill(layer, plan)
        self._run_device(layer, x, plan, w_flat, out, fill_done)
        if cpu_job is not None:  # combine (pinned partial on cuda: an async copy)
            out += (cpu_out if cpu_out is not None else cpu_job.wait()).to(out.device, non_blocking=True)
        rt.filler.admit(layer, plan)  # the CPU job has ended: admissions, for later steps
        rt._count(plan)

    def run_resident(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor,
                     w_flat: torch.Tensor, out: torch.Tensor) -> None:
        """run() for a runtime holding every expert (all_resident), many tokens: every route a
        hit, so no plan on the host; the routes are grouped on the device (the one sync: the
        route counts), as a streamed prefill layer's, and run from their slots. The books as
        run() keeps them for an all-hit plan (hits touched in ascending expert order)."""
        rt = self.rt
        E, (T, K) = rt.infos[layer].num_experts, expert_ids.shape
        idx, counts, _ = group_routes_on_device(expert_ids, E)  # [2, R]; [E] the sync
        routed = np.flatnonzero(counts)
        slots = rt.cache.res[layer, routed].tolist()
        runs = [(self._slot_weights(layer, s), int(counts[e])) for e, s in zip(routed, slots)]
        run_expert_runs(x, idx, w_flat, out, runs, rt.dtype, act=rt.act, quant=rt.quant[layer])
        rt.cache.touch(slots)
        rt.cache.stats["hits"] += len(slots)
        rt._stats["hits"] += len(slots)
        rt._stats["device_routes"] += T * K

    def _to_host(self, x, expert_ids, w_flat):
        """Host copies of the layer's routing, for the planner and the CPU executor: numpy
        expert_ids [T, K] int64 and weights [R] fp32, and x as fp32 [T, D] (None when every
        expert is resident: the CPU never runs a route). cuda: non_blocking copies into pinned
        buffers, then one event sync: the only time the step waits for the device."""
        need_x = not self.rt.all_resident
        if not self.rt.is_cuda:
            return expert_ids.numpy(), w_flat.numpy(), x.to(torch.float32) if need_x else None
        ids_h = torch.empty(expert_ids.shape, dtype=torch.int64, pin_memory=True)
        w_h = torch.empty(w_flat.shape, dtype=torch.float32, pin_memory=True)
        ids_h.copy_(expert_ids, non_blocking=True)
        w_h.copy_(w_flat, non_blocking=True)
        x_h = None
        if need_x:
            x_h = torch.empty(x.shape, dtype=torch.float32, pin_memory=True)
            x_h.copy_(x.to(torch.float32), non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.rt.device))
        done.synchronize()
        return ids_h.numpy(), w_h.numpy(), x_h

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        """A small host index array on the compute device: async from pinned memory on cuda."""
        t = torch.from_numpy(a)
        if not self.rt.is_cuda:
            return t
        return t.pin_memory().to(self.rt.device, non_blocking=True)

    def _submit_cpu(self, layer, x_h, plan, w_h):
        """Hand the plan's CPU routes (token, expert, weight each) to the executor; None when
        there are none. x_h fp32 [T, D] and w_h [R] are the host copies (_to_host). The
        executor adds into a zeroed fp32 partial [T, D], pinned on cuda (async combine)."""
        if not plan.cpu_experts:
            return None
        route_ids = plan.route_ids.numpy()  # [R] grouped order
        pos = np.flatnonzero(plan.route_slot.numpy()[route_ids] < 0)  # CPU routes, grouped order
        experts = np.repeat(np.asarray(plan.experts, dtype=np.int64), plan.counts)[pos]
        partial = torch.zeros(x_h.shape, dtype=torch.float32, pin_memory=self.rt.is_cuda)
        return self.rt.executor.submit(layer, x_h, plan.token_ids.numpy()[pos], experts,
                                       w_h[route_ids[pos]], out=partial)

    def _run_device(self, layer, x, plan, w_flat, out, fill_done):
        """Experts on device slots: hits first (their weights are there), then fresh fills."""
        runs = [(s, e) for e, s in plan.hits] + [(s, e) for e, s, _, _ in plan.fills]
        if not runs:
            return
        starts = dict(zip(plan.experts, plan.starts()))
        count = dict(zip(plan.experts, plan.counts))
        sel = np.concatenate([np.arange(starts[e], starts[e] + count[e]) for _, e in runs])
        idx = self._to_device(np.stack([plan.token_ids.numpy()[sel], plan.route_ids.numpy()[sel]]))
        run_expert_runs(x, idx, w_flat, out, [(self._slot_weights(layer, s), count[e]) for s, e in runs],
                        self.rt.dtype, fill_done, first_fill=len(plan.hits), act=self.rt.act,
                        quant=self.rt.quant[layer])

    def _slot_weights(self, layer, slot):
        """ExpertWeights views of a cache slot read as `layer`'s layout (a quantized bank on
        cuda: each projection's bytes, bank.pool_bytes)."""
        w = self.slot_weights.get((layer, slot))
        if w is None:
            views = self.views.get(layer)
            if views is None:
                pool = pool_bytes if self.rt.quant[layer] is not None else pool_views
                views = self.views[layer] = pool(self.rt.cache.storage, self.rt.infos[layer])
            w = self.slot_weights[layer, slot] = ExpertWeights.of(views, slot)
        return w

    def _run_on_pool(self, layer, x, ids_h, plan, w_h, out):
        """cpu tier, kernel pool: the CPU routes (from the host bank), then the fills, then the
        tier's routes (from the slot pool), each one job adding into out fp32 [T, D]. Routes
        are passed in route order (r = t*K + k): the kernel groups them by expert itself."""
        rt = self.rt
        T, K = ids_h.shape
        x32 = x.to(torch.float32)
        slots = plan.route_slot.numpy()  # [R] route order, -1 = CPU
        on_cpu = slots < 0
        token_ids = np.repeat(np.arange(T, dtype=np.int32), K)  # [R]
        if plan.cpu_experts:
            rt.executor.submit(layer, x32, token_ids[on_cpu], ids_h.reshape(-1)[on_cpu],
                               w_h[on_cpu], out).wait()
        rt.filler.fill(layer, plan)
        rt.filler.admit(layer, plan)
        if len(plan.cpu_experts) < len(plan.experts):
            on_tier = ~on_cpu
            rt.executor.submit_slots(layer, x32, rt.cache.storage, token_ids[on_tier],
                                     slots[on_tier], w_h[on_tier], out).wait()
