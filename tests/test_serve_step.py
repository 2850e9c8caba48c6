"""The native server of a GPU-controlled decode step (cython/serve.h, kernels.CpuExpertPool.serve):
a thread stands in for the GPU, filling each layer's mailbox and raising its ready flag; the
server must run exactly the listed routes, write the partial and raise done, layer by layer.
With a copier, the CUDA driver's entry points are ctypes callbacks over host memory: the server
must copy each layer's fills before `filled`, its admissions after `done`, and order a layer's
next fills behind its admissions."""
import ctypes
import threading
import time

import numpy as np
import pytest
import torch

from freetoken import kernels
from freetoken.experts.device_plan import Mailbox

from test_kernels import make_bank


def _fake_gpu(boxes, steps, rng, log):
    """For each step and layer: wait until done is down, fill the mailbox, raise ready, wait for
    done, record the partial, clear done (what the graph does)."""
    for step in range(steps):
        for i, (box, E) in enumerate(boxes):
            ids = rng.choice(E, size=box.K, replace=False)
            cpu = rng.random(box.K) < 0.6
            box.ids.copy_(torch.from_numpy(np.where(cpu, ids, -1)))
            box.w.copy_(torch.from_numpy(rng.random(box.K).astype(np.float32)))
            box.x.copy_(torch.randn(box.D))
            box.partial.fill_(float("nan"))  # the server must overwrite it
            box.flags[0] = 1
            while int(box.flags[1]) != 1:
                time.sleep(0)
            log.append((i, box.ids.clone(), box.w.clone(), box.x.clone(), box.partial.clone()))
            box.flags[1] = 0


def test_serve_runs_listed_routes_layer_by_layer():
    pool = kernels.CpuExpertPool(2, spin_us=0)
    D, I, K = 40, 24, 4
    layers = []
    for seed, E in ((0, 8), (1, 6)):
        bank, lay, _, w3 = make_bank(E, D, I, "bf16", seed)
        layers.append((bank, lay, w3, Mailbox(K, D, "cpu"), E))
    table = pool.serve_table([(bank, lay, "silu", box, 0) for bank, lay, _, box, _ in layers])
    log = []
    gpu = threading.Thread(target=_fake_gpu, args=([(b, E) for *_, b, E in layers], 3,
                                                   np.random.default_rng(0), log))
    gpu.start()
    for _ in range(3):
        pool.serve(table, timeout_s=30)
    gpu.join()
    assert len(log) == 6
    for i, ids, w, x, partial in log:
        bank, lay, w3, box, E = layers[i]
        on = ids >= 0
        want = torch.zeros(1, D)
        if on.any():  # the kernel itself, on the same routes (checked against torch elsewhere)
            tok = np.zeros(int(on.sum()), np.int32)
            pool.run(x[None].contiguous().numpy(), bank, lay, tok, ids[on].numpy().astype(np.int32),
                     w[on].numpy(), want.numpy())
        assert torch.isfinite(partial).all()
        torch.testing.assert_close(partial, want[0], rtol=1e-5, atol=1e-6)
        assert int(box.flags[0]) == 0  # the server cleared ready


def test_serve_times_out_and_releases_the_gpu():
    pool = kernels.CpuExpertPool(1, spin_us=0)
    bank, lay, _, _ = make_bank(4, 32, 16, "bf16")
    boxes = [Mailbox(2, 32, "cpu") for _ in range(3)]
    boxes[0].ids.copy_(torch.tensor([-1, -1]))
    boxes[0].flags[0] = 1  # layer 0 ready, layer 1 never
    table = pool.serve_table([(bank, lay, "silu", b, 0) for b in boxes])
    with pytest.raises(kernels.KernelError, match="layer 1"):
        pool.serve(table, timeout_s=0.05)
    assert [int(b.flags[1]) for b in boxes] == [1, 1, 1]  # done raised: a waiting GPU ends
    assert torch.equal(boxes[0].partial, torch.zeros(32))


def test_serve_table_checks_the_mailbox():
    pool = kernels.get_pool(1, spin_us=0)
    bank, lay, _, _ = make_bank(4, 32, 16, "bf16")
    with pytest.raises(kernels.KernelArgumentError, match="mailbox"):
        pool.serve_table([(bank, lay, "silu", Mailbox(2, 48, "cpu"), 0)])


# ---- copies (a copier: the host queues fills and admissions) ------------------------------

_COPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t,
                         ctypes.c_void_p)
_WRITE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32,
                          ctypes.c_uint)
_RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_WAIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
FILL, ADMIT, EVENT = 11, 22, 33  # fake stream and event handles


class FakeDriver:
    """The four driver calls over host memory: copies land at once (a stream that is always
    done), stream writes store the word; every call is logged as (name, stream, ...)."""

    def __init__(self, storage: np.ndarray, fail_copy_at=None):
        self.storage, self.log, self.fail_copy_at = storage, [], fail_copy_at

        def copy(dst, src, n, stream):
            if self.fail_copy_at is not None and len(self._copies()) == self.fail_copy_at:
                return 700
            ctypes.memmove(dst, src, n)
            self.log.append(("copy", stream, (dst - storage.ctypes.data) // storage.strides[0]))
            return 0

        def write(stream, addr, value, flags):
            ctypes.c_int32.from_address(addr).value = value
            self.log.append(("write", stream, addr))
            return 0

        def record(event, stream):
            self.log.append(("record", stream, event))
            return 0

        def wait(stream, event, flags):
            self.log.append(("wait", stream, event))
            return 0

        self.fns = (_COPY(copy), _WRITE(write), _RECORD(record), _WAIT(wait))

    def _copies(self):
        return [e for e in self.log if e[0] == "copy"]

    def copier(self):
        addrs = tuple(ctypes.cast(f, ctypes.c_void_p).value for f in self.fns)
        return (*addrs, FILL, ADMIT, self.storage.ctypes.data, self.storage.strides[0])


def _slot_bytes(bank, lay, e):
    return bank[e * lay.slot_stride:(e + 1) * lay.slot_stride]


def test_serve_copies_fills_before_filled_and_admissions_after_done():
    pool = kernels.CpuExpertPool(2, spin_us=0)
    D, I, K, E, C = 40, 24, 4, 8, 16
    bank, lay, _, _ = make_bank(E, D, I, "bf16", 3)
    storage = np.zeros((C, lay.slot_stride + 64), np.uint8)  # slot stride > the layer's
    drv = FakeDriver(storage)
    boxes = [Mailbox(K, D, "cpu") for _ in range(2)]
    table = pool.serve_table([(bank, lay, "silu", b, EVENT) for b in boxes], drv.copier())
    # step 0: layer 0 fills experts 1, 5 into slots 3, 9 and admits expert 6 into slot 12;
    # layer 1 fills nothing and admits nothing. step 1: layer 0 fills nothing (its previous
    # admissions must be waited for), layer 1 fills expert 2 into slot 0
    plans = [[([1, 5], [3, 9], [6], [12]), ([], [], [], [])],
             [([], [], [], []), ([2], [0], [], [])]]
    seen = []

    def gpu():
        for step, plan in enumerate(plans):
            for box, (fs, fd, as_, ad) in zip(boxes, plan):
                box.lists.fill_(-1)
                for row, vals in enumerate((fs, fd, as_, ad)):
                    box.lists[row, :len(vals)] = torch.tensor(vals, dtype=torch.int64)
                box.ids.copy_(torch.tensor([0, -1, -1, -1]))  # one CPU route
                box.w.fill_(0.5)
                box.x.copy_(torch.randn(D))
                box.flags[0] = 1
                while int(box.flags[2]) != 1:  # filled
                    time.sleep(0)
                for e, slot in zip(fs, fd):  # the fills landed before filled
                    seen.append(np.array_equal(storage[slot, :lay.slot_stride],
                                               _slot_bytes(bank, lay, e)))
                box.flags[2] = 0
                while int(box.flags[1]) != 1:
                    time.sleep(0)
                box.flags[1] = 0

    t = threading.Thread(target=gpu)
    t.start()
    for _ in plans:
        pool.serve(table, timeout_s=30)
    t.join()
    assert seen == [True, True, True]
    assert np.array_equal(storage[12, :lay.slot_stride], _slot_bytes(bank, lay, 6))  # admitted
    assert not storage[12, lay.slot_stride:].any()  # nothing past the layer's slot bytes
    f0, f1 = boxes[0].filled_addr, boxes[1].filled_addr
    assert drv.log == [
        ("copy", FILL, 3), ("copy", FILL, 9), ("write", FILL, f0),  # step 0, layer 0 fills
        ("copy", ADMIT, 12), ("record", ADMIT, EVENT),              # ... its admission
        # layer 1: nothing to copy or wait for: filled raised directly
        ("wait", FILL, EVENT), ("write", FILL, f0),                 # step 1, layer 0
        ("copy", FILL, 0), ("write", FILL, f1)]                     # step 1, layer 1
    assert int(boxes[0].flags[3]) == 0  # no admissions left pending


def test_serve_copy_failure_raises_and_releases_the_gpu():
    pool = kernels.CpuExpertPool(1, spin_us=0)
    bank, lay, _, _ = make_bank(4, 32, 16, "bf16")
    storage = np.zeros((4, lay.slot_stride), np.uint8)
    drv = FakeDriver(storage, fail_copy_at=0)
    box = Mailbox(2, 32, "cpu")
    box.lists.fill_(-1)
    box.lists[0, 0], box.lists[1, 0] = 2, 1  # fill expert 2 into slot 1
    box.ids.fill_(-1)
    box.flags[0] = 1
    table = pool.serve_table([(bank, lay, "silu", box, 0)], drv.copier())
    with pytest.raises(kernels.KernelError, match="CUDA driver error 700"):
        pool.serve(table, timeout_s=5)
    assert int(box.flags[2]) == 1 and int(box.flags[1]) == 1  # filled and done: the GPU ends
