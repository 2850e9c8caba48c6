"""Partial experts in the Triton device experts (freetoken/experts/triton_experts.py, `limits`):
a route computing only its expert's first rows equals torch on the sliced weights, the two
shares of a split add up to the whole expert, and the same kernels read a pinned host bank in
place (zero-copy, by expert id).

interpreter: the kernels on cpu tensors under TRITON_INTERPRET=1 (skipped unless it is set and
  Triton imports).
gpu: the same on cuda, the host bank pinned and read over PCIe.
"""
import os

import pytest
import torch
import torch.nn.functional as F

from freetoken.experts import triton_experts, zero_copy

INTERPRET = triton_experts.available() and os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")),
           pytest.param("cuda", marks=pytest.mark.gpu)]
E, D, I = 5, 72, 40  # not multiples of the kernels' blocks


def make_bank(dtype, seed=0):
    """[E, stride] bank of gate [I, D], up [I, D], down [D, I] per slot, bank dtype, plus the
    layout triton_experts.run takes (offsets in elements) and the fp32 weights."""
    g = torch.Generator().manual_seed(seed)
    w = [torch.randn(E, *shape, generator=g) * 0.1 for shape in ((I, D), (I, D), (D, I))]
    stride = 3 * I * D + 8  # elements (a little padding, as banks have)
    bank = torch.zeros(E, stride, dtype=dtype)
    for k, m in enumerate(w):
        bank[:, k * I * D:(k + 1) * I * D] = m.reshape(E, -1).to(dtype)
    layout = ((0, I * D, 2 * I * D), (I, D))
    return bank, layout, [m.to(dtype).float() for m in w]


def ref(w, x, expert, rows, weight):
    gate, up, down = (m[expert] for m in w)
    h = F.silu(gate[:rows] @ x) * (up[:rows] @ x)
    return weight * (down[:, :rows] @ h)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_experts_match_torch_and_add_up(device, dtype):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no cuda")
    bank, layout, w = make_bank(dtype)
    bank = bank.to(device)
    x = torch.randn(2, D, generator=torch.Generator().manual_seed(1))
    experts = torch.tensor([3, 1, 1, 4], device=device)  # T = 2, K = 2; a duplicate expert
    weights = torch.tensor([0.7, 0.3, 0.5, 0.5], device=device)
    xd = x.to(device)
    tol = dict(rtol=1e-4, atol=1e-5)
    full = triton_experts.run(bank, layout, xd, experts, weights).cpu()
    for rows in ([I, I, I, I], [0, 1, 17, I], [16, 39, 40, 3]):
        lim = torch.tensor(rows, dtype=torch.int32, device=device)
        got = triton_experts.run(bank, layout, xd, experts, weights, lim).cpu()
        want = torch.stack([sum(ref(w, x[t], int(experts[t * 2 + k]), rows[t * 2 + k],
                                    float(weights[t * 2 + k])) for k in range(2)) for t in range(2)])
        torch.testing.assert_close(got, want, **tol)
        rest = torch.tensor([I - r for r in rows], dtype=torch.int32)
        # the other share: rows [r, I), computed by slicing on the host
        other = torch.stack([sum(ref([m[:, r:] if j < 2 else m[:, :, r:] for j, m in enumerate(w)],
                                     x[t], int(experts[t * 2 + k]), int(rest[t * 2 + k]),
                                     float(weights[t * 2 + k]))
                                 for k, r in zip(range(2), rows[t * 2:t * 2 + 2])) for t in range(2)])
        torch.testing.assert_close(got + other, full, **tol)
    all_rows = torch.full((4,), I, dtype=torch.int32, device=device)
    assert torch.equal(triton_experts.run(bank, layout, xd, experts, weights, all_rows).cpu(), full)


@pytest.mark.parametrize("device", DEVICES)
def test_partial_expert_reads_a_host_bank_in_place(device):
    """The kernels on a host bank by expert id (zero-copy on cuda: the bank pinned, its mapped
    address passed), against the same experts computed from a copy on the device."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no cuda")
    bank, layout, w = make_bank(torch.bfloat16, seed=2)
    host = bank.pin_memory() if device == "cuda" else bank
    src = zero_copy.MappedHost(host) if device == "cuda" else host
    x = torch.randn(1, D, generator=torch.Generator().manual_seed(3)).to(device)
    experts = torch.tensor([2], device=device)
    weights = torch.tensor([1.0], device=device)
    lim = torch.tensor([13], dtype=torch.int32, device=device)
    got = triton_experts.run(src, layout, x, experts, weights, lim, slot_elems=bank.stride(0))
    want = triton_experts.run(bank.to(device), layout, x, experts, weights, lim)
    assert torch.equal(got.cpu(), want.cpu())
    torch.testing.assert_close(got.cpu()[0], ref(w, x.cpu()[0], 2, 13, 1.0), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_per_route_outputs_sum_to_the_tokens(device):
    """per_route=True gives each route's weighted output [R, D]; per token they sum to the
    default output (the finish kernel of a GPU-controlled step sums them itself)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no cuda")
    bank, layout, w = make_bank(torch.float32)
    bank = bank.to(device)
    x = torch.randn(2, D, generator=torch.Generator().manual_seed(2)).to(device)
    experts = torch.tensor([0, 2, 2, 4], device=device)
    weights = torch.tensor([0.6, 0.4, 0.0, 1.0], device=device)  # a weight-0 route reads nothing
    rows = triton_experts.run(bank, layout, x, experts, weights, per_route=True).cpu()
    summed = triton_experts.run(bank, layout, x, experts, weights).cpu()
    assert rows.shape == (4, D)
    assert torch.equal(rows[2], torch.zeros(D))
    torch.testing.assert_close(rows.view(2, 2, D).sum(dim=1), summed, rtol=0, atol=0)
    for r in (0, 1, 3):
        t = r // 2
        torch.testing.assert_close(rows[r], ref(w, x[t].cpu(), int(experts[r]), I, float(weights[r])),
                                   rtol=1e-4, atol=1e-5)
