"""The GPU's side of a GPU-controlled MoE layer's exchange with the host server (device_step.py,
cython/serve.h) through its pinned mailbox (device_plan.Mailbox): how `ready` is raised
(Signals), the finish kernel that waits for `done` and adds the CPU's partial (finish), and a
poll for a stream that may never drain (drained).

Shape legend: D hidden.
"""
import time

import torch

from ..config import env
from ..errors import ConfigError
from . import cuda_copy
from .device_plan import Mailbox

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


if triton is not None:
    @triton.jit
    def _finish(flags_ptr, ncpu_ptr, partial_ptr, out_ptr, y_ptr, D, HAS_OUT: tl.constexpr,
                ROWS: tl.constexpr, BD: tl.constexpr):
        """y = the sum of out's ROWS rows (the device routes' outputs, in route order) + the
        CPU's partial, in y's dtype. When the plan left the CPU routes, wait for the host's
        `done` (a spin on the mapped word, then its clear) and read the partial from the
        mailbox in place; else neither (the host raises no done then)."""
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
                for r in range(ROWS):
                    acc += tl.load(out_ptr + r * D + d, mask=ok, other=0.0)
            if n > 0:
                acc += tl.load(partial_ptr + d, mask=ok, other=0.0, volatile=True)
            tl.store(y_ptr + d, acc.to(y_ptr.dtype.element_ty), mask=ok)


class Signals:
    """How the graph raises a layer's `ready`: by default the plan kernel's own last store, after
    bar.sync and a system-scope fence (device_plan.plan_layer raise_ready: plan);
    FREETOKEN_SIGNALS=memops: a stream memory operation (cuda_copy.write_value, after a memory
    fence), where the driver has them. Either way the mailbox's stores reach the host before
    ready does. A one-thread store kernel after the plan kernel had no such fence: the host
    read mailboxes before their stores came, and it was removed
    (docs/MEASUREMENTS.md#readydone-signals). The wait for `done` is always the finish kernel
    (finish())."""

    HOWS = ("plan", "memops")

    def __init__(self, device):
        how = env("FREETOKEN_SIGNALS")  # one of HOWS (config.ENV)
        if how == "memops" and not memops_work(device):
            raise ConfigError("FREETOKEN_SIGNALS=memops: this driver has no stream memory "
                             "operations; unset it (the default raises ready in the plan kernel)")
        self.how = how
        self.in_plan = how == "plan"  # plan_layer's raise_ready

    def raise_ready(self, box: Mailbox) -> None:
        if self.how == "memops":
            cuda_copy.write_value(box.ready_addr, 1, torch.cuda.current_stream().cuda_stream)


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


def finish(box: Mailbox, out, dtype):
    """The layer's end, one kernel: out (fp32 [R, D], the device routes' weighted outputs, or
    their sum [1, D]; None without a cache) summed, plus the CPU's partial once the host is
    done, as dtype [1, D]. One kernel: the ops it replaces left the stream idle ~17 µs per layer
    (docs/MEASUREMENTS.md#readydone-signals); the routes' sum in it saves torch's reduce
    kernel (~4 µs per layer on the H200: docs/MEASUREMENTS.md#decode-step-kernels)."""
    y = torch.empty((1, box.D), dtype=dtype, device=box.ncpu_d.device)
    rows = 1 if out is None else out.shape[0]
    _finish[(1,)](box.host_view("flags"), box.ncpu_d, box.host_view("partial"),
                  y if out is None else out.contiguous(), y, box.D, HAS_OUT=out is not None,
                  ROWS=rows, BD=1024, num_warps=1)
    return y


def memops_work(device) -> bool:
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
