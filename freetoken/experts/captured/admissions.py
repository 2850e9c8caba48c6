"""Admissions of a captured decode step under GPU-resident control (captured/control.py): CPU-run
misses copied into the expert cache in the background, so later tokens hit them.

Admissions (--fill-behind N, by default 1 in steps of at most 3 misses: runtime.py): the plan
kernel also gives the next N misses LRU slots (as the host planner does) and leaves them in the
layer's mailbox (asrc_d, adst_d); a gather on a side stream copies them in, started with the
layer's plan, joined at the step's end (on the cpu, under Triton's interpreter in tests, the
gathers run in place, in the step's order: no side stream). It is a background
gather: ADMIT_PROGRAMS looping programs (zero_copy.gather) instead of one per 16 KiB block, so it
takes the link's idle time (the next layers' attention, the CPU-only stretches) and yields it to
the critical fills beside it, which have hundreds of programs' reads in flight (a full-grid
gather put each admission on the critical path: docs/MEASUREMENTS.md#admission-gather). The
admission kernel is first launched at construction (_load_kernel), never inside a step.

Deferred admissions (config.Tuning admit_defer, by default the last half; one-token steps only:
a batched step gathers its own and joins those deferred to it before its first plan): the last N
MoE layers' admissions are gathered at the start of the next step instead of in their own, so
the step does not end waiting for a backlog of them; the next step joins them before the first
of those layers plans. Their lists stay in the layers' mailboxes until then (each gather clears
its list: nothing is copied twice), and ExpertRuntime.sync_books gathers what is still pending
(flush) before the host reads the books. Safe for the same reason as joining at the step's end:
from its plan to its join an admitted slot sees at most one step's touches (the last N layers of
one step, the first L - N of the next), so it is never the LRU victim meanwhile, and only its
own layer reads it, after the join. Off where the cache is too small for that (join_each_layer).

Tried and removed (the runs: docs/MEASUREMENTS.md):
  admissions polling a host word         docs/MEASUREMENTS.md#admission-gather
  admissions waiting out CPU jobs        docs/MEASUREMENTS.md#admission-gather
  no admissions while some are pending   docs/MEASUREMENTS.md#admissions
  every admission half a step later      docs/MEASUREMENTS.md#hot-expert-reads
  admissions after the CPU job           docs/MEASUREMENTS.md#admission-gather

Shape legend: L MoE layers.
"""
import torch

from ..transfer import zero_copy

# Admission gather programs: alone 8 gather as fast as the full grid, and beside a critical
# fill they leave its time as it is (docs/MEASUREMENTS.md#admission-gather)
ADMIT_PROGRAMS = 8


def defer_layers(order: list, setting) -> tuple:
    """The MoE layers (of `order`, as a step runs them) whose admissions wait for the next
    step, by config.Tuning admit_defer: None (the default) the last half, N the last N (at most
    all but the first), 0 none. Half: the step's end no longer waits for the admissions' backlog,
    and half a step is left to gather them (docs/MEASUREMENTS.md#admissions)."""
    n = len(order) // 2 if setting is None else min(setting, len(order) - 1)
    return tuple(order[len(order) - n:]) if n > 0 else ()


class Admissions:
    """The side stream and the joins of a step's admissions, for control.DeviceControl,
    which calls, per MoE layer as the step runs: before_plan, then (with a cache) beside_fills
    before its fills; and join() after the step's last layer.

    boxes: the control's layer -> Mailbox (filled as layers are first seen); src(layer): the
    layer's host bank as zero_copy.gather's source; storage_words: the slot pool as int32 words;
    admits_per_step: the most admissions one layer step makes."""

    def __init__(self, runtime, boxes: dict, src, storage_words, admits_per_step: int):
        self.rt, self.boxes, self.src, self.storage_words = runtime, boxes, src, storage_words
        # (cpu: None, each gather in place)
        self.side = torch.cuda.Stream(runtime.device) if runtime.is_cuda else None
        self.admitted = None  # the event of the last admission gather not yet joined
        self.deferred = None  # the event of the deferred admissions not yet joined
        # the gather's programs (zero_copy.gather): a few looping ones that yield the link to
        # the fills beside them
        self.programs = ADMIT_PROGRAMS
        self.admits_per_step = admits_per_step
        # the most tokens a step of these mailboxes plans (batched steps: T * K routes)
        self.max_tokens = max((getattr(b, "max_tokens", 1) for b in boxes.values()), default=1)
        self.join_each_layer = self.joins_each_layer(runtime.cache.capacity)
        # the MoE layers whose admissions wait for the next step (Tuning.admit_defer)
        self.defer = defer_layers(sorted(runtime.infos), runtime.tuning.admit_defer)
        if self.join_each_layer:
            self.defer = ()
        self.T, self.join_now, self.defer_now = 1, self.join_each_layer, self.defer
        self._load_kernel()

    def joins_each_layer(self, capacity: int, T: int = 1) -> bool:
        """Whether a cache of `capacity` slots joins the admissions before every layer's fills
        in a step of T tokens. The next layers' fills may run beside the admissions (other
        slots) unless a slot admitted in this step can be taken again in it: an admitted slot is
        stamped newer than every slot but those touched after it, and a step of T tokens
        touches at most layers * (T * K + admissions) slots; smaller caches join. Fixed in the
        captured steps: after a resize that keeps them, ExpertRuntime turns the admissions off
        where a step lacks the joins the new size needs."""
        rt = self.rt
        return capacity <= len(rt.banks) * (T * rt.top_k + self.admits_per_step)

    def _load_kernel(self) -> None:
        """Compile and load the admission gather now, outside any step: a module loaded behind a
        layer's wait for the host waits for the blocked stream, a deadlock (seen on the H200
        host). A fill list of -1 moves nothing."""
        none = torch.full((1,), -1, dtype=torch.int64, device=self.rt.device)
        src = self.src(next(iter(self.rt.infos)))
        for stride in sorted({i.slot_stride for i in self.rt.infos.values()}):
            zero_copy.gather(src, self.storage_words, none, none.clamp(min=0), stride,
                             programs=self.programs)
        none.fill_(-1)  # the deferred lists' clear (_gather_lists)
        if self.side is not None:
            torch.cuda.synchronize(self.rt.device)

    def describe(self) -> str:
        if not self.defer:
            return ""
        return f"; the last {len(self.defer)} layers' admissions gathered in the next step"

    def begin(self, T: int = 1) -> None:
        """A step of T tokens begins. A batched step (T > 1) defers none of its admissions
        and joins those deferred to it before its first plan: the deferral's bound (above)
        counts one-token steps' touches."""
        self.deferred = None
        self.T = T
        self.join_now = self.join_each_layer if T == 1 else self.joins_each_layer(
            self.rt.cache.capacity, T)
        self.defer_now = self.defer if T == 1 else ()

    def before_plan(self, layer: int, first: bool) -> None:
        """At the step's first layer: the deferred lists the last step left, gathered on the
        side stream; before the first deferred layer's plan rewrites them, their join."""
        if first and self.defer:
            self._gather_deferred()
            if self.T > 1 and self.deferred is not None:
                torch.cuda.current_stream().wait_event(self.deferred)
                self.deferred = None
        if self.defer_now and layer == self.defer_now[0] and self.deferred is not None:
            torch.cuda.current_stream().wait_event(self.deferred)
            self.deferred = None

    def beside_fills(self, layer: int, box) -> None:
        """After the layer's plan, before its fills (a step with a cache)."""
        if self.join_now:
            self.join()
        if layer not in self.defer_now:
            self._admit(layer, box)

    def join(self) -> None:
        """The current stream waits for the last admissions (DeviceControl.end: the step's)."""
        if self.admitted is not None:
            torch.cuda.current_stream().wait_event(self.admitted)
            self.admitted = None

    def flush(self) -> None:
        """Gathers, on the current stream, the deferred admissions still pending (the last
        step's); ExpertRuntime.sync_books calls it before the books go back to the host."""
        with torch.inference_mode():  # (the mailboxes were made in the steps' inference mode)
            self._gather_lists(None)

    def _admit(self, layer: int, box) -> None:
        """The layer's admissions, gathered on the side stream from this point of the step. A
        layer of self.defer (in a batched step, which defers none) clears its list after the
        gather: the next step's start, or a flush, would gather it again."""
        clear = layer in self.defer
        if self.side is None:
            self._gather(layer, box, clear)
            return
        main = torch.cuda.current_stream()
        self.side.wait_stream(main)  # (after its last admissions, on the same stream)
        with torch.cuda.stream(self.side):
            self._gather(layer, box, clear)
        self.admitted = torch.cuda.Event()
        self.admitted.record(self.side)

    def _gather(self, layer: int, box, clear: bool) -> None:
        n = self.admits_per_step  # the list's front (the plan lists at most that many)
        zero_copy.gather(self.src(layer), self.storage_words, box.asrc_d[:n], box.adst_d[:n],
                         self.rt.infos[layer].slot_stride, programs=self.programs)
        if clear:
            box.asrc_d.fill_(-1)

    def _gather_deferred(self) -> None:
        """At the step's start: the admissions the previous step left to it (self.defer), on
        the side stream; each list is cleared once gathered."""
        if not any(layer in self.boxes for layer in self.defer):
            return
        if self.side is None:
            self._gather_lists(self.programs)
            return
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            self._gather_lists(self.programs)
        self.deferred = self.admitted = torch.cuda.Event()
        self.deferred.record(self.side)

    def _gather_lists(self, programs) -> None:
        """The deferred layers' admission lists gathered on the current stream, each cleared
        after its gather (zero_copy.gather's programs: None the full grid, G looping ones)."""
        for layer in self.defer:
            box = self.boxes.get(layer)
            if box is not None:
                n = self.admits_per_step  # (as _gather)
                zero_copy.gather(self.src(layer), self.storage_words, box.asrc_d[:n],
                                 box.adst_d[:n], self.rt.infos[layer].slot_stride,
                                 programs=programs)
                box.asrc_d.fill_(-1)
