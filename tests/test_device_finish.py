"""The finish kernel of a GPU-controlled MoE layer (experts/device_step.finish): the device
routes' output (one summed row, or the routes' rows summed in route order) plus the CPU's
partial, cast to the model's dtype. Where the plan left the CPU routes it waits for the host's
`done` and clears it; where it left none it neither waits, nor clears, nor reads the partial.
Triton's interpreter on the CPU when there is no GPU; skipped without Triton."""
import os
import threading
import time

import pytest
import torch

from freetoken.experts import device_step
from freetoken.experts.device_plan import Mailbox

pytestmark = pytest.mark.skipif(
    not device_step.available()
    or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs Triton on cuda, or TRITON_INTERPRET=1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _box(D, ncpu, done):
    box = Mailbox(4, D, DEVICE)
    box.ncpu_d.fill_(ncpu)
    box.flags[1] = done
    return box


@pytest.mark.parametrize("D", [100, 2500])  # under one block; several blocks with a tail
@pytest.mark.parametrize("rows", [0, 1, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finish_adds_the_partial_once_done(D, rows, dtype):
    g = torch.Generator().manual_seed(D + rows)
    box = _box(D, ncpu=2, done=1)  # the host has served the layer already
    box.partial.copy_(torch.randn(D, generator=g))
    out = torch.randn(rows, D, generator=g).to(DEVICE) if rows else None
    y = device_step.finish(box, out, dtype)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    want = torch.zeros(D)
    for r in range(rows):  # route order, one fp32 add each, then the partial: bit for bit
        want = want + out[r].cpu()
    want = want + box.partial
    assert y.shape == (1, D) and y.dtype == dtype
    # the interpreter casts fp32 -> bf16 by truncation (one bf16 step off at most)
    truncates = dtype == torch.bfloat16 and DEVICE == "cpu"
    tol = dict(rtol=2 ** -7, atol=0) if truncates else dict(rtol=0, atol=0)
    torch.testing.assert_close(y[0].cpu(), want.to(dtype), **tol)
    assert int(box.flags[1]) == 0  # done cleared for the next step


@pytest.mark.parametrize("rows", [0, 1, 8])
def test_finish_without_cpu_routes_leaves_flag_and_partial(rows):
    D = 300
    box = _box(D, ncpu=0, done=1)  # a stale word must stay as it is
    box.partial.fill_(float("nan"))  # not read
    out = torch.randn(rows, D).to(DEVICE) if rows else None
    y = device_step.finish(box, out, torch.float32)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    want = torch.zeros(D)
    for r in range(rows):
        want = want + out[r].cpu()
    assert torch.equal(y[0].cpu(), want)
    assert int(box.flags[1]) == 1


def test_finish_waits_for_done():
    D = 64
    box = _box(D, ncpu=1, done=0)
    box.partial.fill_(0.0)

    def host():  # serves late: the partial, then done
        time.sleep(0.05)
        box.partial.fill_(2.0)
        box.flags[1] = 1

    t = threading.Thread(target=host)
    t.start()
    y = device_step.finish(box, torch.ones(1, D, device=DEVICE), torch.float32)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    t.join()
    assert torch.equal(y[0].cpu(), torch.full((D,), 3.0))
    assert int(box.flags[1]) == 0
