"""GPU-resident control of a captured decode step (cuda, Triton, the native CPU kernels): the
whole step is one CUDA graph with no host sync in it. Per MoE layer the graph

    plan     one Triton program (device_plan.py): hits, misses, q, LRU victims, the books
             rewritten, the fill list and device routes for the next kernels, the CPU's routes
             and the token's x into the layer's host mailbox (pinned memory)
    ready    the layer's `ready` flag raised in host memory (Signals, below)
    fills    the zero-copy gather (zero_copy.py) of the planned fills into their slots
    experts  the device routes on their slots (gathered.py)
    finish   one kernel: if the plan left the CPU routes, wait until the host raises `done`,
             clear it, add the CPU's partial (read from the mailbox in place) to the device
             part; cast to the model's dtype

while the host, after launching the graph, serves the layers in order in native code
(cython/serve.h: wait for ready, run the CPU routes on the pool, write the partial, raise done),
the GIL released. The plan is the host decode planner's, so the device books equal the host
books step for step.

Admissions (--fill-behind N, by default 1 in steps of at most 3 misses: runtime.py; extra
fill_behind_idle: only in layers that fill nothing): the plan kernel also gives the next N
misses LRU slots (as the host planner does); a gather on a side stream copies them in, started
with the layer's plan (FREETOKEN_ADMIT_AT=after_cpu: after its CPU job), joined at the step's
end. It is a background gather: ADMIT_PROGRAMS looping programs (zero_copy.gather) instead of
one per 16 KiB block, so it takes the link's idle time (the next layers' attention, the CPU-only
stretches) and yields it to the critical fills beside it, which have hundreds of programs' reads
in flight (a full-grid gather put each admission on the critical path: 46.7 against 56.6 tok/s,
docs/MEASUREMENTS.md#admission-gather). The first launch of the admission kernel happens at
construction (_load_admit_kernel): loaded lazily behind a layer's wait for the host it
deadlocked.

Deferred admissions (FREETOKEN_ADMIT_DEFER, by default the last half): the last N MoE layers'
admissions are gathered at the start of the next step instead of in their own, so the step
does not end waiting for a backlog of them; the next step joins them before the first of those
layers plans. Their lists
stay in the layers' mailboxes until then (each gather clears its list: nothing is copied twice),
and ExpertRuntime.sync_books gathers what is still pending (flush) before the host reads the
books. Safe for the same reason as joining at the step's end: from its plan to its join an
admitted slot sees at most one step's touches (the last N layers of one step, the first L - N
of the next), so it is never the LRU victim meanwhile, and only its own layer reads it, after
the join. Off where the cache is too small for that (join_each_layer).

Fills stay a gather on the GPU. Tried and removed (the runs: docs/MEASUREMENTS.md):
  fills as copies queued by the host     docs/MEASUREMENTS.md#fills-zero-copy-gather-vs-copy-engine
  admissions polling a host word         docs/MEASUREMENTS.md#admission-gather
  no admissions while some are pending   docs/MEASUREMENTS.md#admissions
  FREETOKEN_FINISH_SUM (finish sums)     docs/MEASUREMENTS.md#readydone-signals
  FREETOKEN_SPLIT_ROWS (rows on the GPU) docs/MEASUREMENTS.md#row-split-of-a-cpu-expert
  every admission half a step later      docs/MEASUREMENTS.md#hot-expert-reads

Books: while decode steps run this way the device copy is the truth; ExpertRuntime pulls it
back (pull) before any host planning and before its stats are read, and pushes the host books
(push) before the next such step. The counters of the planned steps (hits, misses, fills,
evictions, CPU experts) accumulate on the device and are added to the runtime's stats on pull.

Shape legend: L MoE layers, E experts per layer, C cache slots, K routes of the token, D hidden.
"""
import torch

from ..config import env, env_int
from ..errors import ConfigError
from . import cuda_copy, zero_copy
from .device_plan import MAX_K, DeviceBooks, Mailbox, available, plan_layer

# Admission gather programs: alone 8 gather at the full grid's 43 GB/s, and beside a critical
# fill they leave its time as it is (docs/MEASUREMENTS.md#admission-gather)
ADMIT_PROGRAMS = 8

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def defer_layers(order: list, setting: str) -> tuple:
    """The MoE layers (of `order`, as a step runs them) whose admissions wait for the next
    step, by FREETOKEN_ADMIT_DEFER: 'auto' (the default) the last half, N the last N (at most
    all but the first), 0 none. Half: the step's end no longer waits for the admissions' backlog,
    and half a step is left to gather them (H200 host, 48 layers, locality: the last 24 gained
    11% at 50% cache, at 25% 0% and 20% in two rounds; docs/MEASUREMENTS.md#admissions)."""
    if setting == "auto":
        n = len(order) // 2
    elif setting.isascii() and setting.isdigit():
        n = min(int(setting), len(order) - 1)
    else:
        raise ConfigError(f"FREETOKEN_ADMIT_DEFER={setting!r}: unset it for the default, or use "
                          "auto or a whole number of layers >= 0")
    return tuple(order[len(order) - n:]) if n > 0 else ()


def reason_off(runtime) -> str:
    """Why a captured decode step of `runtime` cannot run under GPU-resident control ("" when
    it can). Off: FREETOKEN_DEVICE_CONTROL=0."""
    if env("FREETOKEN_DEVICE_CONTROL") == "0":
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


if triton is not None:
    @triton.jit
    def _raise_flag(flags_ptr):
        tl.store(flags_ptr, 1)

    @triton.jit
    def _finish(flags_ptr, ncpu_ptr, partial_ptr, out_ptr, y_ptr, D, HAS_OUT: tl.constexpr,
                BD: tl.constexpr):
        """y = out + the CPU's partial, in y's dtype. When the plan left the CPU routes, wait
        for the host's `done` (a spin on the mapped word, then its clear) and read the partial
        from the mailbox in place; else neither (the host raises no done then)."""
        n = tl.load(ncpu_ptr)
        if n > 0:
            v = tl.load(flags_ptr + 1, volatile=True)
            while v != 1:
                v = tl.load(flags_ptr + 1, volatile=True)
            tl.store(flags_ptr + 1, 0)
        for d0 in range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            ok = d < D
            acc = tl.zeros([BD], dtype=tl.float32)
            if HAS_OUT:
                acc += tl.load(out_ptr + d, mask=ok, other=0.0)
            if n > 0:
                acc += tl.load(partial_ptr + d, mask=ok, other=0.0, volatile=True)
            tl.store(y_ptr + d, acc.to(y_ptr.dtype.element_ty), mask=ok)


class Signals:
    """How the graph raises a layer's `ready`: by default a one-thread Triton store right after
    the plan kernel (kernels); FREETOKEN_SIGNALS=memops: a stream memory operation
    (cuda_copy.write_value, after a memory fence, so the mailbox the plan kernel wrote is visible
    first), where the driver has them. The wait for `done` is always the finish kernel
    (finish()). The store kernel: +3% on average over the memop, which left the stream idle
    7-21 µs (docs/MEASUREMENTS.md#readydone-signals)."""

    HOWS = ("kernels", "memops")

    def __init__(self, device):
        how = env("FREETOKEN_SIGNALS")  # one of HOWS (config.ENV)
        if how == "memops" and not _memops_work(device):
            raise ConfigError("FREETOKEN_SIGNALS=memops: this driver has no stream memory "
                             "operations; unset it (the default raises ready with a kernel)")
        self.how = how

    def raise_ready(self, box: Mailbox) -> None:
        if self.how == "memops":
            cuda_copy.write_value(box.ready_addr, 1, torch.cuda.current_stream().cuda_stream)
        else:
            _raise_flag[(1,)](box.host_view("flags"), num_warps=1)


def finish(box: Mailbox, out, dtype):
    """The layer's end, one kernel: out (fp32 [1, D], the device routes; None without a cache)
    plus the CPU's partial once the host is done, as dtype [1, D]. One kernel: the ops it
    replaces left the stream idle ~17 µs per layer (docs/MEASUREMENTS.md#readydone-signals)."""
    y = torch.empty((1, box.D), dtype=dtype, device=box.ncpu_d.device)
    _finish[(1,)](box.host_view("flags"), box.ncpu_d, box.host_view("partial"),
                  y if out is None else out.contiguous(), y, box.D, HAS_OUT=out is not None,
                  BD=1024, num_warps=1)
    return y


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
        # admissions (--fill-behind N) run on a side stream, beside the step's own work
        self.side = torch.cuda.Stream(runtime.device) if self.books.admits else None
        self.admitted = None  # the event of the last admission gather not yet joined
        # The next layers' fills may run beside the admissions (other slots) unless a slot
        # admitted in this step can be taken again in it: an admitted slot is stamped newer
        # than every slot but those touched after it, and a step touches at most
        # layers * (K + admissions) slots; smaller caches join before every layer's fills
        per_step = len(runtime.banks) * (runtime.top_k + max(b_of_m, default=0))
        # when they start: with the layer's plan (beside its CPU job and fills: the default) or
        # after its CPU job (FREETOKEN_ADMIT_AT=after_cpu: beside the next layer's attention)
        self.admit_early = env("FREETOKEN_ADMIT_AT") != "after_cpu"
        # the admission gather's programs (zero_copy.gather): a few looping ones that yield
        # the link to the fills beside them (FREETOKEN_ADMIT_PROGRAMS, 0 = one per block)
        self.admit_programs = env_int("FREETOKEN_ADMIT_PROGRAMS") or None
        self.join_each_layer = runtime.cache.capacity <= per_step
        # the MoE layers whose admissions wait for the next step (FREETOKEN_ADMIT_DEFER)
        self.defer = defer_layers(sorted(runtime.infos), env("FREETOKEN_ADMIT_DEFER"))
        if self.side is None or self.join_each_layer or not self.admit_early:
            self.defer = ()
        self.deferred = None  # the event of the deferred admissions not yet joined
        self.signals = Signals(runtime.device)
        self.storage_words = runtime.cache.storage.view(torch.int32)  # [C, slot_stride / 4]
        self.boxes = {}  # layer -> Mailbox
        self.host_words = {}  # layer -> its bank as words for zero_copy.gather
        self.tables = {}  # tuple of layers -> kernels.ServeTable
        self.order = ()  # the MoE layers of a captured step, in the order they run
        self.seen, self.mode = [], None
        self.broken = None  # the error of a step whose serving failed (serve)
        if self.side is not None:
            self._load_admit_kernel()

    def _load_admit_kernel(self) -> None:
        """Compile and load the admission gather now. Its first launch may come after a
        layer's wait for the host (FREETOKEN_ADMIT_AT=after_cpu) while the host has not yet run
        that layer's CPU job: loading a module there waits for the blocked stream, a deadlock
        (seen on the H200 host with FREETOKEN_ADMIT_PROGRAMS). A fill list of -1 moves nothing."""
        layer = next(iter(self.rt.infos))
        info = self.rt.infos[layer]
        none = torch.full((1,), -1, dtype=torch.int64, device=self.rt.device)
        src = zero_copy.host_words(self.rt.host[layer], info.num_experts, info.slot_stride)
        for stride in sorted({i.slot_stride for i in self.rt.infos.values()}):
            zero_copy.gather(src, self.storage_words, none, none.clamp(min=0), stride,
                             programs=self.admit_programs)
        none.fill_(-1)  # the deferred admissions' clear (_gather_deferred)
        torch.cuda.synchronize(self.rt.device)

    def describe(self) -> str:
        """How the step is controlled, and what the host server measured so far (the tables'
        counters, cython/serve.h): the mean time from a layer's ready to its done where it ran
        CPU routes, and the mean wait for ready per layer served."""
        text = f"GPU-resident control ({self.signals.how} flags)"
        if self.defer:
            text += f"; the last {len(self.defer)} layers' admissions gathered in the next step"
        if any(t.skip_jobs for t in self.tables.values()):
            text += ("; CPU jobs SKIPPED (FREETOKEN_SERVE_SKIP_JOBS=1: zero partials, wrong "
                     "results, timing only)")
        stats = [row for t in self.tables.values() for row in t.stats()]
        wait, job, jobs, served = (sum(r[i] for r in stats) for i in range(4))
        if jobs:
            from .. import kernels  # (built: tables exist only over the native kernels)
            t = kernels.job_summary([table.job_times() for table in self.tables.values()])
            text += (f"; host: ready to done {job / jobs / 1e3:.0f} µs per CPU job "
                     f"({jobs / served:.2f} per layer step; p50/p90/p99 {t['p50']}/{t['p90']}/"
                     f"{t['p99']} µs, {t['over']} over {t['over_us']} µs; prepare "
                     f"{t['prep_us']:.1f} µs), waits for ready {wait / served / 1e3:.0f} µs per "
                     f"layer step")
            tr = kernels.trace_summary([table.trace_times() for table in self.tables.values()])
            if tr:  # FREETOKEN_SERVE_TRACE=1: where a job's time went (serve.h tr_*)
                text += (f"; traced jobs {tr['jobs']}: submit to done {tr['job']:.0f} µs, workers "
                         f"start {tr['wake']:.1f} (last {tr['wake_max']:.1f}) µs after the submit, "
                         f"read G {tr['g_gbs']:.2f} / D {tr['d_gbs']:.2f} GB/s each, D items "
                         f"wait {tr['dwait']:.1f} µs, last ends {tr['spread']:.1f} µs apart, "
                         f"{tr['signal']:.1f} µs to done")
        return text

    def begin(self, mode: str) -> None:
        """mode as GraphStep.begin's: 'inline' runs the step now (the host serves each layer as
        it is queued), 'capture' records it."""
        self.mode, self.seen, self.deferred = mode, [], None
        if mode == "inline":
            self._books_here()

    def _admit(self, src, box, info) -> None:
        """The layer's admissions, gathered on the side stream from this point of the step."""
        main = torch.cuda.current_stream()
        self.side.wait_stream(main)  # (after its last admissions, on the same stream)
        with torch.cuda.stream(self.side):
            zero_copy.gather(src, self.storage_words, box.asrc_d, box.adst_d, info.slot_stride,
                             programs=self.admit_programs)
        self.admitted = torch.cuda.Event()
        self.admitted.record(self.side)

    def _gather_deferred(self) -> None:
        """At the step's start: the admissions the previous step left to it (self.defer), on
        the side stream; each list is cleared once gathered."""
        if not any(layer in self.boxes for layer in self.defer):
            return
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            self._gather_deferred_lists(self.admit_programs)
        self.deferred = self.admitted = torch.cuda.Event()
        self.deferred.record(self.side)

    def flush(self) -> None:
        """Gathers, on the current stream, the deferred admissions still pending (the last
        step's); ExpertRuntime.sync_books calls it before the books go back to the host."""
        with torch.inference_mode():  # (the mailboxes were made in the steps' inference mode)
            self._gather_deferred_lists(None)

    def _gather_deferred_lists(self, programs) -> None:
        """The deferred layers' admission lists gathered on the current stream, each cleared
        after its gather (zero_copy.gather's programs: None the full grid, G looping ones)."""
        for layer in self.defer:
            box = self.boxes.get(layer)
            if box is not None:
                zero_copy.gather(self._src(layer), self.storage_words, box.asrc_d, box.adst_d,
                                 self.rt.infos[layer].slot_stride, programs=programs)
                box.asrc_d.fill_(-1)

    def _src(self, layer: int):
        src = self.host_words.get(layer)
        if src is None:
            info = self.rt.infos[layer]
            src = self.host_words[layer] = zero_copy.host_words(
                self.rt.host[layer], info.num_experts, info.slot_stride)
        return src

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
        self._check_unbroken()
        box = self.boxes.get(layer)
        if box is None:
            box = self.boxes[layer] = Mailbox(K, x.shape[1], x.device)
        if not self.seen and self.defer:
            self._gather_deferred()
        if self.defer and layer == self.defer[0] and self.deferred is not None:
            torch.cuda.current_stream().wait_event(self.deferred)  # before its plan rewrites them
            self.deferred = None
        self.seen.append(layer)
        plan_layer(self.books, box, layer, expert_ids.reshape(-1).contiguous(),
                   weights.reshape(-1).to(torch.float32).contiguous(), x.reshape(-1).contiguous())
        self.signals.raise_ready(box)
        info = self.rt.infos[layer]
        src = self._src(layer)
        if self.rt.cache.capacity:  # (no cache: every route is the CPU's)
            if self.join_each_layer:
                self._join()
            if self.side is not None and self.admit_early and layer not in self.defer:
                self._admit(src, box, info)
            zero_copy.gather(src, self.storage_words, box.fsrc_d, box.fdst_d, info.slot_stride)
            out = self.experts.run(layer, x, box.slot_d, box.wdev_d)  # fp32 [1, D]
        else:
            out = None
        y = finish(box, out, x.dtype)
        if self.side is not None and not self.admit_early:
            self._admit(src, box, info)
        if self.mode == "inline":
            self.serve((layer,))
        return y

    def replay(self, graph) -> None:
        """One captured step: launch it, then serve its layers' CPU side (returns when the last
        layer's partial is written; the GPU finishes the step after). Served on this thread,
        after the launch: a thread started before it cost up to 13%; helping, pinning, a
        sleeping finish kernel moved nothing (docs/MEASUREMENTS.md#host-serving-thread)."""
        self._check_unbroken()
        self._books_here()
        graph.replay()
        self.serve(self.order)
        self._count_step(len(self.order))

    def serve(self, layers: tuple) -> None:
        """The host's side of the queued or replayed `layers`. If it fails, whatever failed (the
        native server, or Python before it started), every done is raised so the GPU ends the
        step, and this control takes no more steps."""
        try:
            table = self.tables.get(layers)
            if table is None:
                table = self.tables[layers] = self.rt.executor.serve_table(
                    [(layer, self.boxes[layer]) for layer in layers])
            self.rt.executor.serve(table)
        except BaseException as e:
            # a native server that gave up raised the remaining done flags itself; a failure
            # before it started did not, and the GPU would wait on them for ever (any later
            # sync with it too): raise them all. The layers without CPU routes never clear
            # theirs, and a later step would take a stale done for the host's
            # (cython/serve.h): no more steps on these mailboxes
            for layer in layers:
                self.boxes[layer].flags[1] = 1
            self.broken = e
            raise

    def _check_unbroken(self) -> None:
        if self.broken is not None:
            raise RuntimeError("GPU-resident decode stopped after an earlier step's CPU side "
                               f"failed ({self.broken}); its flags may be stale: load the model "
                               "again (a new engine) to go on")

    def _books_here(self) -> None:
        """The device books become the truth (pushed from the host's if those are newer)."""
        if not self.rt.books_on_device:
            self.books.push()
            self.rt.books_on_device = self.books

    def _count_step(self, num_layers: int) -> None:
        self.rt.count_routes(num_layers * self.rt.top_k)  # one token; the rest on pull
