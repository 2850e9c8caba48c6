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
stretches) and yields it to the critical fills beside it, which have hundreds of programs'
reads in flight. As a full-grid gather the admissions had raised the hit rate to offload's and
lost speed (25% cache, locality: 46.7 against 56.6 tok/s): each was another 9.44 MB on the
critical path. The first launch of the admission kernel happens at construction
(_load_admit_kernel): loaded lazily behind a layer's wait for the host it deadlocked.

Fills stay a gather on the GPU. Tried and measured on the H200 host (session of 2026-11-30):
the host server queueing each layer's fills as copy-engine copies right after `ready` and
raising a `filled` flag once they landed. Beside the CPU job the copies reached 29.7 GB/s where
the gather reaches 40.6 (freetoken profile's concurrent pairs on that grant), decode moved by
+2-4% in uniform routing and -4-7% with locality, admissions queued behind a layer's CPU job
delayed the next layers' fills on the same copy engine (admit1 at 50% cache, locality: 52.6
against 70.4 tok/s), and the GPU tests hung once fills were copies (not isolated). Reverted.
Also removed after measuring that day: admission programs spinning on a pinned host word the
server held at 1 during each CPU job (to leave the job host bandwidth) flooded PCIe with their
polling and slowed every kernel (admission gather 1085 against 133 µs a layer, gate_up 175
against 28); decode fell to 10.1 against 60.6 tok/s (25% cache, locality; 50%: 17.8 against
87.4; uniform: 26.6 against 33.0 and 12.2 against 41.5). And the finish kernel summing the
K device routes' rows itself (FREETOKEN_FINISH_SUM, to save the ~8 µs torch reduce before it
per layer): hybrid decode with it against without, over 6 configs, moved by -13% to +4%, no
consistent gain; the torch sum stays. Tried and removed in the next session: skipping a layer
step's admissions while N earlier layer steps' admissions had not landed (a device counter pair,
issued by the plan kernel, landed by a kernel after each gather), so that they never queue. On
the H200 host (bench_decode, 32 tokens, locality; hybrid against skip after 1/2/4 pending): 25%
cache 70.7 against 67.9/69.9/74.6 tok/s (hit rate 78.9% against 73.9/76.7/76.8%), 50% 115.4
against 106.4/99.8/105.9 (92.4% against 90.1/92.3/92.4%); with the same plans (skip 4 at 50%)
the row moved by 8%, so beyond the noise the fewer admissions cost hits and gained nothing.
And splitting a lone CPU miss that is admitted by intermediate rows (FREETOKEN_SPLIT_ROWS=r:
rows [0, r) gathered into its admission slot on the step's stream and computed there, rows
[r, I) on the CPU, the admission copying only [r, I); r = I P / (P + C) = 256 of 768 for auto):
the CPU job got shorter (ready to done 137 -> 104 µs at 50% cache) but the step longer, the
device half waiting on its own critical gather beside the CPU's reads of the same expert. H200
host, bench_decode --repeat 2, locality, medians: 25% cache hybrid 69.5 against 64.0 (auto),
61.8 (r 192), 65.1 (r 384) tok/s; 50% 125.9 against 123.9, 116.3, 121.3. Removed.
Another form of it, emulated and not built (H200 host, session of 2026-11-30, bench_decode
--repeat 2, locality, medians, one clean grant): splitting each CPU-run expert by its rows,
the CPU computing 70% and the GPU the rest by reading its 30% of the slot over the link (zero
copy, no admission). The CPU's share alone (the serve table's I cut to 70%, the GPU's part not
run) gained 13% at 50% cache (128.7 against 114.1 tok/s) and 2.5% at 25% (66.7 against 65.1);
with the GPU's 30% read over the link beside it (a zero-copy gather of that many bytes per CPU
expert, on the step's stream before the finish) it gave 115.3 at 50% and 55.5 at 25%: the link
carries the admissions at these cache sizes (0.26 and 0.64 GB per token) and the extra reads
cost what the CPU saved. The same run's rows with the CPU jobs skipped (bench_decode X+nocpu,
the CPU's compute free) gave 156.6 at 50% and 71.9 at 25% against offload's 104.2 and 55.8.

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

# Admission gather programs. Measured on the H200 host (one 9.44 MB expert, zero_copy.gather):
# alone 8 programs gather at 43 GB/s as the full grid does (4: 27, 2: 17); beside a full gather
# of another expert, 8 leave it at its time alone (215 against 216 µs) and end 180 µs after it,
# 32 slow it to 257 µs (tools/bench_gather.py). bench_decode, 25% cache,
# locality, admit1: 59.6 tok/s with 8 programs, 57.6 with 16, 43.4 with 4 (the admissions
# then queue to the step's end), 47.6 with the full grid started after the CPU job.
ADMIT_PROGRAMS = 8

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


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
    (finish()).

    Measured on the H200 host: in the replayed graph the memop left the stream idle 7-21 µs
    between a layer's plan and its fills (profile_decode --graph, 50% cache, locality). Hybrid
    decode tok/s, store kernel against memop (bench_decode, 24 tokens; 25%/50% cache x
    uniform/locality), in two runs on two grants: 34.71/31.94, 65.63/64.00, 44.72/42.71,
    115.36/108.61; then 32.82/32.77, 58.46/63.66, 42.54/40.86, 114.78/107.81: +3% on average,
    +6% both times at 50% locality, 25% locality within its noise. Removed: the plan kernel's
    own last store after bar.sync + fence.sc.sys (FREETOKEN_SIGNALS=plan), +8/-10/+7/+4%
    against the memop in one run, +1/-1/+3/-1% against the store kernel in the next session's
    (25%/50% cache x uniform/locality): no consistent gain."""

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
    plus the CPU's partial once the host is done, as dtype [1, D]. Measured on the H200 host
    (torch.profiler, 16 layers, 50% cache): the stream wait, the flag's clear, the partial's
    copy, the add and the cast it replaces left the stream idle ~17 µs per layer with no CPU
    routes, where the host had long raised done."""
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
        torch.cuda.synchronize(self.rt.device)

    def describe(self) -> str:
        """How the step is controlled, and what the host server measured so far (the tables'
        counters, cython/serve.h): the mean time from a layer's ready to its done where it ran
        CPU routes, and the mean wait for ready per layer served."""
        text = f"GPU-resident control ({self.signals.how} flags)"
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
        self.mode, self.seen = mode, []
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
        layer's partial is written; the GPU finishes the step after).

        Tried and measured on the H200 host (session of 2026-11-30): serving from a thread
        started before the launch, since under torch.profiler the launch took the host ~0.6 ms
        (16 layers) while the GPU started at once, and the first layer with CPU routes waited
        for it. With the pool's 15 workers it cost hybrid decode 13% at 25% cache with locality
        (54.7 against 63.1 tok/s; 17 threads on 16 cores); with 14 workers it still cost 6%
        there (63.3 against 67.3) and 0-2% elsewhere, and offload-only gained nothing (51.7
        against 52.6). Unprofiled, the launch's cost is evidently small.
        Also tried and removed (session of 2026-11-30, H200 host, bench_decode --repeat 2,
        locality, hybrid medians against each): the serving thread running the job's items too
        (help=1 in the serve table: the core the pool leaves to the driver) 25% cache 66.5
        against 67.1 tok/s, 50% 115.3 against 112.6; the serving thread pinned to that core
        while it serves 67.9/67.7, 116.1/120.5; the finish kernel sleeping 1 µs (PTX nanosleep)
        between its reads of `done` 63.7/63.7, 115.3/112.6. None moved the host's ready-to-done
        per CPU job (p50 120-170 µs by the serve table's histogram; the same grant's isolated
        1-expert job, bench_cpu_jobs, 95-115 µs with its submit)."""
        self._check_unbroken()
        self._books_here()
        graph.replay()
        self.serve(self.order)
        self._count_step(len(self.order))

    def serve(self, layers: tuple) -> None:
        table = self.tables.get(layers)
        if table is None:
            table = self.tables[layers] = self.rt.executor.serve_table(
                [(layer, self.boxes[layer]) for layer in layers])
        try:
            self.rt.executor.serve(table)
        except Exception as e:
            # a server that gave up raised every remaining done so the GPU ends the step; the
            # layers without CPU routes never clear theirs, and a later step would take a stale
            # done for the host's (cython/serve.h): no more steps on these mailboxes
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
