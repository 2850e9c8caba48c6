"""The device experts' Triton kernels on quantized slots (q8_0, q4_0, mxfp4, fp8_e4m3: ftw/SPEC.md §9)
against a dequantize-then-fp32 torch reference (ftw.quant.dequantize, then the expert's math in
fp32), under Triton's interpreter on cpu tensors (tests/conftest.py sets TRITON_INTERPRET=1
without CUDA): triton_experts.run through GatheredExperts (decode's fixed routes, in place
from their slots), grouped_experts.run and run_stacked (prefill's runs and streamed layers),
and ffn.run_expert_runs / run_stacked_layer choosing them. Shapes: D and I whole 32-blocks
that are not multiples of the kernels' steps; 1 to 64 tokens; fp8_e4m3 also D and I that are
not whole 32-blocks nor 128-tiles.

Tolerances, relative to the output's largest magnitude: fp32 activations 1e-4 (the kernels
differ from the reference by the order of each sum alone: no weight is rounded); bf16 2e-2
(the grouped kernels round x, gate/up, h and the down output to bf16 where torch's bf16
matmuls would)."""
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from freetoken.experts import ffn
from freetoken.experts.bank import pool_bytes, pool_views
from freetoken.experts.compute import grouped_experts
from freetoken.experts.compute.gathered import GatheredExperts
from freetoken.experts.compute.quant_blocks import CODES, QuantSpec
from freetoken.kernel_args import DEVICE_QUANTS, SILU, ExpertAct
from ftw import quant as Q

QUANTS = list(DEVICE_QUANTS)
CLAMPED = ExpertAct("clamped_swiglu", alpha=1.702, limit=0.5)
ACTS = {"silu": SILU, "clamped": CLAMPED}


def _round_up(n, m):
    return (n + m - 1) // m * m


def make_quant_bank(E, D, I, quant, seed=0):
    """-> (bank uint8 [E, stride], BankInfo-like info, [(gate, up, down) dequantized fp32] per
    expert): each projection ftw.quant's bytes at a 64-aligned offset, as SPEC.md §5.2 lays
    out a slot."""
    rng = np.random.default_rng(seed)
    shapes = {"gate": (I, D), "up": (I, D), "down": (D, I)}
    projs, pos = [], 0
    for n, shape in shapes.items():
        pos = _round_up(pos, 64)
        projs.append(SimpleNamespace(name=n, shape=shape, offset=pos, nbytes=Q.quant_nbytes(quant, shape)))
        pos += projs[-1].nbytes
    stride = _round_up(pos, 4096)
    bank = np.zeros((E, stride), np.uint8)
    experts = []
    for e in range(E):
        w = []
        for p in projs:
            raw = Q.quantize(rng.standard_normal(p.shape).astype(np.float32) * p.shape[1] ** -0.5, quant)
            bank[e, p.offset:p.offset + p.nbytes] = np.frombuffer(raw, np.uint8)
            w.append(torch.from_numpy(Q.dequantize(raw, quant, p.shape)))
        experts.append(tuple(w))
    info = SimpleNamespace(name="blk.0.ffn_exps", slot_stride=stride, dtype="fp32", quant=quant,
                           projections=tuple(projs), num_experts=E)
    return torch.from_numpy(bank), info, experts


def reference(x, experts, slots, weights, act):
    """fp32 [T, D]: sum_k w[t, k] * expert(slot[t, k])(x[t]) with the dequantized weights."""
    T, R = x.shape[0], len(slots)
    out = torch.zeros(T, x.shape[1])
    for r, (s, w) in enumerate(zip(slots.tolist(), weights.tolist())):
        gate, up, down = experts[s]
        xt = x[r // (R // T)].float()
        out[r // (R // T)] += w * (down @ ffn.activate(gate @ xt, up @ xt, act))
    return out


def assert_close(got, want, rtol, what):
    err = (got - want).abs()
    scale = want.abs().max().item() + 1e-6
    worst = int(err.argmax())
    assert err.max().item() <= rtol * scale, (
        f"{what}: worst element {divmod(worst, want.shape[1])} = {got.flatten()[worst].item():.6g}, "
        f"reference {want.flatten()[worst].item():.6g} (error {err.max().item():.3g}, scale {scale:.3g})")


INTERPRET = grouped_experts.available() and os.environ.get("TRITON_INTERPRET") == "1"
CPU = pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1"))

# the default run's interpreted cells (conftest.py: the others are marked slow): every type's
# every code, each type at one token, the bf16 / clamped / several-token cases on one type each
SUITE_CELLS = {
    "test_decode_kernels_read_quantized_slots": [
        {"device": "cuda"}, {"T": 1}, {"T": 5, "quant": "q4_0"}],
    "test_grouped_kernels_read_quantized_runs": [
        {"device": "cuda"}, {"T": 1}, {"T": 9, "quant": "mxfp4"}, {"T": 64, "quant": "q8_0"}],
}
CUDA = pytest.param("cuda", marks=pytest.mark.gpu)


def test_quant_spec_reads_the_regions():
    _, info, _ = make_quant_bank(1, 96, 64, "q4_0")
    spec = QuantSpec.of(info)
    assert (spec.code, spec.I, spec.D, spec.scale_size) == (CODES["q4_0"], 64, 96, 2)
    assert spec.gate_scales == Q.regions("q4_0", (64, 96)).scales_offset == 64 * 48
    assert spec.down_scales == Q.regions("q4_0", (96, 64)).scales_offset == 96 * 32
    assert QuantSpec.of(SimpleNamespace(quant="none")) is None
    fp8 = QuantSpec.of(make_quant_bank(1, 200, 136, "fp8_e4m3")[1])
    assert (fp8.code, fp8.scale_size, fp8.gate_scales) == (CODES["fp8_e4m3"], 4, 136 * 200)  # I x D bytes, 64-aligned already
    with pytest.raises(ValueError, match="read q8_0, q4_0, mxfp4, fp8_e4m3 experts, not nvfp4"):
        QuantSpec.of(SimpleNamespace(quant="nvfp4", name="blk.0.ffn_exps", projections=()))


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("T, K, dtype, act, device", [
    pytest.param(*case, device.values[0], marks=device.marks)
    for case, device in [((1, 3, torch.float32, "silu"), CPU), ((5, 2, torch.bfloat16, "clamped"), CPU),
                         ((1, 3, torch.float32, "silu"), CUDA), ((64, 4, torch.bfloat16, "clamped"), CUDA)]])
def test_decode_kernels_read_quantized_slots(quant, T, K, dtype, act, device):
    """GatheredExperts on a quantized pool (triton_experts.run): each token's routes summed,
    a duplicate slot, a weight-0 route (reads nothing); summed=False gives each route's row.
    (Few tokens interpreted: each program is one route, so more tokens add interpreter time,
    not cases; cuda runs 64.) x in bf16 is widened exactly: the kernels compute in fp32."""
    E, D, I = 5, 96, 64  # 3 and 2 blocks: fewer than the kernels' steps
    storage, info, experts = make_quant_bank(E, D, I, quant, seed=T)
    rng = np.random.default_rng(T + K)
    slots = torch.from_numpy(rng.integers(0, E, T * K))
    slots[-1] = slots[0]
    weights = torch.from_numpy(rng.random(T * K, dtype=np.float32))
    weights[1] = 0.0
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(T)).to(dtype)
    want = reference(x, experts, slots, weights, ACTS[act])
    if device == "cpu":
        with pytest.raises(ValueError, match="Triton kernels only"):
            GatheredExperts(storage, {0: info}).run(0, x, slots, weights)  # no typed view of blocks
    gathered = GatheredExperts(storage.to(device), {0: info}, ACTS[act])
    gathered.use_triton = True
    x, slots, weights = x.to(device), slots.to(device), weights.to(device)
    rows = gathered.run(0, x, slots, weights, summed=False).cpu()  # (summed: their torch sum)
    assert rows.shape == (T * K, D) and torch.equal(rows[1], torch.zeros(D))
    assert_close(rows.view(T, K, D).sum(1), want, 1e-4, f"{quant} decode T={T} {dtype}")


def grouped_case(T, K, E, seed):
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]))  # [T, K]
    g = ffn.group_routes(ids)
    w_flat = torch.from_numpy(rng.random(T * K, dtype=np.float32))
    return ids, g, w_flat


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("T, dtype, act", [(1, torch.float32, "silu"), (9, torch.bfloat16, "clamped"),
                                           (64, torch.float32, "clamped")])
def test_grouped_kernels_read_quantized_runs(quant, device, T, dtype, act):
    """grouped_experts.run over runs of cache slots (each projection's bytes, bank.pool_bytes)
    and run_stacked over a streamed layer's buffer: x's dtype fp32 or bf16, 1 to 64 tokens
    (64 routes of one expert fill a whole row tile)."""
    E, K, D, I = 4, 2, 96, 160  # 3 and 5 blocks: the column tiles are partial
    storage, info, experts = make_quant_bank(E, D, I, quant, seed=T)
    spec = QuantSpec.of(info)
    ids, g, w_flat = grouped_case(T, K, E, seed=T)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(T)).to(dtype)
    want = reference(x, experts, ids.reshape(-1), w_flat, ACTS[act])
    rtol = 1e-4 if dtype == torch.float32 else 2e-2
    views = pool_bytes(storage.to(device), info)
    runs = [(ffn.ExpertWeights.of(views, e), n) for e, n in zip(g.experts, g.counts)]
    assert runs[0][0].gate.dtype == torch.uint8 and runs[0][0].gate.shape == (info.projections[0].nbytes,)
    x, w_flat, tok, rid = (t.to(device) for t in (x, w_flat, g.token_ids, g.route_ids))
    if device == "cuda":  # what run_expert_runs and run_stacked_layer check before they launch
        assert grouped_experts.chosen(x, runs, spec) and not grouped_experts.chosen(x, runs)
        assert grouped_experts.chosen_stacks(x, ffn.ExpertWeights.of(views), spec)
    got = torch.zeros(T, D, device=device)
    got.index_add_(0, tok, grouped_experts.run(x, tok, rid, w_flat, runs, ACTS[act], spec))
    assert_close(got.cpu(), want, rtol, f"{quant} grouped run T={T} {dtype}")
    counts = np.bincount(ids.reshape(-1).numpy(), minlength=E)
    n_tiles = int((-(-counts // grouped_experts.BM)).sum())
    stacked = torch.zeros(T, D, device=device)
    stacked.index_add_(0, tok, grouped_experts.run_stacked(
        x, tok, rid, w_flat, ffn.ExpertWeights.of(views), 0,
        torch.from_numpy(counts).to(device), n_tiles, ACTS[act], spec))
    assert_close(stacked.cpu(), want, rtol, f"{quant} grouped run_stacked T={T} {dtype}")


def test_run_expert_runs_refuses_quantized_weights_off_the_kernels():
    """On cpu tensors (no device kernels) a quantized bank's bytes are never read as weights."""
    storage, info, _ = make_quant_bank(2, 64, 32, "q8_0")
    ids, g, w_flat = grouped_case(3, 1, 2, seed=0)
    runs = [(ffn.ExpertWeights.of(pool_bytes(storage, info), e), n) for e, n in zip(g.experts, g.counts)]
    idx = torch.stack([g.token_ids, g.route_ids])
    with pytest.raises(ValueError, match="q8_0 experts on the device run through the grouped Triton"):
        ffn.run_expert_runs(torch.randn(3, 64), idx, w_flat, torch.zeros(3, 64), runs,
                            torch.float32, quant=QuantSpec.of(info))
    with pytest.raises(ValueError, match="no typed views"):
        pool_views(storage, info)


def random_block_bytes(E, D, I, quant, seed):
    """A bank of random bytes in each projection's blocks (every code: int8 -128, every nibble)
    and random scales (fp16 d in +-[2^-10, 2^-6]; e8m0 codes 0, 1 and 110..124), as a published
    file may hold them; its dequantized experts."""
    storage, info, _ = make_quant_bank(E, D, I, quant, seed)
    rng = np.random.default_rng(seed)
    bank = storage.numpy()
    experts = []
    for e in range(E):
        w = []
        for p in info.projections:
            r = Q.regions(quant, p.shape)
            raw = bank[e, p.offset:p.offset + p.nbytes]
            raw[:r.qs_nbytes] = rng.integers(0, 256, r.qs_nbytes, dtype=np.uint8)
            n = r.scales_shape[0] * r.scales_shape[1]
            if quant == "mxfp4":
                scales = rng.integers(110, 125, n).astype(np.uint8)
                scales[:2] = (0, 1)
            elif quant == "fp8_e4m3":  # every finite e4m3 (no 0x7f / 0xff), fp32 scales of either sign
                raw[:r.qs_nbytes] = rng.choice(np.r_[0:0x7f, 0x80:0xff], r.qs_nbytes)
                scales = (2.0 ** rng.uniform(-14, -8, n) * rng.choice([-1, 1], n)).astype("<f4").view(np.uint8)
            else:
                mag = 2.0 ** rng.uniform(-10, -6, n)
                scales = (mag * rng.choice([-1, 1], n)).astype("<f2").view(np.uint8)
            raw[r.scales_offset:r.scales_offset + scales.size] = scales
            w.append(torch.from_numpy(Q.dequantize(raw.tobytes(), quant, p.shape)))
        experts.append(tuple(w))
    return storage, info, experts


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("device", [CPU, CUDA])
def test_every_code_decodes_as_the_reference(quant, device):
    """Random bytes in the blocks and scales: each code the reference decodes (q8_0's -128,
    every q4_0 nibble and e2m1 code, e8m0 exponents as fp32 exponent fields, 0 = 2^-127 among
    them; every finite e4m3, subnormals too) decodes alike in both kernels."""
    E, K, T, D, I = 3, 2, 2, 64, 96
    if quant == "fp8_e4m3":
        D, I = 136, 200  # partial tiles, and blocks of 32 that end past the row
    storage, info, experts = random_block_bytes(E, D, I, quant, seed=11)
    ids, g, w_flat = grouped_case(T, K, E, seed=5)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(5))
    want = reference(x, experts, ids.reshape(-1), w_flat, SILU)
    gathered = GatheredExperts(storage.to(device), {0: info})
    gathered.use_triton = True
    got = gathered.run(0, x.to(device), ids.reshape(-1).to(device), w_flat.to(device)).cpu()
    assert_close(got, want, 1e-4, f"{quant} decode, random bytes")
    runs = [(ffn.ExpertWeights.of(pool_bytes(storage.to(device), info), e), n)
            for e, n in zip(g.experts, g.counts)]
    tok, rid = g.token_ids.to(device), g.route_ids.to(device)
    grouped = torch.zeros(T, D, device=device).index_add_(0, tok, grouped_experts.run(
        x.to(device), tok, rid, w_flat.to(device), runs, SILU, QuantSpec.of(info)))
    assert_close(grouped.cpu(), want, 1e-4, f"{quant} grouped, random bytes")


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("dtype", [torch.bfloat16])  # (fp32 inputs: the other kernel tests)
def test_fp8_kernels_take_any_shape(device, dtype):
    """fp8_e4m3's tiles may be partial (SPEC.md §9.3): D = 200, I = 75, neither whole 32-blocks
    nor 128-tiles, and more than one tile of each, through the decode and the grouped kernels."""
    E, K, T, D, I = 4, 2, 3, 200, 75
    storage, info, experts = make_quant_bank(E, D, I, "fp8_e4m3", seed=3)
    ids, g, w_flat = grouped_case(T, K, E, seed=3)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(3)).to(dtype)
    want = reference(x, experts, ids.reshape(-1), w_flat, SILU)
    rtol = 1e-4 if dtype == torch.float32 else 2e-2
    gathered = GatheredExperts(storage.to(device), {0: info})
    gathered.use_triton = True
    got = gathered.run(0, x.to(device), ids.reshape(-1).to(device), w_flat.to(device)).cpu()
    assert_close(got, want, 1e-4, f"fp8_e4m3 decode D={D} I={I} {dtype}")  # fp32 math
    runs = [(ffn.ExpertWeights.of(pool_bytes(storage.to(device), info), e), n)
            for e, n in zip(g.experts, g.counts)]
    tok, rid = g.token_ids.to(device), g.route_ids.to(device)
    grouped = torch.zeros(T, D, device=device).index_add_(0, tok, grouped_experts.run(
        x.to(device), tok, rid, w_flat.to(device), runs, SILU, QuantSpec.of(info)))
    assert_close(grouped.cpu(), want, rtol, f"fp8_e4m3 grouped D={D} I={I} {dtype}")
