"""Split rows of one expert (GPU-controlled decode: the GPU computes an expert's first r
intermediate rows, the CPU the rest): triton_experts.run with `limits` against torch over rows
[0, limit), bit for bit equal to the whole-expert kernels at limit I, never reading past the
limit (NaN bytes there stay out of the output); zero_copy.gather_rows copying exactly gate/up
rows [0, r) and down columns [0, r) of host experts into cache slots, and nothing else.

interpreter: the kernels on cpu tensors under TRITON_INTERPRET=1 (skipped unless it is set and
  Triton imports).
gpu: the same on cuda, the host bank pinned and read over PCIe.
"""
import os

import pytest
import torch
import torch.nn.functional as F

from freetoken.experts import gathered, triton_experts, zero_copy

INTERPRET = triton_experts.available() and os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(
               not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")),
           pytest.param("cuda", marks=pytest.mark.gpu)]
E, D, I = 5, 72, 40  # not multiples of the kernels' blocks
PAD = 8  # elements after down in each slot (banks have padding)


def _need(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no cuda")


def make_bank(dtype, seed=0):
    """[E, stride] bank of gate [I, D], up [I, D], down [D, I] per slot, bank dtype, the layout
    triton_experts.run takes (offsets in elements) and the weights as fp32."""
    g = torch.Generator().manual_seed(seed)
    w = [torch.randn(E, *shape, generator=g) * 0.1 for shape in ((I, D), (I, D), (D, I))]
    bank = torch.zeros(E, 3 * I * D + PAD, dtype=dtype)
    for k, m in enumerate(w):
        bank[:, k * I * D:(k + 1) * I * D] = m.reshape(E, -1).to(dtype)
    layout = ((0, I * D, 2 * I * D), (I, D))
    return bank, layout, [m.to(dtype).float() for m in w]


def ref(w, x, expert, rows, weight):
    """weight * the expert's first `rows` intermediate rows, fp32."""
    gate, up, down = (m[expert] for m in w)
    return weight * (down[:, :rows] @ (F.silu(gate[:rows] @ x) * (up[:rows] @ x)))


def poison_past(bank, slot, rows):
    """NaN in gate/up rows >= rows and down columns >= rows of `slot` (and its padding)."""
    nan = float("nan")
    bank[slot, rows * D:I * D] = nan
    bank[slot, I * D + rows * D:2 * I * D] = nan
    bank[slot, 2 * I * D:3 * I * D].view(D, I)[:, rows:] = nan
    bank[slot, 3 * I * D:] = nan


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index", [torch.int64, torch.int32])
def test_limits_match_torch_over_leading_rows(device, dtype, index):
    """T = 2 tokens, K = 2 routes each (a duplicate expert): each token's routes summed, each
    route over its own leading rows; limits all I equal the kernels without limits."""
    _need(device)
    bank, layout, w = make_bank(dtype)
    bank = bank.to(device)
    x = torch.randn(2, D, generator=torch.Generator().manual_seed(1))
    experts = torch.tensor([3, 1, 1, 4], device=device)
    weights = torch.tensor([0.7, 0.3, 0.5, 0.0], device=device)  # weight 0: reads nothing
    xd = x.to(device)
    for rows in ([0, 1, 17, I], [I, 39, 4, 5], [8, 16, 32, 33]):
        lim = torch.tensor(rows, dtype=index, device=device)
        got = triton_experts.run(bank, layout, xd, experts, weights, lim).cpu()
        want = torch.stack([sum(ref(w, x[t], int(experts[2 * t + k]), rows[2 * t + k],
                                    float(weights[2 * t + k])) for k in range(2))
                            for t in range(2)])
        assert got.shape == (2, D) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    whole = torch.full((4,), I, dtype=index, device=device)
    assert torch.equal(triton_experts.run(bank, layout, xd, experts, weights, whole).cpu(),
                       triton_experts.run(bank, layout, xd, experts, weights).cpu())
    # limits all multiples of 8 with the caller vouching for it (down keeps its wide loads on
    # the GPU): the same result as without the promise
    lim = torch.tensor([8, 16, 32, 0], dtype=index, device=device)
    assert torch.equal(triton_experts.run(bank, layout, xd, experts, weights, lim, 8).cpu(),
                       triton_experts.run(bank, layout, xd, experts, weights, lim).cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_limits_never_read_past_the_limit(device, dtype):
    """One route per token (K = 1), so each output row is one route: NaN planted past each
    route's limit in its slot does not reach the output, and the route at limit I (a slot
    without NaN) equals the kernels without limits bit for bit."""
    _need(device)
    bank, layout, w = make_bank(dtype, seed=2)
    rows = [0, 13, 39, I, 1]
    slots = [0, 1, 2, 3, 4]
    for s, r in zip(slots, rows):
        poison_past(bank, s, r)
    bank = bank.to(device)
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(3))
    experts = torch.tensor(slots, device=device)
    weights = torch.tensor([0.5, 1.0, 0.25, 0.75, 2.0], device=device)
    lim = torch.tensor(rows, device=device)
    got = triton_experts.run(bank, layout, x.to(device), experts, weights, lim).cpu()
    assert torch.isfinite(got).all()
    for t, (s, r) in enumerate(zip(slots, rows)):
        torch.testing.assert_close(got[t], ref(w, x[t], s, r, float(weights[t])),
                                   rtol=1e-4, atol=1e-5)
    assert torch.equal(got[0], torch.zeros(D))  # limit 0: nothing
    plain = triton_experts.run(bank, layout, x.to(device), experts, weights).cpu()
    assert torch.equal(got[3], plain[3])


def test_gathered_torch_path_refuses_limits():
    experts = gathered.GatheredExperts.__new__(gathered.GatheredExperts)
    experts.use_triton = False
    with pytest.raises(NotImplementedError, match="Triton"):
        experts.run(0, torch.zeros(1, D), torch.zeros(1, dtype=torch.int64), torch.ones(1),
                    torch.full((1,), 3))


def _host_bank(device, num, stride, seed):
    """A host bank of `num` experts, [num * stride] bytes of random bits (NaN patterns too:
    the copy moves bits), pinned for cuda."""
    g = torch.Generator().manual_seed(seed)
    host = torch.randint(0, 256, (num * stride,), dtype=torch.uint8, generator=g)
    return host.pin_memory() if device == "cuda" else host


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start,rows,block,programs", [
    (0, 7, None, None), (0, 8, None, None), (0, I, None, None), (0, 13, 64, None),
    (0, I, 64, None), (13, I, 64, None), (7, 30, None, None), (13, I, 64, 3), (0, 9, 64, 2)])
def test_gather_rows_copies_exactly_the_split_rows(device, dtype, start, rows, block, programs,
                                                   monkeypatch):
    """Listed fills land in their slots: gate/up rows [start, rows) and down columns
    [start, rows), bit for bit; every other byte of every slot keeps its sentinel; a -1 fill
    reads and writes nothing. Odd and even rows, a start past 0 (the rest of a split expert);
    block 64: several programs per region, with tails; programs: a few looping ones."""
    _need(device)
    if block:
        monkeypatch.setattr(zero_copy, "ROW_BLOCK", block)
    size = torch.empty((), dtype=dtype).element_size()
    off = (4, 4 + I * D + 2, 4 + 2 * I * D + 6)  # gate, up, down offsets: gaps between them
    n = off[2] + D * I + PAD  # host slot elements
    host = _host_bank(device, E, n * size, seed=rows)
    C = 4
    pool = torch.full((C, (n + 24) * size), 0x5A, dtype=torch.uint8)  # pool slots are wider
    storage = pool.to(device, copy=True).view(dtype)  # [C, n + 24]; pool keeps the sentinel
    src = torch.tensor([2, -1, 4], device=device)
    dst = torch.tensor([1, 0, 3], device=device)
    zero_copy.gather_rows(zero_copy.host_typed(host, E, n * size, dtype), storage, src, dst,
                          (off, (I, D)), rows, start=start, programs=programs)
    got = _bits(storage.cpu())
    hb = _bits(host.view(dtype).view(E, n))
    want = _bits(pool.view(dtype)).clone()
    for e, s in ((2, 1), (4, 3)):
        for o in off[:2]:
            want[s, o + start * D:o + rows * D] = hb[e, o + start * D:o + rows * D]
        want[s, off[2]:off[2] + D * I].view(D, I)[:, start:rows] = \
            hb[e, off[2]:off[2] + D * I].view(D, I)[:, start:rows]
    assert torch.equal(got, want)
    assert (want[1] != _bits(pool.view(dtype))[1]).any()  # the copy did change the slot


@pytest.mark.parametrize("device", DEVICES)
def test_gather_rows_zero_and_bad_rows(device):
    _need(device)
    n = 3 * I * D + PAD
    host = _host_bank(device, 2, 2 * n, seed=5)
    storage = torch.zeros(2, n, dtype=torch.bfloat16, device=device)
    src = zero_copy.host_typed(host, 2, 2 * n, torch.bfloat16)
    idx = torch.tensor([1], device=device)
    layout = ((0, I * D, 2 * I * D), (I, D))
    zero_copy.gather_rows(src, storage, idx, idx, layout, 0)
    assert not storage.cpu().any()
    zero_copy.gather_rows(src, storage, idx, idx, layout, 5, start=5)  # an empty range
    assert not storage.cpu().any()
    for rows, start in ((I + 1, 0), (3, 4), (3, -1)):
        with pytest.raises(ValueError, match="outside 0..40"):
            zero_copy.gather_rows(src, storage, idx, idx, layout, rows, start=start)
    with pytest.raises(ValueError, match="pool's dtype"):
        zero_copy.gather_rows(src, storage.view(torch.int16), idx, idx, layout, 3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_rows_then_limits_on_a_nan_slot(device, dtype):
    """The split's GPU half end to end: a slot of NaN bytes (0xFF), the expert's first 11 rows
    gathered into it from the host bank, the kernels at limit 11 equal torch over those rows."""
    _need(device)
    bank, layout, w = make_bank(dtype, seed=4)
    stride = bank.stride(0) * bank.element_size()
    host = bank.view(-1).view(torch.uint8)
    host = host.pin_memory() if device == "cuda" else host
    storage = torch.full((2, stride), 0xFF, dtype=torch.uint8, device=device).view(dtype)
    zero_copy.gather_rows(zero_copy.host_typed(host, E, stride, dtype), storage,
                          torch.tensor([3], device=device), torch.tensor([1], device=device),
                          layout, 11)
    x = torch.randn(1, D, generator=torch.Generator().manual_seed(6))
    got = triton_experts.run(storage, layout, x.to(device), torch.tensor([1], device=device),
                             torch.tensor([0.5], device=device),
                             torch.tensor([11], device=device)).cpu()
    torch.testing.assert_close(got[0], ref(w, x[0], 3, 11, 0.5), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_split_rows_in_a_captured_graph_cuda():
    """gather_rows and the kernels with limits captured in one CUDA graph, replayed with
    another expert and limit written to their device tensors: the replay computes the new
    expert's leading rows (rows of the gather fixed at capture: the largest limit)."""
    if not zero_copy.available():
        pytest.skip("no Triton")
    bank, layout, w = make_bank(torch.bfloat16, seed=7)
    stride = bank.stride(0) * bank.element_size()
    host = bank.view(-1).view(torch.uint8).pin_memory()
    storage = torch.full((2, stride), 0xFF, dtype=torch.uint8, device="cuda").view(torch.bfloat16)
    src, dst = torch.tensor([1], device="cuda"), torch.tensor([0], device="cuda")
    lim = torch.tensor([9], device="cuda")
    x = torch.randn(1, D, generator=torch.Generator().manual_seed(8))
    xd, slot, wt = x.cuda(), torch.tensor([0], device="cuda"), torch.tensor([1.0], device="cuda")
    src_typed = zero_copy.host_typed(host, E, stride, torch.bfloat16)

    def step():
        zero_copy.gather_rows(src_typed, storage, src, dst, layout, 21)
        return triton_experts.run(storage, layout, xd, slot, wt, lim)

    step()  # compiles outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    src.fill_(4)
    lim.fill_(21)
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu()[0], ref(w, x[0], 4, 21, 1.0), rtol=1e-4, atol=1e-5)
