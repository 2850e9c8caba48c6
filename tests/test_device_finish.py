"""The finish kernel of a GPU-controlled MoE layer (experts/handshake.finish): the device
routes' summed output plus the CPU's partial, cast to the model's dtype. Where the plan left
the CPU routes it waits for the host's `done` and clears it; where it left none it neither
waits, nor clears, nor reads the partial. After a failed serve the control refuses further
steps. Also the admissions' looping gather (zero_copy.gather with programs). Kernels: Triton's
interpreter on the CPU when there is no GPU; skipped without Triton."""
import ast
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from freetoken.config import Tuning
from freetoken.experts.captured import control as device_step, handshake
from freetoken.experts.captured.device_plan import Mailbox

kernels = pytest.mark.skipif(
    not device_step.available()
    or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs Triton on cuda, or TRITON_INTERPRET=1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _box(D, ncpu, done):
    box = Mailbox(4, D, DEVICE)
    box.ncpu_d.fill_(ncpu)
    box.flags[1] = done
    return box


@kernels
@pytest.mark.parametrize("D", [100, 2500])  # under one block; several blocks with a tail
@pytest.mark.parametrize("rows", [0, 1, 8])  # 0: no cache, every route the CPU's; 8: per route
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finish_adds_the_partial_once_done(D, rows, dtype):
    g = torch.Generator().manual_seed(D + rows)
    box = _box(D, ncpu=2, done=1)  # the host has served the layer already
    box.partial.copy_(torch.randn(D, generator=g))
    out = torch.randn(rows, D, generator=g).to(DEVICE) if rows else None
    y = handshake.finish(box, out, dtype)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    want = torch.zeros(D)
    for r in range(rows):  # fp32 adds in route order, then the partial's
        want = want + out[r].cpu()
    want = want + box.partial
    assert y.shape == (1, D) and y.dtype == dtype
    # the interpreter casts fp32 -> bf16 by truncation (one bf16 step off at most)
    truncates = dtype == torch.bfloat16 and DEVICE == "cpu"
    tol = dict(rtol=2 ** -7, atol=0) if truncates else dict(rtol=0, atol=0)
    torch.testing.assert_close(y[0].cpu(), want.to(dtype), **tol)
    assert int(box.flags[1]) == 0  # done cleared for the next step


@kernels
@pytest.mark.parametrize("has_out", [False, True])
def test_finish_without_cpu_routes_leaves_flag_and_partial(has_out):
    D = 300
    box = _box(D, ncpu=0, done=1)  # a stale word must stay as it is
    box.partial.fill_(float("nan"))  # not read
    out = torch.randn(1, D).to(DEVICE) if has_out else None
    y = handshake.finish(box, out, torch.float32)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(y[0].cpu(), out[0].cpu() if has_out else torch.zeros(D))
    assert int(box.flags[1]) == 1


def _until_spinning(gpu):
    """Return once the interpreted finish kernel, run by thread gpu, is seen inside its spin on
    done (the lines of _finish's while loop); fail when finish returned instead."""
    src = Path(handshake.__file__).read_text()
    fn = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == "_finish")
    loop = next(n for n in ast.walk(fn) if isinstance(n, ast.While))
    lines = range(loop.lineno, loop.end_lineno + 1)
    end = time.monotonic() + 60  # (a failure bound, not a pacing)
    while time.monotonic() < end:
        f = sys._current_frames().get(gpu.ident)
        while f is not None:
            if f.f_code.co_name == "_finish" and f.f_lineno in lines:
                return
            f = f.f_back
        assert gpu.is_alive(), "finish returned while done was 0"
        time.sleep(0)  # a yield, no delay
    raise AssertionError("finish was never seen waiting for done")


@kernels
def test_finish_waits_for_done():
    """With CPU routes the kernel spins on done and reads the partial after it: the host writes
    the partial and raises done only once the kernel waits (cuda: the launch returned and the
    stream, done still 0, has not finished; the interpreter: the kernel is seen in its loop)."""
    D = 64
    box = _box(D, ncpu=1, done=0)
    box.partial.fill_(0.0)
    out = torch.ones(1, D, device=DEVICE)
    got = []
    if DEVICE == "cuda":
        got.append(handshake.finish(box, out, torch.float32))
        assert not torch.cuda.current_stream().query()
    else:
        gpu = threading.Thread(target=lambda: got.append(handshake.finish(box, out, torch.float32)))
        gpu.start()
        _until_spinning(gpu)
    box.partial.fill_(2.0)  # the host serves: the partial, then done
    box.flags[1] = 1
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    else:
        gpu.join()
    assert torch.equal(got[0][0].cpu(), torch.full((D,), 3.0))
    assert int(box.flags[1]) == 0


@kernels
def test_looping_gather_copies_the_listed_fills():
    """The admissions' gather by a few looping programs: each listed fill lands in its slot
    (several blocks and a tail), a -1 entry copies nothing."""
    from freetoken.experts.transfer import zero_copy
    n = 3 * zero_copy.BLOCK + 5  # words per slot
    host = torch.arange(4 * n, dtype=torch.int32).view(4, n)
    words = (zero_copy.MappedHost(host.pin_memory().view(-1)) if DEVICE == "cuda"
             else host.view(-1))
    pool = torch.zeros(3, n, dtype=torch.int32, device=DEVICE)
    src = torch.tensor([2, -1], device=DEVICE)
    dst = torch.tensor([1, 0], device=DEVICE)
    zero_copy.gather(words, pool, src, dst, 4 * n, programs=2)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(pool[1].cpu(), host[2])
    assert not pool[0].any() and not pool[2].any()  # src -1: untouched


def test_a_failed_serve_stops_device_control():
    """After the server gives up (it raises every remaining done, so layers without CPU routes
    keep a stale one), the control refuses further steps instead of reading stale flags."""
    from types import SimpleNamespace

    from freetoken.kernels import KernelError
    control = device_step.DeviceControl.__new__(device_step.DeviceControl)  # no GPU here

    class Executor:
        def serve_table(self, layers, trace=False, skip_jobs=False):
            return tuple(layer for layer, _ in layers)

        def serve(self, table):
            raise KernelError("a ready flag did not come in time (layer 1)")

    control.rt, control.broken = SimpleNamespace(executor=Executor(), tuning=Tuning()), None
    control.tables, control.boxes = {}, {0: Mailbox(2, 8, "cpu"), 1: Mailbox(2, 8, "cpu")}
    with pytest.raises(KernelError):
        control.serve((0, 1))
    with pytest.raises(RuntimeError, match="load the model again"):
        control.replay(graph=None)
    with pytest.raises(RuntimeError, match="earlier step"):
        control.forward(0, None, torch.zeros(1, 2, dtype=torch.int64), None)


@pytest.mark.parametrize("host_routes", [0, 2])
def test_a_timeout_reports_the_layer_before(host_routes):
    """When a ready never comes, the error tells what the layer before it shows: the CPU
    routes its plan left (device), those the host ran, its mailbox and done flag; a plan that
    left routes the host never ran is named a mailbox read before its stores came."""
    from types import SimpleNamespace

    from freetoken.kernels import KernelError
    control = device_step.DeviceControl.__new__(device_step.DeviceControl)  # no GPU here

    class Executor:
        def serve_table(self, layers, trace=False, skip_jobs=False):
            return tuple(layer for layer, _ in layers)

        def serve(self, table):
            err = KernelError("the GPU did not hand over layer 2")
            err.waited_for, err.host_routes = 2, host_routes
            raise err

    boxes = {layer: Mailbox(2, 8, "cpu") for layer in (3, 5, 7)}
    boxes[5].ids[:] = torch.tensor([4, 9])
    boxes[5].ncpu_d.fill_(2)
    control.rt, control.broken = SimpleNamespace(executor=Executor(), tuning=Tuning()), None
    control.tables, control.boxes = {}, boxes
    with pytest.raises(KernelError) as info:
        control.serve((3, 5, 7))
    text = str(info.value)
    assert text.startswith("the GPU did not hand over layer 2; layer 5 before it: ")
    assert (f"the host ran {host_routes} CPU routes, its mailbox lists 2 now, done down, its "
            "plan left 2") in text
    assert ("before the plan's stores reached it" in text) == (host_routes == 0)
    assert all(int(b.flags[1]) == 1 for b in boxes.values())  # every done raised after
