"""ExpertRuntime: the routed experts of every MoE layer, wherever they live. Each layer step
is route (done by the model) -> plan (plan.py) -> run (CPU part submitted first, fills, device
experts on hits and fresh fills) -> combine (device partial + CPU partial, fp32): planned on
the host and run at once (host_step.py), or captured in a decode step's graph (graph_step.py).
Prefill steps with many tokens stream whole expert layers instead (prefill/path.py,
stream.py). Owns the cache, the split of misses and the counters.

On cuda the device part runs on the GPU; on cpu the same cache, plan, fills and combine run
against a CPU tensor slot pool (the "device tier"), so CI exercises all of it.

Shape legend: T tokens, K routes per token, R = T*K routes, D hidden.
"""
import threading
from contextlib import contextmanager

import numpy as np
import torch

from .transfer import zero_copy
from .compute import triton_experts
from .compute.quant_blocks import QuantSpec
from .bank import bank_tensor
from .cache import ExpertCache, cache_capacity, create_slot_memory
from .executor import create_executor
from .transfer.fills import SlotFiller
from .host_step import HostStep
from .ffn import check_act
from .prefill.path import PrefillPath
from .split import ExpertRates, MissSplit, default_rates

from .reference import DenseReferenceExperts, resolve_dtype
from ..errors import ConfigError

# Hybrid decode on cuda admits by default (captured steps: GPU-resident control, zero-copy):
# one CPU-run miss per layer step, in steps of at most 3 misses, copied into the cache by a
# background gather (admissions.py) so later tokens hit it. The cap keeps admissions out of
# steps whose own fills keep the link busy (uniform routing, where they cannot raise the hit
# rate); 1/3 beat 1/4 in 11 of 12 pairs over three H200 runs (docs/MEASUREMENTS.md#admissions)
DEFAULT_FILL_BEHIND = 1
DEFAULT_FILL_BEHIND_MAX_MISSES = 3


def admissions(fill_behind, cap, policy: str, background_gather: bool) -> tuple:
    """(behind, max_misses) for MissSplit: --fill-behind N as given (cap, the tuning's
    fill_behind_max_misses, limits the steps it runs in), else the default where admissions run
    as a background gather (cuda with Triton) and the policy is hybrid, else (None, None): none."""
    if fill_behind is None and background_gather and policy == "hybrid":
        fill_behind = DEFAULT_FILL_BEHIND
        cap = DEFAULT_FILL_BEHIND_MAX_MISSES if cap is None else cap
    return fill_behind, None if cap is None else int(cap)


STAT_KEYS = ("steps", "routes", "prefill_routes", "decode_routes", "hits", "misses", "fills",
             "fills_behind",
             "bytes_filled", "evictions", "device_routes", "cpu_routes", "cpu_experts",
             "prefill_layers_streamed", "bytes_streamed", "prefill_layers_slot",
             "prefill_copies_sunk", "preloaded")


class _ThisForward(threading.local):
    """The forward each thread is in (the scheduler's decode thread runs its steps beside the
    prefill forward of another thread: scheduler.py, tuning decode_beside "thread")."""

    def __init__(self):
        self.phase, self.num_tokens, self.routes_key = "decode", 0, "decode_routes"
        self.link_busy = False  # a decode step beside a streamed prefill forward (beside_prefill)
        self.beside_thread = False  # a prefill forward with a decode thread beside it


class ExpertRuntime:
    """Contract: docs/INTERFACES.md section 6. forward() returns sum_k w[t,k] * expert(x[t])
    with every route computed exactly once, on the device tier or on the CPU.

    Prefill streaming is used when the step's phase is 'prefill' and T >= prefill_min_tokens
    (default ceil(E / K): enough routes to touch most of a layer), per MoE layer where it pays
    (prefill/choice.py: from the layer's routed experts, its misses and the measured
    bandwidths; tuning prefill_choice auto|stream|slot, default auto on cuda, stream on the cpu
    device whose bandwidths are placeholders). NOTE the cache rule: a streamed layer never
    changes the cache: prefill does not warm it (a long prompt would sweep it layer by layer,
    leaving only the last layers resident); decode warms it. A prefill layer that takes the
    slot path plans, fills and evicts like any step (that is what the slot path is): a short
    chunk does warm the cache. A cache that holds every expert is filled once at
    start (counted as `preloaded` and as fills) and then nothing is ever streamed or missed.
    On the cpu device with no cache (no device tier) nothing is streamed either: the plain CPU
    engine runs every route on the CPU executor. The streaming itself: self.prefill
    (prefill/path.py); streamer, prefill_choice, stream_prefill, prefill_min_tokens, streaming
    and prefill_mode read through to it.
    """

    def __init__(self, banks: dict, model_config, engine_config, device, dtype,
                 executor=None, capacity=None, rates: ExpertRates = None):
        """rates: the stored profile's (the engine reads it: profile.expert_rates); None: the
        defaults (split.default_rates)."""
        self.act = check_act(model_config)  # kernel_args.ExpertAct
        self.banks = banks
        self.infos = {layer: b.info for layer, b in banks.items()}
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype)
        self.policy = engine_config.policy
        self.is_cuda = self.device.type == "cuda"
        if capacity is None:
            capacity = cache_capacity(engine_config, self.infos, self.device)
        # cuda: the slots at a fixed address where the driver allows it, chosen once; the
        # engine's memory plan prints storage_info
        memory, self.storage_info = create_slot_memory(self.infos, capacity, self.device)
        self.cache = ExpertCache(self.infos, capacity, self.device, memory=memory)
        self.host = {layer: bank_tensor(b) for layer, b in banks.items()}  # uint8, pinned on cuda
        self.tuning = tuning = engine_config.tuning
        self.rates = rates = rates or default_rates(self.device.type)
        bw = rates.miss
        self.P, self.C = bw.P, bw.C
        # the split of each step's misses, and admissions behind it (split.py). Fill-behind
        # (--fill-behind N) fixes the admissions at N per step; by default hybrid on cuda with
        # Triton (the background gather) admits DEFAULT_FILL_BEHIND in steps of at most
        # DEFAULT_FILL_BEHIND_MAX_MISSES misses (above; eager steps too, as copies, so that eager
        # and captured decode plan alike); none by default on the cpu device, where a "fill" is
        # a memcpy on the same cores the experts need
        fb, max_misses = admissions(engine_config.fill_behind, tuning.fill_behind_max_misses,
                                    self.policy, self.is_cuda and zero_copy.available())
        self.fill_behind = 0 if fb is None else fb
        self.split = MissSplit(self.policy, bw, behind=fb, behind_max_misses=max_misses)
        fills = "zero-copy" if zero_copy.enabled(self.device, engine_config.cuda_graphs) else "copy"
        self.split_info = self._split_info(capacity, rates, fills)
        self.executor = executor or create_executor(
            banks, tuning.cpu_experts, engine_config.cpu_threads, self.is_cuda, self.act)
        self.top_k = max(1, model_config.num_experts_per_tok)
        # cpu tier + native kernels: the tier's experts run on the kernel pool too, reading the
        # slot pool as a bank (small torch ops per expert cost more than the experts themselves)
        self.tier_on_pool = (not self.is_cuda and hasattr(self.executor, "submit_slots")
                             and not tuning.tier_torch)
        _refuse_quantized_tier(self.infos, capacity, self.tier_on_pool, self.is_cuda)
        # quantized banks as the device kernels read them (compute/quant_blocks.py); the cpu
        # device's tier reads its quantized slots with the native kernels instead
        self.quant = {layer: QuantSpec.of(info) if self.is_cuda else None
                      for layer, info in self.infos.items()}
        self.all_resident = capacity == self.cache.num_experts_total and capacity > 0
        self._stats = dict.fromkeys(STAT_KEYS, 0)
        # the counters a decode thread and a prefill forward both add to (routes, steps,
        # device_routes) are added under it: prefill_beside_thread
        self.stats_lock = threading.Lock()
        self.prefill = PrefillPath(self, engine_config)  # streamer + per-layer choice
        self.filler = SlotFiller(self.cache, self.infos, banks, self.host, self.device)
        # this thread's forward: phase, num_tokens, phase_routes_key (the stats key of its phase),
        # link_busy, beside_thread below read it
        self._this = _ThisForward()
        self.host_step = HostStep(self)  # the host-planned step (host_step.py)
        self.graph_step = None  # graph_step.GraphStep once a decode step is captured (cuda)
        # control.DeviceBooks while captured decode steps plan on the GPU (their books are
        # then the truth; sync_books brings them back), else False
        self.books_on_device = False
        if self.all_resident:
            self._preload()

    # this thread's forward (_ThisForward)
    phase = property(lambda self: self._this.phase)
    num_tokens = property(lambda self: self._this.num_tokens)
    phase_routes_key = property(lambda self: self._this.routes_key)
    link_busy = property(lambda self: self._this.link_busy,
                         doc="this thread's step runs beside a streamed prefill (beside_prefill)")

    # the prefill path's state, read through (tools, tests, the bench read these names)
    streamer = property(lambda self: self.prefill.streamer, doc="stream.LayerStreamer or None")
    prefill_choice = property(lambda self: self.prefill.choice, doc="prefill_choice.PrefillChoice")
    stream_prefill = property(lambda self: self.prefill.enabled, doc="tuning prefill_stream")
    prefill_min_tokens = property(lambda self: self.prefill.min_tokens,
                                  doc="tuning prefill_stream_min_tokens")
    streaming = property(lambda self: self.prefill.streaming, doc="this forward may stream")
    prefill_mode = property(lambda self: self.prefill.mode, doc="this forward's: stream|slot|auto")

    # ---- the step -------------------------------------------------------------------------

    @property
    def capturing(self) -> bool:
        """True while graphs.py runs the model's forward to capture a decode step on this
        thread (a prefill forward on another runs as it would)."""
        g = self.graph_step
        return g is not None and g.mode is not None and g.thread == threading.get_ident()

    def decode_graph_step(self):
        """The GraphStep that captures and replays decode steps (cuda only)."""
        if self.graph_step is None:
            from .captured.graph_step import GraphStep
            self.graph_step = GraphStep(self)
        return self.graph_step

    def begin_step(self, phase: str, num_tokens: int) -> None:
        """Called once per model forward, before its first layer (and by graphs.py once per
        replayed step; the capture's own forwards are not counted)."""
        if self.capturing:
            return
        this = self._this
        this.phase, this.num_tokens = phase, num_tokens
        this.routes_key = f"{phase}_routes"  # once per forward, not per layer
        with self.stats_lock:
            self._stats["steps"] += 1
        # whether this forward streams (prefill/path.py); beside a decode thread every layer
        self.prefill.begin(phase, num_tokens, only_stream=this.beside_thread)

    def forward(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        """x [T, D] compute dtype on the device; expert_ids [T, K] int64; weights [T, K] fp32."""
        if self.capturing:
            return self.graph_step.forward(layer, x, expert_ids, weights)
        if self.books_on_device and not self._this.beside_thread:
            self.sync_books()  # (a streamed layer beside the decode thread reads no books)
        T, K = expert_ids.shape
        self.count_routes(T * K)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, D]
        if T == 0:
            return out.to(x.dtype)
        w_flat = weights.reshape(-1).to(device=x.device, dtype=torch.float32)  # [R]
        if self.prefill.streaming and self.prefill.run(layer, x, expert_ids, w_flat, out):
            return out.to(x.dtype)
        if self.all_resident and T > 1 and not self.tier_on_pool:
            self.host_step.run_resident(layer, x, expert_ids, w_flat, out)  # no plan: every route hits
            return out.to(x.dtype)
        self.host_step.run(layer, x, expert_ids, w_flat, out)  # planned on the host (host_step.py)
        return out.to(x.dtype)

    def plan(self, planner, layer, ids_h):
        """The layer step's plan (make_plan / make_decode_plan) by the split; beside a prefill
        forward (link_busy) no fill and no admission: every miss on the CPU."""
        if self.link_busy:
            return planner(self.cache, layer, ids_h, "cpu", self.P, self.C)
        return planner(self.cache, layer, ids_h, self.policy, self.P, self.C,
                       behind=self.fill_behind, split=self.split)

    @contextmanager
    def beside_prefill(self):
        """Decode steps run beside a streamed prefill forward in flight: between its layers on
        its thread (the scheduler's hook, MoETransformer.forward's between), or on a thread of
        their own (prefill_beside_thread). The forward's phase and streaming state are kept for
        its next layers, and the steps fill nothing and admit nothing (the link is the
        prefill's): their misses run on the CPU, their hits on the device."""
        this, prefill = self._this, self.prefill
        saved = (this.phase, this.num_tokens, this.routes_key, prefill.streaming, prefill.mode)
        control = self.graph_step.control if self.graph_step is not None else None
        this.link_busy = True
        if control is not None:
            control.link_busy(True)
        try:
            yield
        finally:
            this.link_busy = False
            if control is not None:
                control.link_busy(False)
            this.phase, this.num_tokens, this.routes_key, prefill.streaming, prefill.mode = saved

    def streams_every_layer(self, num_tokens: int) -> bool:
        """Whether a prefill forward of num_tokens tokens may stream every MoE layer (what
        prefill_beside_thread asks of it): the streamer on, not every expert resident, enough
        tokens and a choice that is not slot."""
        p = self.prefill
        return (p.streamer is not None and not self.all_resident
                and p.choice.forward_mode(num_tokens, self.infos, self.cache.capacity) != "slot")

    @contextmanager
    def prefill_beside_thread(self):
        """Around a prefill forward (streams_every_layer) while a decode thread runs its steps
        beside it (scheduler.py, tuning decode_beside "thread"). Every MoE layer streams (the
        per-layer choice is not made: a slot-path layer would fill and evict slots that the
        decode thread reads), so the forward changes no book of the cache and reads none: the
        decode thread's steps own them (GPU-resident books included: this thread does not sync
        them back). NOTE the other shared parts: the CPU expert pool serves one job at a time
        (kernels.CpuExpertPool: a job holds it from submit to wait); the counters both threads
        add to go under stats_lock."""
        self._this.beside_thread = True
        try:
            yield
        finally:
            self._this.beside_thread = False

    # ---- books ----------------------------------------------------------------------------

    @property
    def stats(self) -> dict:
        """The runtime's counters (STAT_KEYS), with the GPU-planned steps' folded in."""
        if self.books_on_device:
            self.sync_books()
        return self._stats

    def sync_books(self) -> None:
        """After decode steps planned on the GPU (captured/control.py): their books and counters back
        to the host (a device sync). Called before any host plan; call it before reading stats."""
        books = self.books_on_device
        if not books:
            return
        self.books_on_device = False
        control = self.graph_step.control if self.graph_step is not None else None
        if control is not None:
            control.flush()  # admissions a step deferred to the next land first
        n = books.pull()
        s = self._stats
        with self.stats_lock:
            for k in ("hits", "misses", "fills", "evictions", "cpu_experts"):
                s[k] += n[k]
            s["fills_behind"] += n["behind"]
            s["cpu_routes"] += n["cpu_routes"]
            s["device_routes"] += n["device_routes"]
            s["bytes_filled"] += n["fills"] * self.cache.slot_stride

    def count_routes(self, n: int) -> None:
        key = self._this.routes_key
        with self.stats_lock:
            self._stats["routes"] += n
            self._stats[key] = self._stats.get(key, 0) + n

    def count_resident_step(self, T: int) -> None:
        """The books of a replayed decode step when every expert is resident (no plan runs):
        every route a hit on the device. T = 1: the K routes are K distinct experts; a batched
        step (T > 1) counts each route as a hit (which routes share an expert is not known on
        the host without a sync, and none is worth it here)."""
        n = T * self.top_k * len(self.banks)  # every route of every MoE layer
        self.count_routes(n)
        with self.stats_lock:
            self._stats["hits"] += n
            self._stats["device_routes"] += n
        self.cache.stats["hits"] += n

    def _count(self, plan):
        s = self._stats
        num_cpu = int(np.count_nonzero(plan.route_slot.numpy() < 0))
        s["hits"] += len(plan.hits)
        s["misses"] += plan.m
        moved = list(plan.fills) + list(plan.behind or ())
        s["fills"] += len(moved)
        s["fills_behind"] += len(moved) - len(plan.fills)
        s["evictions"] += sum(1 for f in moved if f[2] >= 0)
        s["bytes_filled"] += len(moved) * self.infos[plan.layer].slot_stride
        s["cpu_routes"] += num_cpu
        s["cpu_experts"] += len(plan.cpu_experts)
        with self.stats_lock:
            s["device_routes"] += len(plan.route_slot) - num_cpu

    def keeps_captured(self, capacity: int) -> bool:
        """Whether the captured decode steps stay valid across resize_cache(capacity): the slots
        at a fixed address (cache.fixed_address), a cache on both sides (a step captured with
        none runs no device experts) and not one that held every expert (its step has no
        plan). NOTE the admissions' joins (admissions.py) are fixed in the step too: see
        _admit_after_resize."""
        c = self.cache
        return bool(c.fixed_address and c.capacity and capacity and not self.all_resident)

    def _admit_after_resize(self, control) -> None:
        """A kept step under GPU-resident control with admissions: a step captured without the
        joins before each layer's fills (a large cache) admits nothing while the cache is small
        enough to need them (a slot admitted in a step could be taken again in it, under the
        admission's copy); one captured with them is right at any size."""
        adm = control.admissions
        if adm is not None:
            # (batched steps' joins scale with T: judged at the largest T a step may have)
            control.admit(adm.join_each_layer
                          or not adm.joins_each_layer(self.cache.capacity, adm.max_tokens))

    def resize_cache(self, capacity: int) -> int:
        """At a safe point between steps: the cache becomes `capacity` slots (ExpertCache.resize:
        shrink evicts LRU residents and releases their memory, grow adds empty slots, filled by
        later misses); returns the residents evicted. On cuda the GPU-resident books come back
        first; then where keeps_captured(capacity) the captured step stays (the slots keep their
        address, and the device books are pushed at once, the slot count with them), else it
        is dropped (it holds the old slots; the engine's DecodeGraphs.reset recaptures on the
        next step). Results are unchanged: where a route runs never changes what it computes."""
        _refuse_quantized_tier(self.infos, capacity, self.tier_on_pool, self.is_cuda)
        keep = self.keeps_captured(capacity)
        self.sync_books()
        if not keep:
            self.graph_step = None  # its gathered experts and GPU books view the old slots
        if self.is_cuda:
            torch.cuda.synchronize(self.device)  # no kernel or copy still reads them
        # cached views of the old storage; a grown cache fills on demand, never preloaded again
        self.host_step.views.clear()
        self.host_step.slot_weights.clear()
        self.filler.slot_views.clear()
        evicted = self.cache.resize(capacity, refill=self._refill if self.is_cuda else None)
        control = self.graph_step.control if keep and self.graph_step is not None else None
        if control is not None:  # the device books follow now (compacted slots, the count)
            control.books.push()
            self.books_on_device = control.books
            self._admit_after_resize(control)
        self.all_resident = self.prefill.all_resident = False
        self.split_info = self._split_info(capacity, self.rates, "copy")
        return evicted

    def _split_info(self, capacity: int, rates, fills: str) -> str:
        """The split line's text (run --stats, serve's ready lines, the benches' notes)."""
        if not capacity:
            return "no expert cache: every routed expert runs on the CPU"
        return f"{self.split.describe()} ({rates.origin()}, {fills} fills); {capacity} cache slots"

    def _refill(self, slots: list) -> None:
        """Copy the experts that own `slots` from the host banks into them (a cuda resize that
        released the old storage first); returns when the copies are done."""
        by_layer = {}
        for s in slots:
            layer, expert = (int(v) for v in self.cache.own[s])
            by_layer.setdefault(layer, []).append((expert, s))
        for layer, moves in by_layer.items():
            self.filler.copy_now(layer, moves)

    def _preload(self):
        """Fill a cache that holds every expert, once; afterwards every route hits."""
        first = 0
        for layer in sorted(self.banks):
            info = self.infos[layer]
            n, stride = info.num_experts, info.slot_stride
            slots = list(range(first, first + n))
            for e, s in enumerate(slots):
                self.cache.assign(s, layer, e)
            # slots of one layer are consecutive: one copy per layer
            self.cache.storage[first:first + n, :stride].copy_(self.host[layer].view(n, stride))
            self.cache.touch(slots)
            first += n
            self._stats["fills"] += n
            self._stats["preloaded"] += n
            self._stats["bytes_filled"] += n * stride

    def close(self):
        self.graph_step = None  # it points back here: let refcounting free the cache storage
        self.executor.close()
        self.prefill.close()


def _refuse_quantized_tier(infos: dict, capacity: int, tier_on_pool: bool, is_cuda: bool) -> None:
    """Quantized banks (ftw/SPEC.md §9) in a cache: the slots hold the quantized bytes as the
    bank does (fills copy them unchanged), which the native CPU kernels read (the cpu tier on
    the kernel pool) and, on cuda, the Triton kernels (compute/quant_blocks.py); the cpu
    device's torch tier would need typed views (bank.pool_views)."""
    quants = sorted({getattr(i, "quant", "none") for i in infos.values()} - {"none"})
    if quants and is_cuda and not triton_experts.available():
        raise ConfigError(f"{', '.join(quants)} experts on cuda run through Triton kernels: "
                          "install triton (torch's CUDA wheels bring it), or run with --device cpu")
    if quants and capacity and not tier_on_pool and not is_cuda:
        raise ConfigError(f"{', '.join(quants)} experts in an expert cache run on the native CPU "
                          "kernels of --device cpu only so far: build the kernels and leave the "
                          "tuning's cpu_experts and tier_torch at their defaults, or run without "
                          "an expert cache (--expert-cache-gb 0)")


def create_expert_runtime(banks: dict, model_config, engine_config, device, dtype,
                          rates: ExpertRates = None, capacity=None):
    """The engine's ExpertRuntime over host banks {layer: HostBank} (the caller loads them, and
    on cuda pins them: engine.PinnedBanks), split and prefill choice by `rates` (the engine's
    reading of the stored profile; None: the defaults), with `capacity` cache slots (the engine's
    memory plan; None: cache.cache_capacity's). engine_config.tuning.reference_experts
    gives DenseReferenceExperts (the tests' oracle) instead."""
    device = torch.device(device)
    if engine_config.tuning.reference_experts:
        return DenseReferenceExperts(banks, model_config, device, dtype)
    return ExpertRuntime(banks, model_config, engine_config, device, dtype, capacity=capacity,
                         rates=rates)
