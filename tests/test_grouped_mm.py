"""experts/compute/grouped_mm.py: the quantized projections' decode into bf16 (_dequant, under
Triton's interpreter on cpu tensors without CUDA) against ftw.quant.dequantize rounded to bf16,
bit for bit; grouped_ffn's grouping (offsets, empty groups, transposed operands) against the
per-expert torch path where this torch runs its grouped GEMM on the cpu; on cuda (gpu),
run_stacked through the grouped GEMM against the Triton kernels and the dequantized fp32
reference, bf16 and every device quant type."""
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from freetoken.experts import ffn
from freetoken.experts.bank import pool_bytes
from freetoken.experts.compute import grouped_experts, grouped_mm
from freetoken.experts.compute.quant_blocks import QuantSpec
from freetoken.kernel_args import DEVICE_QUANTS, SILU

from test_quant_device_kernels import assert_close, grouped_case, make_quant_bank, reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and grouped_mm.triton is not None


CPU = pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1"))
CUDA = pytest.param("cuda", marks=pytest.mark.gpu)


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("quant", DEVICE_QUANTS)
def test_dequant_equals_ftw_dequantize_in_bf16(quant, device):
    """Experts 1 and 2 of a 4-expert stack, every projection: the bf16 of ftw.quant's fp32
    weights (fp8_e4m3 at D and I that are not whole 32-blocks nor 128-tiles). On cuda bit for
    bit (round to nearest even); under the interpreter within one bf16 step, whose
    fp32-to-bf16 conversion does not round as the GPU's does (a kernel storing x.to(bf16,
    "rtne") differs from torch's bf16 of x by up to one step there)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs cuda")
    D, I = (200, 72) if quant == "fp8_e4m3" else (96, 160)
    storage, info, experts = make_quant_bank(4, D, I, quant, seed=3)
    spec = QuantSpec.of(info)
    views = pool_bytes(storage.to(device), info)
    for k, (name, rows, cols, off) in enumerate((("gate", I, D, spec.gate_scales), ("up", I, D, spec.gate_scales),
                                                 ("down", D, I, spec.down_scales))):
        got = grouped_mm.dequantized(views[name], 1, 2, rows, cols, off, spec).cpu()
        ref = torch.stack([experts[e][k] for e in (1, 2)])
        want = ref.to(torch.bfloat16)
        assert got.shape == (2, rows, cols), f"{quant} {name}"
        if device == "cuda":
            assert torch.equal(got, want), f"{quant} {name}"
        else:
            step = want.float().abs() * 2.0 ** -7 + 1e-30  # one bf16 step at most
            assert ((got.float() - ref).abs() <= step).all(), f"{quant} {name}"
            assert ((got.float() - want.float()).abs() <= step).all(), f"{quant} {name}"


def _cpu_grouped_mm() -> bool:
    try:
        a = torch.zeros(2, 8, dtype=torch.bfloat16)
        torch._grouped_mm(a, torch.zeros(1, 8, 8, dtype=torch.bfloat16).transpose(1, 2),
                          offs=torch.tensor([2], dtype=torch.int32))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


@pytest.mark.skipif(not _cpu_grouped_mm(), reason="this torch has no grouped GEMM on the cpu")
def test_grouped_ffn_groups_as_the_per_expert_path():
    """Groups back to back with empty ones between, weights as one buffer's strided views:
    each row equals w * down(silu(gate x) * up x) of its own expert in bf16 (F.linear's)."""
    D, I, counts = 64, 48, [3, 0, 7, 1, 0, 5]
    g = torch.Generator().manual_seed(1)
    stride = 3 * I * D + 64
    pool = (torch.randn(len(counts), stride, generator=g) * D ** -0.5).to(torch.bfloat16)
    gate, up = pool[:, :I * D].view(-1, I, D), pool[:, I * D:2 * I * D].view(-1, I, D)
    down = pool[:, 2 * I * D:3 * I * D].view(-1, D, I)
    xs = torch.randn(sum(counts), D, generator=g).to(torch.bfloat16)
    w = torch.rand(sum(counts), generator=g)
    got = grouped_mm.grouped_ffn(xs, gate, up, down, torch.tensor(counts), w)
    a = 0
    for e, n in enumerate(counts):
        xe = xs[a:a + n]
        want = F.linear(F.silu(F.linear(xe, gate[e])) * F.linear(xe, up[e]), down[e]).float() * w[a:a + n, None]
        assert torch.allclose(got[a:a + n], want, rtol=1e-2, atol=1e-3), f"expert {e}"
        a += n


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["bf16", *DEVICE_QUANTS])
def test_run_stacked_through_the_grouped_gemm_cuda(quant, monkeypatch):
    """run_stacked (bf16 x, SiLU) takes the grouped GEMM; its Triton kernels (grouped_mm not
    chosen) give the same within bf16's 2e-2; both within 2e-2 of the dequantized fp32
    reference; a layer buffer's bf16 views go in without a copy."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs cuda of compute capability 9 or more")
    E, K, T, D, I = 6, 2, 64, 128, 96
    storage, info, experts = make_quant_bank(E, D, I, "q8_0" if quant == "bf16" else quant, seed=5)
    spec = None if quant == "bf16" else QuantSpec.of(info)
    if quant == "bf16":  # the same experts as bf16 slots of one buffer, 4 KiB apart
        stride = (3 * I * D + 2047) // 2048 * 2048
        pool = torch.zeros(E, stride, dtype=torch.bfloat16)
        for e, (gate, up, down) in enumerate(experts):
            pool[e, :3 * I * D] = torch.cat([gate.flatten(), up.flatten(), down.flatten()]).to(torch.bfloat16)
        pool = pool.cuda()
        stacks = ffn.ExpertWeights(pool[:, :I * D].view(E, I, D), pool[:, I * D:2 * I * D].view(E, I, D),
                                   pool[:, 2 * I * D:3 * I * D].view(E, D, I))
        experts = [tuple(w.to(torch.bfloat16).float() for w in ex) for ex in experts]
    else:
        stacks = ffn.ExpertWeights.of(pool_bytes(storage.cuda(), info))
    ids, g, w_flat = grouped_case(T, K, E, seed=7)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    want = reference(x, experts, ids.reshape(-1), w_flat, SILU)
    x, w_flat, tok, rid = (t.cuda() for t in (x, w_flat, g.token_ids, g.route_ids))
    counts = np.bincount(ids.reshape(-1).numpy(), minlength=E)
    n_tiles = int((-(-counts // grouped_experts.BM)).sum())
    outs = {}
    assert grouped_mm.chosen(x, [w for w in stacks if w is not None], SILU, spec)
    for switch in ("1", "0"):  # 0: the Triton kernels, as where grouped_mm is not chosen
        if switch == "0":
            monkeypatch.setattr(grouped_mm, "chosen", lambda *args: False)
        out = torch.zeros(T, D, device="cuda")
        out.index_add_(0, tok, grouped_experts.run_stacked(
            x, tok, rid, w_flat, stacks, 0, torch.from_numpy(counts).cuda(), n_tiles, SILU, spec))
        outs[switch] = out.cpu()
        assert_close(outs[switch], want, 2e-2, f"{quant} switch {switch}")
    assert_close(outs["1"], outs["0"], 2e-2, f"{quant}: grouped GEMM against the Triton kernels")
