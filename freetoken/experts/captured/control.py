"""GPU-resident control of a captured decode step (cuda, Triton, the native CPU kernels): the
whole step is one CUDA graph with no host sync in it, for one token or a batch of T (one
graph per batch size: graphs.py keys them; up to device_plan.MAX_ROUTES routes, T*K). Per MoE
layer the graph

    plan     one Triton program (device_plan.py) over the T tokens' routes: hits, misses, q per
             distinct expert, LRU victims, the books rewritten, the fill list and device routes
             for the next kernels, the CPU's routes and the tokens' x into the layer's host
             mailbox (pinned memory)
    ready    the layer's `ready` flag raised in host memory (by the plan kernel: device_plan.plan_layer)
    fills    the zero-copy gather (zero_copy.py) of the planned fills into their slots
    experts  the device routes on their slots (gathered.py)
    finish   one kernel: if the plan left the CPU routes, wait until the host raises `done`,
             clear it, add each token's CPU partial (read from the mailbox in place) to its
             device part; cast to the model's dtype

while the host, after launching the graph, serves the layers in order in native code
(cython/serve.h: wait for ready, run the CPU routes on the pool, each CPU expert once over the
tokens routed to it, write the tokens' partials, raise done),
the GIL released. The plan is the host planner's (make_decode_plan for one token, make_plan
over the batch's union of experts), so the device books equal the host books step for step.

Admissions (CPU-run misses copied into the cache in the background, and the deferral of the
last layers' to the next step): admissions.py.

Fills stay a gather on the GPU. Tried and removed (the runs: docs/MEASUREMENTS.md):
  fills as copies queued by the host     docs/MEASUREMENTS.md#fills-zero-copy-gather-vs-copy-engine
  finish sums (FINISH_SUM)               docs/MEASUREMENTS.md#readydone-signals
  unfenced ready kernels, memops ready   docs/MEASUREMENTS.md#readydone-signals
  rows of an expert on the GPU           docs/MEASUREMENTS.md#row-split-of-a-cpu-expert

Books: while decode steps run this way the device copy is the truth; ExpertRuntime pulls it
back (pull) before any host planning and before its stats are read, and pushes the host books
(push) before the next such step. The counters of the planned steps (hits, misses, fills,
evictions, CPU experts) accumulate on the device and are added to the runtime's stats on pull.

Shape legend: L MoE layers, E experts per layer, C cache slots, T tokens of the step, K routes
per token, R = T*K routes, D hidden.
"""
import torch

from ...config import triton_interpreted
from ..transfer import zero_copy
from .admissions import Admissions
from .device_plan import MAX_ROUTES, DeviceBooks, Mailbox, available, plan_layer
from .handshake import drained, finish


def reason_off(runtime) -> str:
    """Why a captured decode step of `runtime` cannot run under GPU-resident control ("" when
    it can). On the cpu it runs under Triton's interpreter (tests), inline only."""
    if not (runtime.is_cuda or triton_interpreted()) or not available():
        return "needs cuda and Triton"
    if runtime.all_resident:
        return "every expert is resident (no plan needed)"
    if not hasattr(runtime.executor, "serve_table"):
        return "needs the native CPU kernels"
    if runtime.is_cuda and not all(t.is_pinned() for t in runtime.host.values()):
        return "the host banks are not pinned"
    if runtime.top_k > MAX_ROUTES:
        return f"more than {MAX_ROUTES} routes per token"
    return ""


def max_tokens(runtime) -> int:
    """The most tokens of a step GPU-resident control plans (its mailboxes' size): a larger
    batch is cut for the host's plan (graph_step.py)."""
    return MAX_ROUTES // runtime.top_k


class DeviceControl:
    """The expert side of a captured decode step under GPU-resident control (module docstring),
    for graph_step.GraphStep: forward() queues one MoE layer while the step is run inline or
    captured, replay() runs a captured step and serves its CPU side."""

    def __init__(self, runtime, experts):
        self.rt, self.experts = runtime, experts
        self.max_tokens = max_tokens(runtime)
        # by distinct misses m = 0 .. the most a step has; b: --fill-behind N admissions
        q_of_m, b_of_m = runtime.split.tables(runtime.top_k * self.max_tokens)
        self.books = DeviceBooks(runtime.cache, q_of_m, runtime.device, b_of_m)
        self.storage_words = runtime.cache.storage.view(torch.int32)  # [C, slot_stride / 4]
        self.boxes = {}  # layer -> Mailbox
        self.host_words = {}  # layer -> its bank as words for zero_copy.gather
        self.tables = {}  # tuple of layers -> kernels.ServeTable
        self.order = ()  # the MoE layers of a captured step, in the order they run
        self.seen, self.mode, self.T = [], None, 1
        self.broken = None  # the error of a step whose serving failed (serve)
        self._tables = None  # the split's (q, b) tables, kept once link_busy or admit changed them
        self._busy, self._admit = False, True
        # admissions (--fill-behind N) run on a side stream, beside the step's own work
        self.admissions = (Admissions(runtime, self.boxes, self._src, self.storage_words,
                                      max(b_of_m, default=0)) if self.books.admits else None)

    def describe(self) -> str:
        """How the step is controlled, and what the host server measured so far (the tables'
        counters, cython/serve.h): the mean time from a layer's ready to its done where it ran
        CPU routes, and the mean wait for ready per layer served."""
        text = "GPU-resident control"
        if self.admissions is not None:
            text += self.admissions.describe()
        if any(t.skip_jobs for t in self.tables.values()):
            text += ("; CPU jobs SKIPPED (tuning serve_skip_jobs: zero partials, wrong "
                     "results, timing only)")
        stale = sum(t.stale_reads() for t in self.tables.values())
        if self.tables:  # mailboxes read before their plan's stores reached them (serve.h seq)
            text += f"; stale mailbox reads {stale}"
        stats = [row for t in self.tables.values() for row in t.stats()]
        wait, job, jobs, served = (sum(r[i] for r in stats) for i in range(4))
        if jobs:
            from ... import kernels  # (built: tables exist only over the native kernels)
            t = kernels.job_summary([table.job_times() for table in self.tables.values()])
            text += (f"; host: ready to done {job / jobs / 1e3:.0f} µs per CPU job "
                     f"({jobs / served:.2f} per layer step; p50/p90/p99 {t['p50']}/{t['p90']}/"
                     f"{t['p99']} µs, {t['over']} over {t['over_us']} µs; prepare "
                     f"{t['prep_us']:.1f} µs), waits for ready {wait / served / 1e3:.0f} µs per "
                     f"layer step")
            tr = kernels.trace_summary([table.trace_times() for table in self.tables.values()])
            if tr:  # tuning serve_trace: where a job's time went (serve.h tr_*)
                text += (f"; traced jobs {tr['jobs']}: submit to done {tr['job']:.0f} µs, workers "
                         f"start {tr['wake']:.1f} (last {tr['wake_max']:.1f}) µs after the submit, "
                         f"read G {tr['g_gbs']:.2f} / D {tr['d_gbs']:.2f} GB/s each, D items "
                         f"wait {tr['dwait']:.1f} µs, last ends {tr['spread']:.1f} µs apart, "
                         f"{tr['signal']:.1f} µs to done")
        return text

    def link_busy(self, busy: bool) -> None:
        """busy: the next steps fill and admit nothing (their plan's q and b tables zeroed on
        the device, in stream order: the captured graphs read them at replay); False: the
        split's tables back. runtime.beside_prefill sets it around a decode step beside a
        streamed prefill forward."""
        self._busy = busy
        self._write_tables()

    def admit(self, on: bool) -> None:
        """on False: the next steps admit nothing (the b table zeroed on the device, as
        link_busy does it); True: the split's admissions back. ExpertRuntime.resize_cache turns
        them off where a kept step, captured without the admissions' joins, runs on a cache
        small enough to need them (admissions.py)."""
        self._admit = on
        self._write_tables()

    def _write_tables(self) -> None:
        books = self.books
        if self._tables is None:
            if not self._busy and self._admit:
                return  # never changed
            self._tables = (books.qtab.clone(), books.btab.clone())
        q, b = self._tables
        if self._busy:
            books.qtab.zero_()
        else:
            books.qtab.copy_(q)
        if self._busy or not self._admit:
            books.btab.zero_()
        else:
            books.btab.copy_(b)

    def begin(self, mode: str, T: int = 1) -> None:
        """mode as GraphStep.begin's: 'inline' runs the step now (the host serves each layer as
        it is queued), 'capture' records it. T: the step's tokens (at most max_tokens)."""
        self.mode, self.seen, self.T = mode, [], T
        if self.admissions is not None:
            self.admissions.begin(T)
        if mode == "inline":
            self._books_here()

    def flush(self) -> None:
        """The deferred admissions still pending land (admissions.py); ExpertRuntime.sync_books
        calls it before the books go back to the host."""
        if self.admissions is not None:
            self.admissions.flush()

    def _src(self, layer: int):
        src = self.host_words.get(layer)
        if src is None:
            info = self.rt.infos[layer]
            src = self.host_words[layer] = zero_copy.host_words(
                self.rt.host[layer], info.num_experts, info.slot_stride)
        return src

    def end(self) -> None:
        """After the model's forward (its stream is current): joins the admissions."""
        if self.admissions is not None:
            self.admissions.join()
        if self.mode == "capture":
            self.order = tuple(self.seen)
        elif self.mode == "inline":
            self._count_step(len(self.seen), self.T)
        self.mode, self.seen = None, []

    def forward(self, layer: int, x, expert_ids, weights):
        """x [T, D], expert_ids [T, K], weights [T, K] on the device -> [T, D] in x's dtype."""
        self._check_unbroken()
        T, K = expert_ids.shape
        if T != self.T or T > self.max_tokens:
            raise ValueError(f"GPU-resident control began a step of {self.T} tokens (at most "
                             f"{self.max_tokens}), got {T}")
        box = self.boxes.get(layer)
        if box is None:
            box = self.boxes[layer] = Mailbox(K, x.shape[1], x.device, self.max_tokens)
        adm = self.admissions
        if adm is not None:
            adm.before_plan(layer, first=not self.seen)
        self.seen.append(layer)
        plan_layer(self.books, box, layer, expert_ids.reshape(-1).contiguous(),
                   weights.reshape(-1).to(torch.float32).contiguous(), x.reshape(-1).contiguous(),
                   raise_ready=True)
        if self.rt.cache.capacity:  # (no cache: every route is the CPU's)
            if adm is not None:
                adm.beside_fills(layer, box)
            R = T * K  # the mailbox's front (the step's routes; its fills are listed first)
            zero_copy.gather(self._src(layer), self.storage_words, box.fsrc_d[:R], box.fdst_d[:R],
                             self.rt.infos[layer].slot_stride)
            out = self.experts.run(layer, x, box.slot_d[:R], box.wdev_d[:R],
                                   summed=False)  # fp32 [R, D]
        else:
            out = None
        # interpreted (cpu tensors): the finish kernel runs as it is queued, so the host serves
        # the layer before it; on cuda the host serves while the finish kernel waits for it
        serve_first = self.mode == "inline" and not x.is_cuda
        if serve_first:
            self.serve((layer,))
        y = finish(box, out, x.dtype, T)
        if self.mode == "inline" and not serve_first:
            self.serve((layer,))
        return y

    def replay(self, graph, T: int = 1) -> None:
        """One captured step of T tokens: launch it, then serve its layers' CPU side (returns
        when the last layer's partials are written; the GPU finishes the step after). Served on this thread,
        after the launch: a thread started before it was slower; helping, pinning, a sleeping
        finish kernel moved nothing (docs/MEASUREMENTS.md#host-serving-thread)."""
        self._check_unbroken()
        self._books_here()
        graph.replay()
        self.serve(self.order)
        self._count_step(len(self.order), T)

    def serve(self, layers: tuple) -> None:
        """The host's side of the queued or replayed `layers`. If it fails, whatever failed (the
        native server, or Python before it started), every done is raised so the GPU ends the
        step, and this control takes no more steps."""
        try:
            table = self.tables.get(layers)
            if table is None:
                tuning = self.rt.tuning
                table = self.tables[layers] = self.rt.executor.serve_table(
                    [(layer, self.boxes[layer]) for layer in layers],
                    tuning.serve_trace, tuning.serve_skip_jobs)
            self.rt.executor.serve(table)
        except BaseException as e:
            waited = getattr(e, "waited_for", None)
            report = (self._timeout_report(layers[waited - 1], e.host_routes) if waited else None)
            # a native server that gave up raised the remaining done flags itself; a failure
            # before it started did not, and the GPU would wait on them for ever (any later
            # sync with it too): raise them all. The layers without CPU routes never clear
            # theirs, and a later step would take a stale done for the host's
            # (cython/serve.h): no more steps on these mailboxes
            for layer in layers:
                self.boxes[layer].flags[1] = 1
            self.broken = e
            if report is not None:
                e.args = (f"{e.args[0]}; {report()}",)
            raise

    def _timeout_report(self, layer: int, host_routes: int):
        """For a step whose ready never came: the layer before it (served; the GPU stood in its
        finish or after it). Taken before every done is raised: its done flag and what its
        mailbox lists now; the call (after they are, the GPU drained) adds the CPU routes its
        plan left on the device. A plan that left CPU routes where the host ran none means the
        host read the mailbox before the plan's stores reached it (no done came for them)."""
        box = self.boxes[layer]
        routes = box.ids[:int(box.tokens) * box.K]  # the last plan's (its step's tokens)
        done, listed = int(box.flags[1]), int((routes >= 0).sum())

        def report() -> str:
            text = (f"layer {layer} before it: the host ran {host_routes} CPU routes, its mailbox "
                    f"lists {listed} now, done {'up' if done else 'down'}")
            if not drained(box.ncpu_d.device, timeout_s=10.0):
                return text + ", the GPU had not drained after 10 s"
            planned = int(box.ncpu_d.item())
            text += f", its plan left {planned}"
            if planned > 0 and host_routes == 0:
                text += " (the host read its mailbox before the plan's stores reached it)"
            return text
        return report

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

    def _count_step(self, num_layers: int, T: int) -> None:
        self.rt.count_routes(num_layers * T * self.rt.top_k)  # the rest on pull
