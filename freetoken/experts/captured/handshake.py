"""The GPU's side of a GPU-controlled MoE layer's exchange with the host server (captured/control.py,
cython/serve.h) through its pinned mailbox (device_plan.Mailbox): the finish kernel that waits
for `done` and adds the CPU's partial (finish), and a poll for a stream that may never drain
(drained). `ready` is raised by the plan kernel itself, as its last store after bar.sync and a
system-scope fence (device_plan.plan_layer), so the mailbox's stores reach the host before it
(docs/MEASUREMENTS.md#readydone-signals).

Shape legend: T tokens of the step, D hidden.
"""
import time

import torch

from .device_plan import Mailbox

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


if triton is not None:
    @triton.jit
    def _finish(flags_ptr, ncpu_ptr, partial_ptr, out_ptr, y_ptr, T, D, HAS_OUT: tl.constexpr,
                ROWS: tl.constexpr, BD: tl.constexpr):
        """y[t] = the sum of out's ROWS rows of token t (the device routes' outputs, in route
        order) + the CPU's partial of token t, in y's dtype, for the T tokens. When the plan
        left the CPU routes, wait for the host's `done` (a spin on the mapped word, then its
        clear) and read the partials from the mailbox in place; else neither (the host raises
        no done then)."""
        n = tl.load(ncpu_ptr)
        if n > 0:
            v = tl.load(flags_ptr + 1, volatile=True)
            while v != 1:
                v = tl.load(flags_ptr + 1, volatile=True)
            tl.store(flags_ptr + 1, 0)
        for t in range(T):
            for d0 in range(0, D, BD):
                d = d0 + tl.arange(0, BD)
                ok = d < D
                acc = tl.zeros([BD], dtype=tl.float32)
                if HAS_OUT:
                    for r in range(ROWS):
                        acc += tl.load(out_ptr + (t * ROWS + r) * D + d, mask=ok, other=0.0)
                if n > 0:
                    acc += tl.load(partial_ptr + t * D + d, mask=ok, other=0.0, volatile=True)
                tl.store(y_ptr + t * D + d, acc.to(y_ptr.dtype.element_ty), mask=ok)


def drained(device, timeout_s: float) -> bool:
    """Whether the current stream's work ends within timeout_s (polled: a plain sync would
    hang with a GPU that still waits for something)."""
    if device.type != "cuda":
        return True
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    end = time.monotonic() + timeout_s
    while not ev.query():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def finish(box: Mailbox, out, dtype, T: int = 1):
    """The layer's end for the step's T tokens, one kernel: out (fp32 [T*K, D], the device
    routes' weighted outputs, or their sums [T, D]; None without a cache) summed per token, plus
    the CPU's partial of each once the host is done, as dtype [T, D]. One kernel: the ops it
    replaces left the stream idle between them (docs/MEASUREMENTS.md#readydone-signals); the
    routes' sum in it saves torch's reduce kernel (docs/MEASUREMENTS.md#decode-step-kernels)."""
    y = torch.empty((T, box.D), dtype=dtype, device=box.ncpu_d.device)
    rows = 1 if out is None else out.shape[0] // T
    _finish[(1,)](box.host_view("flags"), box.ncpu_d, box.host_view("partial"),
                  y if out is None else out.contiguous(), y, T, box.D, HAS_OUT=out is not None,
                  ROWS=rows, BD=1024, num_warps=1)
    return y
