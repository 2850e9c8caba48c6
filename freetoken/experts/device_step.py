"""GPU-resident control of a captured decode step (cuda, Triton, the native CPU kernels): the
whole step is one CUDA graph with no host sync in it. Per MoE layer the graph

    plan     one Triton program: hit/miss of the K routed experts against a device copy of the
             cache's books, q = the split's q_of_m[m], LRU victims, the books rewritten, the
             fill list and the device routes (slot, weight) written for the next kernels, the
             CPU's routes and the token's x written to the layer's host mailbox (pinned memory)
    ready    the layer's `ready` flag raised in host memory (signal.py)
    fills    the zero-copy gather (zero_copy.py) of the planned fills into their slots
    experts  the device routes on their slots (gathered.py)
    done     the GPU waits until the host raises `done`, then clears it
    combine  device part + the CPU's partial (copied from the mailbox)

while the host, after launching the graph, serves the layers in order in native code
(cython/serve.h: wait for ready, run the CPU routes on the pool, write the partial, raise done),
the GIL released. The plan is the host decode planner's (plan.make_decode_plan with LRU
eviction and the split's tables): same hits, same fills into the same slots, same stamps, so
the device books equal the host books step for step (tests/test_device_step.py checks the
kernel against the host planner).

Admissions (--fill-behind N; extra fill_behind_idle: only in layers that fill nothing): the
plan kernel also gives the next N misses LRU slots (as the host planner does); a gather on a
side stream copies them in, started with the layer's plan, beside its CPU job and fills
(FREETOKEN_ADMIT_AT=after_cpu: after the CPU job). Off by default: measured on the H200 host
(tools/bench_decode.py, 25% cache, locality) they raise the hit rate to offload's (67% -> 79%)
and lose speed (46.7 against 56.6 tok/s): each one is another 9.44 MB over the link that is
already the critical path, read from the memory the CPU job reads.

Books: while decode steps run this way the device copy is the truth; ExpertRuntime pulls it
back (pull) before any host planning and before its stats are read, and pushes the host books
(push) before the next such step. The counters of the planned steps (hits, misses, fills,
evictions, CPU experts) accumulate on the device and are added to the runtime's stats on pull.

Shape legend: L MoE layers, E experts per layer, C cache slots, K routes of the token, D hidden.
"""
import os

import torch

from . import cuda_copy, zero_copy

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

COUNTERS = ("hits", "misses", "fills", "evictions", "cpu_experts", "behind")
MAX_K = 64  # routes per token the plan kernel and the native server take
_NEVER = (1 << 62)  # larger than any stamp


def available() -> bool:
    return triton is not None


def reason_off(runtime) -> str:
    """Why a captured decode step of `runtime` cannot run under GPU-resident control ("" when
    it can). Off: FREETOKEN_DEVICE_CONTROL=0."""
    if os.environ.get("FREETOKEN_DEVICE_CONTROL", "1") == "0":
        return "FREETOKEN_DEVICE_CONTROL=0"
    if not runtime.is_cuda or not available():
        return "needs cuda and Triton"
    if runtime.all_resident:
        return "every expert is resident (no plan needed)"
    if not hasattr(runtime.executor, "serve_table"):
        return "needs the native CPU kernels"
    if not all(t.is_pinned() for t in runtime.host.values()):
        return "the host banks are not pinned"
    if runtime.split_adapt or runtime.split.window:
        return "the split observes or times admissions (host-side state)"
    if runtime.top_k > MAX_K:
        return f"more than {MAX_K} routes per token"
    return ""


class DeviceBooks:
    """Device copies of the cache's books (cache.py: residency [L, E], owner [C, 2], stamps [C],
    the clock), the split's q table and the step counters."""

    def __init__(self, cache, q_of_m, device, b_of_m=None):
        self.cache, self.device = cache, device
        self.res = torch.empty(cache.residency.shape, dtype=torch.int64, device=device)  # [L, E]
        self.own = torch.empty(cache.owner.shape, dtype=torch.int64, device=device)  # [C, 2]
        self.stamps = torch.empty(cache.last_used.shape, dtype=torch.int64, device=device)  # [C]
        self.clock = torch.zeros(1, dtype=torch.int64, device=device)
        self.qtab = torch.tensor(list(q_of_m), dtype=torch.int64, device=device)  # [K + 1]
        b_of_m = [0] * len(q_of_m) if b_of_m is None else list(b_of_m)
        self.btab = torch.tensor(b_of_m, dtype=torch.int64, device=device)  # [K + 1] admissions
        self.admits = any(b_of_m)
        self.counts = torch.zeros(len(COUNTERS), dtype=torch.int64, device=device)

    def push(self) -> None:
        """Host books -> device (the device copy becomes the truth)."""
        c = self.cache
        self.res.copy_(c.residency)
        self.own.copy_(c.owner)
        self.stamps.copy_(c.last_used)
        self.clock.fill_(c.clock)
        self.counts.zero_()

    def pull(self, stats: dict) -> None:
        """Device books -> host (after the device's work so far); the counters are added to
        `stats` and the cache's own counters, then zeroed."""
        c = self.cache
        c.residency.copy_(self.res.cpu())
        c.owner.copy_(self.own.cpu())
        c.last_used.copy_(self.stamps.cpu())
        c.clock = int(self.clock.item())
        counts = dict(zip(COUNTERS, self.counts.tolist()))
        self.counts.zero_()
        for k, v in counts.items():
            if k != "behind":  # (the runtime counts those as fills_behind)
                stats[k] = stats.get(k, 0) + v
        c.stats["hits"] += counts["hits"]
        c.stats["misses"] += counts["misses"]
        c.stats["fills"] += counts["fills"]
        c.stats["evictions"] += counts["evictions"]
        return counts


if triton is not None:
    @triton.jit(do_not_specialize=["layer", "E", "C", "K", "D"])  # (a 1 would be a constant)
    def _plan_kernel(ids_ptr, w_ptr, x_ptr, res_ptr, own_ptr, stamps_ptr, clock_ptr, qtab_ptr,
                     btab_ptr, count_ptr, slot_ptr, wdev_ptr, fsrc_ptr, fdst_ptr, asrc_ptr,
                     adst_ptr, mb_ids_ptr, mb_w_ptr, mb_x_ptr, layer, E, C, K, D,
                     BK: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr, NEVER: tl.constexpr):
        k = tl.arange(0, BK)
        km = k < K
        e = tl.load(ids_ptr + k, mask=km, other=0)  # [BK] distinct experts
        w = tl.load(w_ptr + k, mask=km, other=0.0)
        base = layer.to(tl.int64) * E
        s = tl.load(res_ptr + base + e, mask=km, other=-1)
        hit = km & (s >= 0)
        miss = km & (s < 0)
        less = e[None, :] < e[:, None]  # [BK, BK]: expert j sorts before expert i
        hrank = tl.sum((less & hit[None, :]).to(tl.int64), axis=1)  # rank among the hits
        mrank = tl.sum((less & miss[None, :]).to(tl.int64), axis=1)  # rank among the misses
        nh = tl.sum(hit.to(tl.int64), axis=0)
        m = tl.sum(miss.to(tl.int64), axis=0)
        clock = tl.load(clock_ptr)
        tl.store(stamps_ptr + s, clock + 1 + hrank, mask=hit)  # hits touched, ascending expert
        clock = clock + nh
        q = tl.minimum(tl.load(qtab_ptr + m), C - nh)
        q = tl.maximum(q, 0)
        b = tl.maximum(tl.minimum(tl.load(btab_ptr + m), C - nh - q), 0)  # admissions
        tl.debug_barrier()
        slot = tl.where(hit, s, -1)
        fsrc = tl.full([BK], -1, tl.int64)
        fdst = tl.zeros([BK], tl.int64)
        asrc = tl.full([BK], -1, tl.int64)
        adst = tl.zeros([BK], tl.int64)
        ev = q * 0
        # the i-th miss (ascending expert) into the LRU slot: fills first (i < q, computed on
        # the device this step), then admissions (copied in after the step's CPU job)
        for i in tl.static_range(BK):
            if i < q + b:
                best_v = tl.full([], NEVER, tl.int64)
                best_i = tl.zeros([], tl.int64)
                for c0 in range(0, C, BC):
                    c = c0 + tl.arange(0, BC)
                    st = tl.load(stamps_ptr + c, mask=c < C, other=NEVER)
                    cmin = tl.min(st, axis=0)
                    cidx = tl.argmin(st, axis=0).to(tl.int64) + c0
                    better = cmin < best_v
                    best_i = tl.where(better, cidx, best_i)
                    best_v = tl.where(better, cmin, best_v)
                mine = miss & (mrank == i)
                ne = tl.sum(tl.where(mine, e, 0), axis=0)
                ol = tl.load(own_ptr + 2 * best_i)
                oe = tl.load(own_ptr + 2 * best_i + 1)
                if ol >= 0:
                    tl.store(res_ptr + ol * E + oe, -1)
                    ev += 1
                tl.store(res_ptr + base + ne, best_i)
                tl.store(own_ptr + 2 * best_i, base // E)
                tl.store(own_ptr + 2 * best_i + 1, ne)
                tl.store(stamps_ptr + best_i, clock + 1 + i)
                if i < q:
                    slot = tl.where(mine, best_i, slot)
                    fsrc = tl.where(k == i, ne, fsrc)
                    fdst = tl.where(k == i, best_i, fdst)
                else:
                    asrc = tl.where(k == i - q, ne, asrc)
                    adst = tl.where(k == i - q, best_i, adst)
                tl.debug_barrier()
        tl.store(clock_ptr, clock + q + b)
        cpu = miss & (mrank >= q)
        tl.store(slot_ptr + k, tl.where(cpu, 0, slot), mask=km)
        tl.store(wdev_ptr + k, tl.where(cpu, 0.0, w), mask=km)
        tl.store(fsrc_ptr + k, fsrc, mask=km)
        tl.store(fdst_ptr + k, fdst, mask=km)
        tl.store(asrc_ptr + k, asrc, mask=km)
        tl.store(adst_ptr + k, adst, mask=km)
        tl.store(mb_ids_ptr + k, tl.where(cpu, e, -1), mask=km)
        tl.store(mb_w_ptr + k, w, mask=km)
        for d0 in range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            tl.store(mb_x_ptr + d, tl.load(x_ptr + d, mask=d < D).to(tl.float32), mask=d < D)
        tl.store(count_ptr + 0, tl.load(count_ptr + 0) + nh)
        tl.store(count_ptr + 1, tl.load(count_ptr + 1) + m)
        tl.store(count_ptr + 2, tl.load(count_ptr + 2) + q + b)
        tl.store(count_ptr + 3, tl.load(count_ptr + 3) + ev)
        tl.store(count_ptr + 4, tl.load(count_ptr + 4) + (m - q))
        tl.store(count_ptr + 5, tl.load(count_ptr + 5) + b)


class Mailbox:
    """One layer's exchange with the host server (cython/serve.h), pinned on cuda: flags
    [ready, done] int32, ids int64 [K] (the CPU's experts, -1 elsewhere), w fp32 [K], x fp32
    [D], partial fp32 [D]; and the layer's device outputs of the plan (slot, weight, fills)."""

    def __init__(self, K: int, D: int, device):
        pin = torch.device(device).type == "cuda"
        self.flags = torch.zeros(2, dtype=torch.int32, pin_memory=pin)
        self.ids = torch.full((K,), -1, dtype=torch.int64, pin_memory=pin)
        self.w = torch.zeros(K, dtype=torch.float32, pin_memory=pin)
        self.x = torch.zeros(D, dtype=torch.float32, pin_memory=pin)
        self.partial = torch.zeros(D, dtype=torch.float32, pin_memory=pin)
        self.slot_d = torch.zeros(K, dtype=torch.int64, device=device)
        self.wdev_d = torch.zeros(K, dtype=torch.float32, device=device)
        self.fsrc_d = torch.full((K,), -1, dtype=torch.int64, device=device)
        self.fdst_d = torch.zeros(K, dtype=torch.int64, device=device)
        self.asrc_d = torch.full((K,), -1, dtype=torch.int64, device=device)  # admissions
        self.adst_d = torch.zeros(K, dtype=torch.int64, device=device)
        self.partial_d = torch.zeros(1, D, dtype=torch.float32, device=device)
        self.K, self.D = K, D

    @property
    def ready_addr(self) -> int:
        return self.flags.data_ptr()

    @property
    def done_addr(self) -> int:
        return self.flags.data_ptr() + 4

    def host_view(self, name):
        """A mailbox tensor as a kernel argument: mapped on cuda, the tensor itself on cpu
        (Triton's interpreter, tests)."""
        t = getattr(self, name)
        return zero_copy.MappedHost(t) if t.is_pinned() else t


def plan_layer(books: DeviceBooks, box: Mailbox, layer: int, expert_ids, weights, x) -> None:
    """Queue the layer's plan kernel: expert_ids int64 [K] and weights fp32 [K] of one token,
    x [D] (compute dtype), all on the books' device."""
    K, D = box.K, box.D
    C = books.stamps.shape[0]
    E = books.res.shape[1]
    _plan_kernel[(1,)](expert_ids, weights, x, books.res, books.own, books.stamps, books.clock,
                       books.qtab, books.btab, books.counts, box.slot_d, box.wdev_d, box.fsrc_d,
                       box.fdst_d, box.asrc_d, box.adst_d, box.host_view("ids"), box.host_view("w"),
                       box.host_view("x"),
                       layer, E, C, K, D, BK=max(2, triton.next_power_of_2(K)),
                       BC=min(1024, max(16, triton.next_power_of_2(max(C, 1)))), BD=1024,
                       NEVER=_NEVER)


if triton is not None:
    @triton.jit
    def _raise_flag(flags_ptr):
        tl.store(flags_ptr, 1)

    @triton.jit
    def _await_flag(flags_ptr):
        v = tl.load(flags_ptr + 1, volatile=True)
        while v != 1:
            v = tl.load(flags_ptr + 1, volatile=True)
        tl.store(flags_ptr + 1, 0)


class Signals:
    """How the graph raises a layer's `ready` and waits for its `done`: stream memory operations
    (cuda_copy.write_value / wait_value; the write comes after a memory fence, so the mailbox
    the plan kernel wrote is visible first) where the driver has them, else two one-thread
    Triton kernels (a store; a spin on a volatile load, then the clear).
    FREETOKEN_SIGNALS=memops|kernels forces one."""

    def __init__(self, device):
        how = os.environ.get("FREETOKEN_SIGNALS", "auto")
        if how == "auto":
            how = "memops" if _memops_work(device) else "kernels"
        self.how = how

    def raise_ready(self, box: Mailbox) -> None:
        if self.how == "memops":
            cuda_copy.write_value(box.ready_addr, 1, torch.cuda.current_stream().cuda_stream)
        else:
            _raise_flag[(1,)](box.host_view("flags"), num_warps=1)

    def await_done(self, box: Mailbox) -> None:
        if self.how == "memops":
            stream = torch.cuda.current_stream().cuda_stream
            cuda_copy.wait_value(box.done_addr, 1, stream)
            cuda_copy.write_value(box.done_addr, 0, stream)
        else:
            _await_flag[(1,)](box.host_view("flags"), num_warps=1)


def _memops_work(device) -> bool:
    """Whether a stream write of a pinned word lands (the driver has stream memory operations)."""
    if not cuda_copy.memops_available():
        return False
    word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    stream = torch.cuda.Stream(device)
    try:
        cuda_copy.write_value(word.data_ptr(), 7, stream.cuda_stream)
        stream.synchronize()
    except cuda_copy.CudaError:
        return False
    return int(word[0]) == 7


class DeviceControl:
    """The expert side of a captured decode step under GPU-resident control (module docstring),
    for graph_step.GraphStep: forward() queues one MoE layer while the step is run inline or
    captured, replay() runs a captured step and serves its CPU side."""

    def __init__(self, runtime, experts):
        self.rt, self.experts = runtime, experts
        q_of_m, b_of_m = runtime.split.tables(runtime.top_k)  # b: --fill-behind N admissions
        self.books = DeviceBooks(runtime.cache, q_of_m, runtime.device, b_of_m)
        # admissions run on a side stream after the layer's CPU job, beside the next layer's
        # non-expert part; the next layer's fills wait for them (same link, maybe same slots)
        self.side = torch.cuda.Stream(runtime.device) if self.books.admits else None
        self.admitted = None  # the event of the last admission gather not yet joined
        # The next layers' fills may run beside the admissions (other slots) unless a slot
        # admitted in this step can be taken again in it: an admitted slot is stamped newer
        # than every slot but those touched after it, and a step touches at most
        # layers * (K + admissions) slots; smaller caches join before every layer's fills
        per_step = len(runtime.banks) * (runtime.top_k + max(b_of_m, default=0))
        # when they start: with the layer's plan (beside its CPU job and fills: the default) or
        # after its CPU job (FREETOKEN_ADMIT_AT=after_cpu: beside the next layer's attention)
        self.admit_early = os.environ.get("FREETOKEN_ADMIT_AT", "plan") != "after_cpu"
        self.join_each_layer = runtime.cache.capacity <= per_step
        self.signals = Signals(runtime.device)
        self.storage_words = runtime.cache.storage.view(torch.int32)  # [C, slot_stride / 4]
        self.boxes = {}  # layer -> Mailbox
        self.host_words = {}  # layer -> its bank as words for zero_copy.gather
        self.tables = {}  # tuple of layers -> kernels.ServeTable
        self.order = ()  # the MoE layers of a captured step, in the order they run
        self.seen, self.mode = [], None

    def describe(self) -> str:
        return f"GPU-resident control ({self.signals.how} flags)"

    def begin(self, mode: str) -> None:
        """mode as GraphStep.begin's: 'inline' runs the step now (the host serves each layer as
        it is queued), 'capture' records it."""
        self.mode, self.seen = mode, []
        if mode == "inline":
            self._books_here()

    def _admit(self, src, box, info) -> None:
        """The layer's admissions, gathered on the side stream from this point of the step."""
        main = torch.cuda.current_stream()
        self.side.wait_stream(main)  # (after its last admissions, on the same stream)
        with torch.cuda.stream(self.side):
            zero_copy.gather(src, self.storage_words, box.asrc_d, box.adst_d, info.slot_stride)
        self.admitted = torch.cuda.Event()
        self.admitted.record(self.side)

    def _join(self) -> None:
        """The current stream waits for the last admissions."""
        if self.admitted is not None:
            torch.cuda.current_stream().wait_event(self.admitted)
            self.admitted = None

    def end(self) -> None:
        """After the model's forward (its stream is current): joins the admissions."""
        self._join()
        if self.mode == "capture":
            self.order = tuple(self.seen)
        elif self.mode == "inline":
            self._count_step(len(self.seen))
        self.mode, self.seen = None, []

    def forward(self, layer: int, x, expert_ids, weights):
        """x [1, D], expert_ids [1, K], weights [1, K] on the device -> [1, D] in x's dtype."""
        T, K = expert_ids.shape
        if T != 1:
            raise ValueError(f"GPU-resident control plans one token per step, got {T}")
        box = self.boxes.get(layer)
        if box is None:
            box = self.boxes[layer] = Mailbox(K, x.shape[1], x.device)
        self.seen.append(layer)
        plan_layer(self.books, box, layer, expert_ids.reshape(-1).contiguous(),
                   weights.reshape(-1).to(torch.float32).contiguous(), x.reshape(-1).contiguous())
        self.signals.raise_ready(box)
        info = self.rt.infos[layer]
        src = self.host_words.get(layer)
        if src is None:
            src = self.host_words[layer] = zero_copy.host_words(
                self.rt.host[layer], info.num_experts, info.slot_stride)
        if self.rt.cache.capacity:  # (no cache: every route is the CPU's)
            if self.join_each_layer:
                self._join()
            if self.side is not None and self.admit_early:
                self._admit(src, box, info)
            zero_copy.gather(src, self.storage_words, box.fsrc_d, box.fdst_d, info.slot_stride)
            out = self.experts.run(layer, x, box.slot_d, box.wdev_d)  # fp32 [1, D]
        self.signals.await_done(box)
        if self.side is not None and not self.admit_early:
            self._admit(src, box, info)
        if self.mode == "inline":
            self.serve((layer,))
        box.partial_d.copy_(box.partial.view(1, -1), non_blocking=True)
        if not self.rt.cache.capacity:
            return box.partial_d.to(x.dtype)
        return (out + box.partial_d).to(x.dtype)

    def replay(self, graph) -> None:
        """One captured step: launch it, then serve its layers' CPU side (returns when the last
        layer's partial is written; the GPU finishes the step after)."""
        self._books_here()
        graph.replay()
        self.serve(self.order)
        self._count_step(len(self.order))

    def serve(self, layers: tuple) -> None:
        table = self.tables.get(layers)
        if table is None:
            table = self.tables[layers] = self.rt.executor.serve_table(
                [(layer, self.boxes[layer]) for layer in layers])
        self.rt.executor.serve(table)

    def _books_here(self) -> None:
        """The device books become the truth (pushed from the host's if those are newer)."""
        if not self.rt.books_on_device:
            self.books.push()
            self.rt.books_on_device = self.books

    def _count_step(self, num_layers: int) -> None:
        self.rt.count_routes(num_layers * self.rt.top_k)  # one token; the rest on pull
