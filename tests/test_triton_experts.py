"""The Triton device experts (freetoken/experts/compute/triton_experts.py) against torch: each token's
routes summed, a duplicate expert, a weight-0 route (which reads nothing), shapes that are not
multiples of the kernels' blocks.

interpreter: the kernels on cpu tensors under TRITON_INTERPRET=1 (tests/conftest.py sets it without
  CUDA; skipped where Triton does not import).
gpu: the same on cuda.
"""
import os

import pytest
import torch
import torch.nn.functional as F

from freetoken.experts.compute import triton_experts

INTERPRET = triton_experts.available() and os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")),
           pytest.param("cuda", marks=pytest.mark.gpu)]
E, D, I = 5, 72, 40  # not multiples of the kernels' blocks


def make_bank(dtype, seed=0):
    """[E, stride] bank of gate [I, D], up [I, D], down [D, I] per slot, bank dtype, plus the
    layout triton_experts.run takes (offsets in elements) and the weights as fp32."""
    g = torch.Generator().manual_seed(seed)
    w = [torch.randn(E, *shape, generator=g) * 0.1 for shape in ((I, D), (I, D), (D, I))]
    stride = 3 * I * D + 8  # elements (a little padding, as banks have)
    bank = torch.zeros(E, stride, dtype=dtype)
    for k, m in enumerate(w):
        bank[:, k * I * D:(k + 1) * I * D] = m.reshape(E, -1).to(dtype)
    layout = ((0, I * D, 2 * I * D), (I, D))
    return bank, layout, [m.to(dtype).float() for m in w]


def ref(w, x, expert, weight):
    gate, up, down = (m[expert] for m in w)
    return weight * (down @ (F.silu(gate @ x) * (up @ x)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_experts_match_torch(device, dtype):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no cuda")
    bank, layout, w = make_bank(dtype)
    x = torch.randn(2, D, generator=torch.Generator().manual_seed(1))
    experts = torch.tensor([3, 1, 1, 4], device=device)  # T = 2, K = 2; a duplicate expert
    weights = torch.tensor([0.7, 0.3, 0.5, 0.0], device=device)  # weight 0: reads nothing
    got = triton_experts.run(bank.to(device), layout, x.to(device), experts, weights).cpu()
    want = torch.stack([sum(ref(w, x[t], int(experts[t * 2 + k]), float(weights[t * 2 + k]))
                            for k in range(2)) for t in range(2)])
    assert got.shape == (2, D) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

