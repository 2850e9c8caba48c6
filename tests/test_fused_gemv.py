"""One token's linear layers as a Triton GEMV (freetoken/models/fused_gemv.py) against an fp64
reference and F.linear, and when layers.Linear takes it.

interpreter: the kernel on cpu tensors under TRITON_INTERPRET=1 (its fp32 -> bf16 cast
truncates: one more rounding step allowed). gpu: the same on cuda. The model with the GEMV in
its decode steps is held against the unfused model by tests/test_fused_ops.py (check_model, the
captured step).
"""
import torch
import torch.nn.functional as F

from freetoken.models import fused, fused_gemv

from fused_support import kernel_checks_test, rand

# (N, K): below one block of rows and of K, ragged both ways, K >= 4096 (one row per program)
SHAPES = [(40, 40), (7, 100), (301, 1500), (160, 4096), (33, 5000)]


def assert_gemv(got, x, weight, bias, what):
    """got within the rounding of an fp32 sum of K products (any order) and one rounding to
    got's dtype (two where the interpreter truncates) of the fp64 result."""
    xd, wd = x.double().reshape(-1), weight.double()
    ref = wd @ xd + (bias.double() if bias is not None else 0)
    K = xd.numel()
    sum_err = 2 * K * 2.0 ** -24 * (wd.abs() @ xd.abs())
    step = 2.0 ** -24 if got.dtype == torch.float32 else 2.0 ** -8
    if got.dtype != torch.float32 and got.device.type == "cpu":
        step *= 2
    err = (got.double().reshape(-1).cpu() - ref.cpu()).abs()
    tol = (sum_err + step * ref.abs()).cpu() + 1e-30
    assert bool((err <= tol).all()), f"{what}: worst {float((err / tol).max()):.2f} x the bound"


def check_gemv(device, dtype):
    for i, (N, K) in enumerate(SHAPES):
        x = rand(1, K, dtype=dtype, device=device, seed=i)
        weight = rand(N, K, dtype=dtype, device=device, scale=K ** -0.5, seed=100 + i)
        for bias in (None, rand(N, dtype=dtype, device=device, seed=200 + i)):
            got = fused_gemv.gemv(x, weight, bias)
            assert got.shape == (1, N) and got.dtype == dtype
            assert_gemv(got, x, weight, bias, f"gemv {N}x{K} bias={bias is not None}")
            assert_gemv(F.linear(x, weight, bias), x, weight, bias, "F.linear (the bound)")


def check_gemv_layouts(device, dtype):
    """Weight rows not back to back (a view of a wider matrix), x with more leading dims."""
    wide = rand(50, 300, dtype=dtype, device=device, scale=0.1, seed=7)
    weight = wide[:, 20:276]  # [50, 256], row stride 300
    x = rand(1, 1, 256, dtype=dtype, device=device, seed=8)
    got = fused_gemv.gemv(x, weight)
    assert got.shape == (1, 1, 50)
    assert_gemv(got, x, weight, None, "strided weight")


test_kernels = kernel_checks_test([check_gemv, check_gemv_layouts])


class FakeCuda:
    """What chosen() reads of a tensor: a bf16 cuda tensor of `rows` rows of 64."""
    is_cuda, dtype = True, torch.bfloat16

    def __init__(self, rows=1):
        self.shape = (rows, 64)

    def numel(self):
        return self.shape[0] * self.shape[1]


def test_chosen_for_one_cuda_row_only(monkeypatch):
    w = torch.zeros(8, 64, dtype=torch.bfloat16)
    assert fused_gemv.chosen(FakeCuda(), w) == fused.available()
    assert not fused_gemv.chosen(FakeCuda(rows=2), w)  # prefill: cuBLAS
    assert not fused_gemv.chosen(FakeCuda(), w.float())  # weights of another dtype
    assert not fused_gemv.chosen(FakeCuda(), torch.zeros(64, 8, dtype=torch.bfloat16).t())
    assert not fused_gemv.chosen(torch.zeros(1, 64, dtype=torch.bfloat16), w)  # cpu
    monkeypatch.setattr(fused, "enabled", lambda x: False)  # how the tests take the torch path
    assert not fused_gemv.chosen(FakeCuda(), w)


def test_linear_layer_uses_it_where_chosen(monkeypatch):
    from freetoken.models.layers import Linear
    lin = Linear(16, 4, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(4, 16))
        lin.bias.copy_(torch.randn(4))
    calls = []
    monkeypatch.setattr(fused_gemv, "chosen", lambda x, w: True)
    monkeypatch.setattr(fused_gemv, "gemv", lambda x, w, b: calls.append((x, w, b)) or x[..., :4])
    x = torch.randn(1, 16)
    lin(x)
    assert len(calls) == 1 and calls[0][1] is lin.weight and calls[0][2] is lin.bias
    monkeypatch.setattr(fused_gemv, "chosen", lambda x, w: False)
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
