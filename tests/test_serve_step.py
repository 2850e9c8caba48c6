"""The native server of a GPU-controlled decode step (cython/serve.h, kernels.CpuExpertPool.serve):
a thread stands in for the GPU, filling each layer's mailbox and raising its ready flag; the
server must run exactly the listed routes, write the partial and raise done, layer by layer, and
leave a layer with no CPU routes alone (no done, the partial untouched: the GPU neither waits
nor reads then). A mailbox lo > 0 (the split expert) has the server run intermediate rows
[lo, I) of the CPU's experts only; a lo outside [0, I) fails the layer (partial zero, done
raised)."""
import threading
import time

import numpy as np
import pytest
import torch

from freetoken import kernels
from freetoken.experts.device_plan import Mailbox

from test_kernels import ISAS, assert_close, make_bank, rtol_for


def _fake_gpu(boxes, steps, rng, log):
    """For each step and layer: fill the mailbox, raise ready; with CPU routes wait for done,
    record the partial, clear done (what the graph does); without, go on at once (every third
    layer step has none)."""
    n = 0
    for step in range(steps):
        for i, (box, E) in enumerate(boxes):
            ids = rng.choice(E, size=box.K, replace=False)
            cpu = rng.random(box.K) < 0.6 if n % 3 else np.zeros(box.K, bool)
            n += 1
            box.ids.copy_(torch.from_numpy(np.where(cpu, ids, -1)))
            box.w.copy_(torch.from_numpy(rng.random(box.K).astype(np.float32)))
            box.x.copy_(torch.randn(box.D))
            box.partial.fill_(float("nan"))  # the server must overwrite it (when it runs)
            box.flags[0] = 1
            if not cpu.any():
                while int(box.flags[0]) != 0:  # (the test's own pacing: the server took it)
                    time.sleep(0)
                log.append((i, box.ids.clone(), box.w.clone(), box.x.clone(), box))
                continue
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
    table = pool.serve_table([(bank, lay, "silu", box) for bank, lay, _, box, _ in layers])
    log = []
    gpu = threading.Thread(target=_fake_gpu, args=([(b, E) for *_, b, E in layers], 3,
                                                   np.random.default_rng(0), log))
    gpu.start()
    for _ in range(3):
        pool.serve(table, timeout_s=30)
    gpu.join()
    assert len(log) == 6
    assert sum(not bool((ids >= 0).any()) for _, ids, *_ in log) == 2
    stats = table.stats(reset=True)  # per layer: waits, job ns, jobs, times served
    assert [s[3] for s in stats] == [3, 3] and sum(s[2] for s in stats) == 4
    assert all(s[1] > 0 for s in stats if s[2]) and all(s[0] >= 0 for s in stats)
    assert table.stats() == [(0, 0, 0, 0)] * 2
    for i, ids, w, x, partial in log:
        bank, lay, w3, box, E = layers[i]
        on = ids >= 0
        if not on.any():
            assert int(partial.flags[1]) == 0  # no done raised ...
            continue  # (... and the partial, left alone, may already be the next layer step's)
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
    table = pool.serve_table([(bank, lay, "silu", b) for b in boxes])
    with pytest.raises(kernels.KernelError, match="layer 1"):
        pool.serve(table, timeout_s=0.05)
    # layer 0 had no CPU routes (no done); the rest are raised: a waiting GPU ends
    assert [int(b.flags[1]) for b in boxes] == [0, 1, 1]


def test_serve_table_checks_the_mailbox():
    pool = kernels.get_pool(1, spin_us=0)
    bank, lay, _, _ = make_bank(4, 32, 16, "bf16")
    with pytest.raises(kernels.KernelArgumentError, match="mailbox"):
        pool.serve_table([(bank, lay, "silu", Mailbox(2, 48, "cpu"))])


def _rows_reference(x, w3, ids, w, lo):
    """sum over the routes of w * down[:, lo:] @ (silu(gate[lo:] x) * up[lo:] x), fp32 [1, D]."""
    gate, up, down = w3
    out = torch.zeros(1, x.shape[0])
    for e, wt in zip(ids.tolist(), w.tolist()):
        h = torch.nn.functional.silu(gate[e, lo:] @ x) * (up[e, lo:] @ x)
        out[0] += wt * (down[e, :, lo:] @ h)
    return out


def _hand_over(box, ids, w, x, lo):
    """What the GPU writes before a layer step: the routes, x, lo, then ready."""
    box.ids.copy_(torch.tensor(ids))
    box.w.copy_(torch.tensor(w))
    box.x.copy_(x)
    box.partial.fill_(float("nan"))
    box.flags[1] = 0
    box.flags[2] = lo
    box.flags[0] = 1


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("isa", ISAS)
def test_serve_runs_rows_from_lo(isa, dtype):
    """One table, steps with lo = 0 (whole experts), I/3 and an odd lo (I - lo odd too): each
    partial is the torch sum over rows [lo, I) of the listed experts, with two CPU routes (the
    server must not assume one) and a layer without CPU routes beside it; lo = 0 is today's
    whole-expert job bit for bit, and the rows below lo plus the server's make the expert."""
    pool = kernels.CpuExpertPool(2, isa=isa, spin_us=0)
    D, I, K, E = 100, 48, 4, 6
    bank, lay, _, w3 = make_bank(E, D, I, dtype, seed=3)
    box, idle = Mailbox(K, D, "cpu"), Mailbox(K, D, "cpu")
    table = pool.serve_table([(bank, lay, "silu", box), (bank, lay, "silu", idle)])
    ids, w = [4, -1, 1, -1], [0.7, 0.1, 0.4, 0.2]
    exp, wt = torch.tensor([4, 1]), torch.tensor([0.7, 0.4])
    x = torch.randn(D, generator=torch.Generator().manual_seed(0))
    rtol = rtol_for(isa, dtype)
    parts = {}
    for lo in (0, I // 3, 17):
        _hand_over(box, ids, w, x, lo)
        _hand_over(idle, [-1] * K, [0.0] * K, x, 5)  # no CPU routes: lo is not looked at
        pool.serve(table, timeout_s=30)
        assert int(box.flags[1]) == 1 and int(box.flags[0]) == 0
        assert int(idle.flags[1]) == 0 and torch.isnan(idle.partial).all()
        assert torch.isfinite(box.partial).all()
        assert_close(box.partial[None], _rows_reference(x, w3, exp, wt, lo), rtol, f"{isa} {dtype} lo={lo}")
        parts[lo] = box.partial.clone()
    ref = torch.zeros(1, D)
    pool.run(x[None].contiguous().numpy(), bank, lay, np.zeros(2, np.int32), exp.numpy().astype(np.int32),
             wt.numpy(), ref.numpy())
    assert torch.equal(parts[0], ref[0])
    for lo in (I // 3, 17):
        below = _rows_reference(x, w3, exp, wt, 0) - _rows_reference(x, w3, exp, wt, lo)  # the GPU's rows
        assert_close((parts[lo] + below)[None], parts[0][None], rtol, f"{isa} {dtype} shares of lo={lo}")


@pytest.mark.parametrize("bad", [48, 60, -1])
def test_serve_lo_outside_the_expert_fails_the_layer(bad):
    """lo >= I or < 0: the layer's job fails (its partial zero, done still raised so the GPU
    ends), the later layers are still served, and serve raises KernelError naming the layer."""
    pool = kernels.CpuExpertPool(1, spin_us=0)
    D, I = 40, 48
    bank, lay, _, w3 = make_bank(4, D, I, "fp32")
    boxes = [Mailbox(2, D, "cpu") for _ in range(3)]
    table = pool.serve_table([(bank, lay, "silu", b) for b in boxes])
    x = torch.randn(D)
    for i, b in enumerate(boxes):
        _hand_over(b, [1, 3], [0.5, 0.5], x, bad if i == 1 else 8)
    with pytest.raises(kernels.KernelError, match=r"layer 1 failed: .*lo"):
        pool.serve(table, timeout_s=30)
    assert [int(b.flags[1]) for b in boxes] == [1, 1, 1]
    assert [int(b.flags[0]) for b in boxes] == [0, 0, 0]
    assert torch.equal(boxes[1].partial, torch.zeros(D))
    want = _rows_reference(x, w3, torch.tensor([1, 3]), torch.tensor([0.5, 0.5]), 8)
    for b in (boxes[0], boxes[2]):
        assert_close(b.partial[None], want, 1e-4, "the other layers")
    # the table stays usable: the next step with a good lo runs
    for b in boxes:
        _hand_over(b, [1, 3], [0.5, 0.5], x, 8)
    pool.serve(table, timeout_s=30)
    assert_close(boxes[1].partial[None], want, 1e-4, "after the failed step")
