"""gpt_oss's expert math on every path that runs experts, against the torch reference
(experts/ffn.expert_ffn with ExpertWeights and ExpertAct): the CPU kernels on every ISA path
this CPU has (staged and direct down modes), the slot path's torch runs, and the Triton kernels
of experts/compute under Triton's interpreter (cpu tensors), as tests/test_triton_experts.py
and tests/test_grouped_experts.py run theirs. Banks are laid out here per SPEC.md §5.2 with
the bias projections after down."""
import dataclasses
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from freetoken import kernels
from freetoken.experts import ffn
from freetoken.experts.bank import pool_views, slot_views
from freetoken.kernel_args import ExpertAct, KernelArgumentError
from test_kernels import pools  # noqa: F401 (the kernel pools fixture, one per threads x ISA)

ISAS = kernels.available_isas()
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# limit 0.5 against gate/up values of about 1: both clamps cut often
CLAMPED = ExpertAct("clamped_swiglu", alpha=1.702, limit=0.5)
NAMES = ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")


def _round_up(n, m):
    return (n + m - 1) // m * m


def make_biased_bank(E, D, I, dtype, seed=0):
    """-> (bank uint8 [E * stride], BankInfo-like info, [ExpertWeights of E experts, fp32])."""
    g = torch.Generator().manual_seed(seed)
    tdt = TORCH_DTYPES[dtype]
    shapes = {"gate": (I, D), "up": (I, D), "down": (D, I), "gate_bias": (I,), "up_bias": (I,),
              "down_bias": (D,)}
    scale = {"gate": D ** -0.5, "up": D ** -0.5, "down": I ** -0.5}
    ws = {n: (torch.randn(E, *s, generator=g) * scale.get(n, 0.5)).to(tdt) for n, s in shapes.items()}
    projs, pos = [], 0
    for n in NAMES:
        pos = _round_up(pos, 64)
        nbytes = int(np.prod(shapes[n])) * ws[n].element_size()
        projs.append(SimpleNamespace(name=n, shape=shapes[n], offset=pos, nbytes=nbytes))
        pos += nbytes
    stride = _round_up(pos, 4096)
    bank = np.zeros(E * stride, np.uint8)
    for e in range(E):
        for p in projs:
            raw = ws[p.name][e].contiguous().view(torch.uint8).numpy().ravel()
            bank[e * stride + p.offset:e * stride + p.offset + p.nbytes] = raw
    info = SimpleNamespace(name="blk.0.ffn_exps", slot_stride=stride, dtype=dtype,
                           projections=tuple(projs), num_experts=E)
    experts = [ffn.ExpertWeights(*(ws[n][e].float() for n in NAMES)) for e in range(E)]
    return bank, info, experts


def reference(x, experts, tok, exp, w, act=CLAMPED):
    """out[t] += w * expert_e(x[t]) per route, through ffn.expert_ffn in fp32."""
    out = torch.zeros_like(x)
    for t, e, wt in zip(tok.tolist(), exp.tolist(), w.tolist()):
        out[t] += wt * ffn.expert_ffn(x[t:t + 1], experts[e], act)[0]
    return out


def assert_close(got, want, rtol, what):
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    err = (got - want).abs()
    scale = want.abs().max().item() + 1e-6
    worst = int(err.argmax())
    assert err.max().item() <= rtol * scale, (
        f"{what}: worst element {divmod(worst, want.shape[1])} = {got.flatten()[worst].item():.6g}, "
        f"reference {want.flatten()[worst].item():.6g} (error {err.max().item():.3g}, scale {scale:.3g})")


def routes(T, K, E, rng):
    exp = np.stack([rng.choice(E, size=K, replace=False) for _ in range(T)]).astype(np.int32)
    return np.repeat(np.arange(T, dtype=np.int32), K), exp.ravel(), rng.random(T * K, dtype=np.float32)


def test_activate_is_the_clamped_swiglu():
    """The formula itself, on values either side of both clamps."""
    g = torch.tensor([-3.0, -0.2, 0.3, 0.5, 2.0])
    u = torch.tensor([-2.0, -0.4, 0.1, 0.7, 9.0])
    act = ExpertAct("clamped_swiglu", alpha=1.702, limit=0.5)
    gc, uc = torch.tensor([-3.0, -0.2, 0.3, 0.5, 0.5]), torch.tensor([-0.5, -0.4, 0.1, 0.5, 0.5])
    want = gc * torch.sigmoid(1.702 * gc) * (uc + 1)
    assert torch.equal(ffn.activate(g, u, act), want)
    assert torch.equal(ffn.activate(g, u), torch.nn.functional.silu(g) * u)


# (D, I, T, K, E): D and I not multiples of 8/16/32
CASES = [(100, 37, 1, 2, 4), (129, 67, 6, 4, 8), (72, 96, 33, 2, 5)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("staged", [True, False])
def test_kernels_match_torch_reference(pools, isa, dtype, staged, monkeypatch):
    """Biases and the clamped SwiGLU on every ISA path, both down modes, 1 and 2 threads."""
    if not staged:
        monkeypatch.setattr(kernels, "STAGE_MAX_BYTES", 0)
    rng = np.random.default_rng(5)
    rtol = 2e-2 if (isa == "avx512bf16" and dtype == "bf16") else 1e-4
    for i, (D, I, T, K, E) in enumerate(CASES):
        bank, info, experts = make_biased_bank(E, D, I, dtype, seed=i)
        layout = kernels.layout_from_bank_info(info)
        assert layout.has_bias
        x = torch.randn(T, D, generator=torch.Generator().manual_seed(i))
        tok, exp, w = routes(T, K, E, rng)
        want = reference(x, experts, tok, exp, w)
        for threads in (1, 2):
            out = np.zeros((T, D), np.float32)
            pools(threads, isa).run(x.numpy(), bank, layout, tok, exp, w, out, act=CLAMPED)
            assert_close(out, want, rtol, f"{isa} {dtype} staged={staged} threads={threads} D={D} I={I} T={T}")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("quant", kernels.KERNEL_QUANTS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_quantized_weights_beside_biases(pools, isa, quant, dtype):
    """A quantized bank with biases (gpt-oss's MXFP4 release; --quant of a biased model): the
    weights' blocks and the `dtype` biases beside them, on every ISA path, equal the reference
    on the dequantized weights (1e-5 of the output's scale, as tests/test_quant_kernels.py)."""
    from ftw import quant as Q
    from ftw.layout import bank_from_arrays
    D, I, T, K, E = 96, 64, 7, 4, 5
    g = torch.Generator().manual_seed(4)
    shapes = {"gate": (I, D), "up": (I, D), "down": (D, I), "gate_bias": (I,), "up_bias": (I,),
              "down_bias": (D,)}
    scale = {"gate": D ** -0.5, "up": D ** -0.5, "down": I ** -0.5}
    arrays = [{n: torch.randn(*s, generator=g) * scale.get(n, 0.5) for n, s in shapes.items()}
              for _ in range(E)]
    entry = bank_from_arrays(0, dtype, [{k: v.numpy() for k, v in a.items()} for a in arrays], quant=quant)
    bank = np.zeros(E * entry.slot_stride, np.uint8)
    experts = []
    for e in range(E):
        data = entry.read_expert(e)
        for p in entry.projections:
            start = e * entry.slot_stride + p["offset"]
            bank[start:start + p["nbytes"]] = np.ascontiguousarray(data[p["name"]]).view(np.uint8).ravel()
        weights = [torch.from_numpy(Q.dequantize(data[n], quant, (I, D) if n != "down" else (D, I)))
                   for n in NAMES[:3]]
        biases = [arrays[e][n].to(TORCH_DTYPES[dtype]).float() for n in NAMES[3:]]
        experts.append(ffn.ExpertWeights(*weights, *biases))
    info = SimpleNamespace(name="blk.0.ffn_exps", slot_stride=entry.slot_stride, dtype=dtype,
                           quant=quant, projections=[SimpleNamespace(**p) for p in entry.projections])
    layout = kernels.layout_from_bank_info(info)
    assert layout.has_bias and layout.quant == quant
    x = torch.randn(T, D, generator=g)
    tok, exp, w = routes(T, K, E, np.random.default_rng(1))
    out = np.zeros((T, D), np.float32)
    pool = pools(1, isa)
    saved = pool.tuning  # the bound below is the fp32 path's (a pool made under qdot=int8 keeps it)
    pool.tuning = dataclasses.replace(saved, qdot="fp32")
    try:
        pool.run(x.numpy(), bank, layout, tok, exp, w, out, act=CLAMPED)
    finally:
        pool.tuning = saved
    assert_close(out, reference(x, experts, tok, exp, w), 1e-5, f"{isa} {quant} {dtype} biases")


def test_biases_and_clamp_change_the_kernels_output(pools):
    """The same bank read without its biases, or with silu, gives another result (the test
    above cannot pass by ignoring either)."""
    bank, info, experts = make_biased_bank(4, 64, 40, "fp32", seed=9)
    layout = kernels.layout_from_bank_info(info)
    x = torch.randn(3, 64)
    tok, exp, w = routes(3, 2, 4, np.random.default_rng(0))
    pool = pools(1, ISAS[0])

    def run(lay, act):
        out = np.zeros((3, 64), np.float32)
        pool.run(x.numpy(), bank, lay, tok, exp, w, out, act=act)
        return torch.from_numpy(out)
    want = reference(x, experts, tok, exp, w)
    assert_close(run(layout, CLAMPED), want, 1e-4, "biased")
    from dataclasses import replace
    plain = replace(layout, offset_gate_bias=-1, offset_up_bias=-1, offset_down_bias=-1)
    assert (run(plain, CLAMPED) - want).abs().max() > 1e-2
    assert (run(layout, "silu") - want).abs().max() > 1e-2


def test_layout_checks_the_bias_offsets():
    _, info, _ = make_biased_bank(2, 32, 16, "bf16")
    layout = kernels.layout_from_bank_info(info)
    from dataclasses import replace
    with pytest.raises(KernelArgumentError, match="all three or none"):
        replace(layout, offset_up_bias=-1)
    with pytest.raises(KernelArgumentError, match="past slot_stride"):
        replace(layout, offset_down_bias=layout.slot_stride - 2)
    with pytest.raises(KernelArgumentError, match="act must be one of"):
        ExpertAct("swish")
    info.projections = info.projections[:5]  # no down_bias
    with pytest.raises(KernelArgumentError, match="expert bias shapes"):
        kernels.layout_from_bank_info(info)


def test_torch_runs_and_views_carry_the_biases():
    """ffn.run_expert_runs over slot views (the slot path, on the cpu) equals the reference."""
    E, D, I = 5, 48, 24
    bank, info, experts = make_biased_bank(E, D, I, "fp32", seed=2)
    storage = torch.from_numpy(bank).view(E, info.slot_stride)
    views = pool_views(storage, info)
    one = ffn.ExpertWeights.of(slot_views(storage[3], info))
    assert all(torch.equal(a, b) for a, b in zip(one, experts[3]))
    T, K = 7, 2
    tok, exp, w = routes(T, K, E, np.random.default_rng(1))
    x = torch.randn(T, D)
    g = ffn.group_routes(torch.from_numpy(exp.reshape(T, K).astype(np.int64)))
    idx = torch.stack([g.token_ids, g.route_ids])
    out = torch.zeros(T, D)
    runs = [(ffn.ExpertWeights.of(views, e), n) for e, n in zip(g.experts, g.counts)]
    ffn.run_expert_runs(x, idx, torch.from_numpy(w), out, runs, torch.float32, act=CLAMPED)
    assert_close(out, reference(x, experts, tok, exp, w), 1e-5, "run_expert_runs")


@pytest.fixture
def interpreted():
    """The experts/compute Triton modules under Triton's interpreter (cpu tensors): conftest.py
    sets TRITON_INTERPRET=1 without CUDA before anything imports Triton. (Reloading the
    modules under a changed environment would leave the other tests' kernels built for it.)"""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (conftest.py sets it where there is no CUDA)")
    from freetoken.experts.compute import grouped_experts, triton_experts
    return [triton_experts, grouped_experts]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_triton_slot_kernels_interpreted(interpreted, dtype):
    """triton_experts.run (the captured step's fixed routes, read in place from their slots)
    with biases and the clamped SwiGLU, and gathered.py's torch path, against the reference."""
    triton_experts, _ = interpreted
    from freetoken.experts.compute.gathered import GatheredExperts
    E, D, I, T, K = 4, 40, 24, 3, 2
    bank, info, experts = make_biased_bank(E, D, I, dtype, seed=4)
    storage = torch.from_numpy(bank).view(E, info.slot_stride)
    tok, exp, w = routes(T, K, E, np.random.default_rng(3))
    x = torch.randn(T, D)
    want = reference(x, experts, tok, exp, w)
    slots, weights = torch.from_numpy(exp.astype(np.int64)), torch.from_numpy(w)
    gathered = GatheredExperts(storage, {0: info}, CLAMPED)
    rtol = 2e-2 if dtype == "bf16" else 1e-4
    assert_close(gathered.run(0, x.to(TORCH_DTYPES[dtype]), slots, weights), want, rtol, "gathered torch")
    gathered.use_triton = True
    assert_close(gathered.run(0, x, slots, weights), want, 1e-4, "triton_experts")


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_grouped_kernels_interpreted(interpreted, dtype):
    """grouped_experts.run and run_stacked (prefill's many tokens) with biases and the clamped
    SwiGLU against the per-expert torch path of run_expert_runs."""
    _, grouped_experts = interpreted
    E, D, I, T, K = 4, 40, 24, 9, 2
    tdt = TORCH_DTYPES[dtype]
    bank, info, _ = make_biased_bank(E, D, I, dtype, seed=6)
    storage = torch.from_numpy(bank).view(E, info.slot_stride)
    views = pool_views(storage, info)
    tok, exp, w = routes(T, K, E, np.random.default_rng(8))
    x = torch.randn(T, D).to(tdt)
    ids = torch.from_numpy(exp.reshape(T, K).astype(np.int64))
    g = ffn.group_routes(ids)
    idx = torch.stack([g.token_ids, g.route_ids])
    w_flat = torch.from_numpy(w)
    runs = [(ffn.ExpertWeights.of(views, e), n) for e, n in zip(g.experts, g.counts)]
    want = torch.zeros(T, D)
    ffn.run_expert_runs(x, idx, w_flat, want, runs, tdt, act=CLAMPED)
    rtol = 2e-2 if dtype == "bf16" else 1e-4
    got = torch.zeros(T, D)
    got.index_add_(0, g.token_ids, grouped_experts.run(x, g.token_ids, g.route_ids, w_flat, runs, CLAMPED))
    assert_close(got, want, rtol, "grouped run")
    counts = np.bincount(exp, minlength=E)
    stacked = torch.zeros(T, D)
    n_tiles = int((-(-counts // grouped_experts.BM)).sum())
    stacked.index_add_(0, g.token_ids, grouped_experts.run_stacked(
        x, g.token_ids, g.route_ids, w_flat, ffn.ExpertWeights.of(views), 0,
        torch.from_numpy(counts), n_tiles, CLAMPED))
    assert_close(stacked, want, rtol, "grouped run_stacked")
