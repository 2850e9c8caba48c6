"""LayerStreamer: prefill's expert-layer streaming. Whole expert layers are copied from the host
banks into N device layer buffers (config.Tuning `prefill_buffers`, default 2) while the
layers before them compute. cuda: a copy stream and events; cpu tier: a background copy thread.
Knows nothing of routes or of the expert cache.

The i-th MoE layer (layer order) always goes to buffer i % N. begin() issues the first N copies;
release(l), called once the compute has queued its last read of l's buffer, at once issues the
copy of the MoE layer N places later into that same buffer. On cuda that copy waits GPU-side
for the compute (the `free` event), never for the host, so it starts the moment the buffer is
free, even while the host is blocked on a later layer's routing.

    N = 2:  buffer 0: 0 . 2 . 4     copy(l+2) waits for compute(l): a copy can start only
            buffer 1: . 1 . 3 .     when the layer just before it has finished computing
    N = 3:  copy(l+3) waits for compute(l): one more layer of slack, one more buffer of memory

A layer that takes the slot path instead (prefill/choice.py) calls skip(l): its buffer is not
read. A copy of it already issued is sunk: on cuda a queued copy cannot be withdrawn, and it
is cheaper to let it land than to break the copy stream's order (the copies behind it wait for
it either way, and the buffer's `free` event from the compute before stays valid); on the cpu
tier a copy that has not started is withdrawn (Future.cancel). skip issues nothing: the layer N
places later is predicted to take the slot path too. If it streams after all, acquire() copies
it on demand (exposed: the choice counted the whole copy for it) and its release() issues the
next copy again, so the pipeline picks up where the layers stream. A streamed layer's
release(l, ahead=False) does the same when the runtime predicts the layer N places on takes
the slot path (its whole copy against this layer's slot cost): a copy issued ahead would be
sunk, and would make that layer's streaming look cheaper than it was.

Buffer states (per buffer b):
  holder[b]  the layer whose bytes are (or are being) copied into b, or None
  ready[b]   cuda Event / Future that completes when that copy is done
  free[b]    cuda Event recorded after the last compute that read b (the next copy waits on it)
  ends[b]    when the copy into b should end by the model clock (perf_counter s, at `gbps`):
             copy_left_us() answers from it while the copy is not done

Device memory: N x max over layers of E * slot_stride bytes (Qwen3-30B-A3B bf16: 1.21 GB per
buffer), allocated at the first streamed step and kept. With `timing` set, each step also keeps
a StreamTimeline (when each copy and each layer's compute ran); tools/bench_prefill.py reads it.
"""
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch

from ...errors import ConfigError


class LayerStreamer:
    def __init__(self, banks: dict, host: dict, device, num_buffers: int = 2):
        is_int = isinstance(num_buffers, (int, np.integer)) and not isinstance(num_buffers, bool)
        if not is_int or num_buffers < 1:
            raise ConfigError(f"prefill_buffers must be an integer >= 1 (device layer buffers for "
                              f"streamed prefill; 2 overlaps each copy with one layer's compute), "
                              f"not {num_buffers!r}")
        self.order = sorted(banks)
        self.position = {layer: i for i, layer in enumerate(self.order)}
        self.infos = {layer: b.info for layer, b in banks.items()}
        self.host = host  # {layer: uint8 host tensor}, pinned on cuda
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.num_buffers = N = int(num_buffers)
        self.nbytes = max((self.layer_bytes(layer) for layer in self.order), default=0)
        self.buffers = None  # N uint8 [nbytes] tensors, allocated on first use
        self.holder, self.ready, self.free = [None] * N, [None] * N, [None] * N
        self.in_use = None  # buffer acquired and not yet released
        self.copy_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self.pool = None if self.is_cuda else ThreadPoolExecutor(1, thread_name_prefix="ft-stream")
        self.timing = False  # keep a StreamTimeline per step (bench_prefill.py sets it)
        self.timeline = None  # the current (or last) step's StreamTimeline when timing
        self.gbps = 25.0  # B_P of the model clock (the runtime sets the measured one)
        self.ends = [0.0] * N
        self.copy_clock = 0.0  # when the last issued copy should end (copies run one at a time)

    def layer_bytes(self, layer: int) -> int:
        info = self.infos[layer]
        return info.num_experts * info.slot_stride

    @property
    def memory_bytes(self) -> int:
        """Device bytes the layer buffers take (once allocated)."""
        return self.num_buffers * self.nbytes

    # ---- the step ---------------------------------------------------------------------------

    def begin(self) -> None:
        """A streamed step starts: issue the copies of the first N MoE layers. A streamed step
        copies each layer it computes from a buffer once (nothing is kept from the step before,
        even when all layers would fit: the runtime counts bytes_streamed per layer computed);
        a layer that takes the slot path may still have been copied (skip: sunk)."""
        if self.in_use is not None:  # the last step failed between acquire and release
            self._record_free(self.in_use)
            self.in_use = None
        if self.timing:
            self.timeline = StreamTimeline(self.device)
        for i, layer in enumerate(self.order[:self.num_buffers]):
            self._copy(layer, i)

    def acquire(self, layer: int) -> torch.Tensor:
        """The layer's bytes, uint8 [E * slot_stride] on the device, ready for the current
        stream (on cuda it is made to wait for the copy; on the cpu tier this waits)."""
        b = self.position[layer] % self.num_buffers
        if self.holder[b] != layer:  # not issued ahead (a step begun without begin())
            self._copy(layer, b)
        tl = self.timeline
        if tl is not None:
            tl.mark(("want", layer))
        if self.is_cuda:
            torch.cuda.current_stream(self.device).wait_event(self.ready[b])
        else:
            self.ready[b].result()
        if tl is not None:
            tl.mark(("compute", layer))
        self.in_use = b
        return self.buffers[b][:self.layer_bytes(layer)]

    def release(self, layer: int, ahead: bool = True) -> None:
        """The compute has queued all its reads of `layer`'s buffer (on the cpu tier: done
        them). Issues the copy of the MoE layer N places later into this buffer, unless not
        `ahead` (that layer is expected to take the slot path; it copies on demand if not)."""
        b = self.position[layer] % self.num_buffers
        self._record_free(b)
        self.in_use = None
        if self.timeline is not None:
            self.timeline.mark(("compute_end", layer))
        i = self.position[layer] + self.num_buffers
        if ahead and i < len(self.order):
            self._copy(self.order[i], b)

    def skip(self, layer: int) -> bool:
        """`layer` takes the slot path in this step: its buffer is not read (module docstring).
        True when a copy of it was issued and is sunk (not withdrawn)."""
        b = self.position[layer] % self.num_buffers
        if self.holder[b] != layer:
            return False
        if not self.is_cuda and self.ready[b].cancel():  # not started: withdrawn
            self.holder[b] = None
            return False
        return True

    def copy_left_us(self, layer: int):
        """µs left of `layer`'s copy in this step: None when it was not issued, 0.0 when done,
        else the model clock's estimate (at least 1 µs: it is not done)."""
        b = self.position[layer] % self.num_buffers
        if self.holder[b] != layer:
            return None
        ready = self.ready[b]
        if ready.query() if self.is_cuda else ready.done():
            return 0.0
        return max(1.0, (self.ends[b] - time.perf_counter()) * 1e6)

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        if self.copy_stream is not None:
            self.copy_stream.synchronize()  # no copy may still write a buffer being freed

    # ---- copies -------------------------------------------------------------------------------

    def _record_free(self, b: int) -> None:
        if self.is_cuda:
            self.free[b] = torch.cuda.Event()
            self.free[b].record(torch.cuda.current_stream(self.device))

    def _copy(self, layer: int, b: int) -> None:
        """Copy `layer` into buffer b once the compute has released b (cuda: GPU-side wait on
        free[b]; cpu tier: the one worker runs copies in submission order, and the compute has
        finished with b by the time release() issues a copy into it)."""
        if self.buffers is None:
            self.buffers = [torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
                            for _ in range(self.num_buffers)]
            for i in range(self.num_buffers):  # the allocator may hand back memory that kernels
                self._record_free(i)  # queued on the compute stream still read: wait for them
        n = self.layer_bytes(layer)
        dst, src = self.buffers[b][:n], self.host[layer]
        self.holder[b] = layer
        self.ends[b] = self.copy_clock = max(time.perf_counter(), self.copy_clock) + n / (self.gbps * 1e9)
        tl = self.timeline
        if self.is_cuda:
            with torch.cuda.stream(self.copy_stream):
                if tl is not None:
                    tl.mark(("queued", layer), self.copy_stream)  # done when the stream gets here
                if self.free[b] is not None:
                    self.copy_stream.wait_event(self.free[b])
                if tl is not None:
                    tl.mark(("copy", layer), self.copy_stream)
                dst.copy_(src, non_blocking=True)
                self.ready[b] = torch.cuda.Event(enable_timing=tl is not None)
                self.ready[b].record(self.copy_stream)
            if tl is not None:
                tl.copies.append((layer, n))
                tl.events[("copy_end", layer)] = self.ready[b]
        elif tl is None:  # numpy's memcpy releases the GIL and starts no OpenMP team on the
            # compute's cores
            self.ready[b] = self.pool.submit(np.copyto, dst.numpy(), src.numpy())
        else:
            tl.copies.append((layer, n))
            tl.mark(("queued", layer))
            self.ready[b] = self.pool.submit(_timed_copy, tl, layer, dst.numpy(), src.numpy())


def _timed_copy(tl, layer, dst, src):
    tl.mark(("copy", layer))
    np.copyto(dst, src)
    tl.mark(("copy_end", layer))


class Span(NamedTuple):
    """One streamed layer of a step, times in ms from the step's begin()."""
    layer: int
    nbytes: int
    queued: float       # the copy was issued and the copy stream had finished what came before
    copy: float         # the copy started (its buffer was free)
    copy_end: float
    want: float         # the compute stream reached the layer's experts (attention, router done)
    compute: float      # ... and the layer's copy was done: the experts start
    compute_end: float  # the experts' last kernel finished (cuda) / returned (cpu tier)


class StreamTimeline:
    """Timestamps of one streamed step. cuda: timing events on the copy and compute streams
    (resolved by spans(), which synchronizes: call it after the step); cpu tier: perf_counter
    stamps (the copy thread's too)."""

    def __init__(self, device):
        self.is_cuda = device.type == "cuda"
        self.device = device
        self.events = {}  # key -> cuda Event or perf_counter seconds
        self.copies = []  # (layer, nbytes) in issue order
        self.mark("begin")

    def mark(self, key, stream=None) -> None:
        if self.is_cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
            self.events[key] = ev
        else:
            self.events[key] = time.perf_counter()

    def elapsed_ms(self, key) -> float:
        ev, base = self.events[key], self.events["begin"]
        if self.is_cuda:
            return base.elapsed_time(ev)
        return (ev - base) * 1e3

    def spans(self) -> list:
        """[Span] of every layer that was both copied and computed in this step, in layer
        order. Call once the step's work is done (the bench marks "end" and syncs)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
        out = []
        for layer, n in dict(self.copies).items():  # a layer copied twice: its last copy
            keys = [(k, layer) for k in ("queued", "copy", "copy_end", "want", "compute",
                                         "compute_end")]
            if all(k in self.events for k in keys):
                out.append(Span(layer, n, *(self.elapsed_ms(k) for k in keys)))
        return sorted(out, key=lambda s: s.copy)
