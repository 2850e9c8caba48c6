"""Many tokens' experts as grouped Triton kernels (freetoken/experts/compute/grouped_experts.py) against
the per-expert torch path of ffn.run_expert_runs, under the interpreter (cpu tensors) and on
cuda; the row tiles; when run_expert_runs takes the kernels. The engine's prefill through them
(resident and streamed, fp32) is held against the reference by tests/test_stream_pipeline.py
and the HF parity tests on cuda.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from freetoken.experts import ffn
from freetoken.experts.compute import grouped_experts

from fused_support import kernel_checks_test, rand

D, I = 80, 48  # neither a multiple of the kernels' 64-wide blocks


def test_tiles_example_and_cover():
    group, row, end = grouped_experts.tiles(torch.tensor([3, 0, 5]), 4)
    assert group.tolist() == [0, 2, 2] and row.tolist() == [0, 3, 7] and end.tolist() == [3, 3, 8]
    given = grouped_experts.tiles(torch.tensor([3, 0, 5]), 4, n_tiles=3)  # the device's way
    assert [t.tolist() for t in given] == [[0, 2, 2], [0, 3, 7], [3, 3, 8]]
    counts = np.random.default_rng(0).integers(0, 70, 40)
    counts[[0, 7, 8, 39]] = 0  # groups with no routes, first and last too
    for bm in (16, 32, 64):
        group, row, end = (t.tolist() for t in grouped_experts.tiles(torch.from_numpy(counts), bm))
        seen = np.zeros(counts.sum(), dtype=int)
        for g, r in zip(group, row):
            seen[r:min(r + bm, end[g])] += 1
            assert end[g] - counts[g] <= r < end[g]
        assert (seen == 1).all()  # every route in exactly one tile


def test_chunks_of_whole_groups():
    assert list(ffn._chunks([3, 2, 4], 5)) == [(0, 2, 0, 5), (2, 3, 5, 4)]
    assert list(ffn._chunks([9, 1, 1], 5)) == [(0, 1, 0, 9), (1, 3, 9, 2)]  # one group over the limit
    assert list(ffn._chunks([1, 1, 1, 1], 5, cut=2)) == [(0, 2, 0, 2), (2, 4, 2, 2)]
    assert list(ffn._chunks([], 5)) == []


@pytest.mark.gpu
def test_tiles_on_the_device_equal_the_hosts():
    """With n_tiles given (no sync), as run_stacked builds them on cuda."""
    counts = np.random.default_rng(1).integers(0, 70, 40)
    counts[[0, 7, 8, 39]] = 0
    for bm in (4, 16, 64):
        want = grouped_experts.tiles(torch.from_numpy(counts), bm)
        got = grouped_experts.tiles(torch.from_numpy(counts).cuda(), bm, int((-(-counts // bm)).sum()))
        for w, g in zip(want, got):
            assert g.is_cuda and g.dtype == torch.int64 and g.tolist() == w.tolist()


def make_runs(device, dtype, counts, slots, seed=0):
    """A slot pool [C, stride] of dtype holding gate/up/down per slot (a gap after each, as the
    cache's slots have), and runs [((gate, up, down), n)] over the given slots."""
    stride = 2 * I * D + D * I + 40
    pool = rand(max(slots) + 1, stride, dtype=dtype, device=device, scale=D ** -0.5, seed=seed)
    runs = []
    for s, n in zip(slots, counts):
        gate = pool[s, :I * D].view(I, D)
        up = pool[s, I * D:2 * I * D].view(I, D)
        down = pool[s, 2 * I * D:2 * I * D + D * I].view(D, I)
        runs.append(((gate, up, down), n))
    return runs


def routes(device, counts, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    R = int(sum(counts))
    tok = torch.randint(0, T, (R,), generator=g)
    rid = torch.randperm(R, generator=g)
    w = torch.rand(R, generator=g)
    return tok.to(device), rid.to(device), w.to(device)


def per_expert(x, tok, rid, w, runs):
    """The per-expert torch path's rows: w[rid] * expert(x[tok]) in x's dtype, then fp32."""
    ys, a = [], 0
    for (gate, up, down), n in runs:
        xe = x.index_select(0, tok[a:a + n])
        h = F.silu(F.linear(xe, gate)) * F.linear(xe, up)
        ys.append(torch.mm(h, down.t()).float() * w.index_select(0, rid[a:a + n])[:, None])
        a += n
    return torch.cat(ys)


def assert_rows(got, want, dtype, what):
    """fp32: the same sums in another order; bf16: one or two roundings of an intermediate
    apart (more under the interpreter, which truncates)."""
    assert got.shape == want.shape and got.dtype == torch.float32, what
    err = float((got - want).abs().max())
    scale = float(want.abs().max())
    tol = 2e-5 if dtype == torch.float32 else (4 if got.device.type == "cpu" else 2) * 2.0 ** -7
    assert err <= tol * scale, f"{what}: worst {err} > {tol} x {scale}"


def check_grouped(device, dtype):
    T = 37
    x = rand(T, D, dtype=dtype, device=device, seed=1)
    for i, (counts, slots) in enumerate([([1], [0]), ([5, 17, 3, 40, 70, 1], [4, 0, 7, 2, 2, 5]),
                                         ([65, 129], [1, 3])]):
        runs = make_runs(device, dtype, counts, slots, seed=10 + i)
        tok, rid, w = routes(device, counts, T, seed=20 + i)
        got = grouped_experts.run(x, tok, rid, w, runs)
        assert_rows(got, per_expert(x, tok, rid, w, runs), dtype, f"runs {counts}")


def check_grouped_chunks(device, dtype):
    """ffn._grouped_runs: chunks of whole runs (a small limit), one index_add each, equal to
    the per-expert path's sum."""
    T, counts, slots = 29, [30, 2, 11, 50, 7], [3, 1, 0, 2, 1]
    x = rand(T, D, dtype=dtype, device=device, seed=3)
    runs = make_runs(device, dtype, counts, slots, seed=4)
    tok, rid, w = routes(device, counts, T, seed=5)
    want = torch.zeros(T, D, dtype=torch.float32, device=device)
    want.index_add_(0, tok, per_expert(x, tok, rid, w, runs))
    before = ffn.GROUPED_MAX_ROUTES
    ffn.GROUPED_MAX_ROUTES = 40
    try:
        got = torch.zeros_like(want)
        ffn._grouped_runs(x, torch.stack([tok, rid]), w, got, runs, None, None)
    finally:
        ffn.GROUPED_MAX_ROUTES = before
    assert_rows(got, want, dtype, "chunked")


def make_stacks(device, dtype, E, seed=0):
    """A layer buffer's views: E slots [E, stride] of dtype (a gap after each expert), as
    (gate [E, I, D], up [E, I, D], down [E, D, I])."""
    stride = 2 * I * D + D * I + 40
    pool = rand(E, stride, dtype=dtype, device=device, scale=D ** -0.5, seed=seed)
    return (pool[:, :I * D].view(E, I, D), pool[:, I * D:2 * I * D].view(E, I, D),
            pool[:, 2 * I * D:2 * I * D + D * I].view(E, D, I))


def check_stacked(device, dtype):
    """ffn.run_stacked_layer (a streamed layer: device-built tables, chunks of whole experts
    under a small limit, experts with no routes between) against the per-expert path's sum."""
    T, counts = 37, np.array([5, 0, 40, 17, 0, 70, 1, 0])
    x = rand(T, D, dtype=dtype, device=device, seed=11)
    stacks = make_stacks(device, dtype, len(counts), seed=12)
    runs = [((stacks[0][e], stacks[1][e], stacks[2][e]), int(n)) for e, n in enumerate(counts) if n]
    tok, rid, w = routes(device, counts, T, seed=13)
    want = torch.zeros(T, D, dtype=torch.float32, device=device)
    want.index_add_(0, tok, per_expert(x, tok, rid, w, runs))
    before = ffn.GROUPED_MAX_ROUTES
    ffn.GROUPED_MAX_ROUTES = 45  # chunks: experts 0-2 (45), 3-4, 5 (70: alone), 6-7
    try:
        got = torch.zeros_like(want)
        ffn.run_stacked_layer(x, torch.stack([tok, rid]), w, got, stacks, counts,
                              torch.from_numpy(counts).to(device))
    finally:
        ffn.GROUPED_MAX_ROUTES = before
    assert_rows(got, want, dtype, "stacked")


test_kernels = kernel_checks_test([check_grouped, check_grouped_chunks, check_stacked])


def test_chosen_only_for_cuda_and_plain_weights():
    runs = make_runs("cpu", torch.float32, [3], [0])
    x = torch.zeros(2, D)
    assert not grouped_experts.chosen(x, runs)  # cpu: the per-expert path
    assert not grouped_experts.chosen_stacks(x, make_stacks("cpu", torch.float32, 2))
    if not torch.cuda.is_available():
        return
    cruns = make_runs("cuda", torch.bfloat16, [3], [0])
    xc = x.to("cuda", torch.bfloat16)
    assert grouped_experts.chosen(xc, cruns) == grouped_experts.available()
    assert not grouped_experts.chosen(xc.float(), cruns)  # weights of another dtype
    (gate, up, down), n = cruns[0]
    assert not grouped_experts.chosen(xc, [((gate.t(), up, down), n)])  # not row-major
    (_, other_up, _), _ = make_runs("cuda", torch.bfloat16, [3], [0], seed=9)[0]
    assert not grouped_experts.chosen(xc, [((gate, other_up, down), n)])  # two storages
    stacks = make_stacks("cuda", torch.bfloat16, 4)
    assert grouped_experts.chosen_stacks(xc, stacks) == grouped_experts.available()
    assert not grouped_experts.chosen_stacks(xc.float(), stacks)
    assert not grouped_experts.chosen_stacks(xc, (stacks[0].transpose(1, 2),) + stacks[1:])
    assert not grouped_experts.chosen_stacks(xc, (stacks[0], make_stacks("cuda", torch.bfloat16, 4)[1], stacks[2]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_run_expert_runs_grouped_equals_per_expert_cuda(monkeypatch, dtype):
    """run_expert_runs on cuda with the fills' event: the grouped kernels (hits, then the
    fresh fills after the wait) against its per-expert torch path (grouped_experts.chosen
    patched off)."""
    T, counts, slots = 300, [40, 90, 7, 1, 260, 33], [5, 2, 9, 0, 1, 3]
    x = rand(T, D, dtype=dtype, device="cuda", seed=6)
    runs = make_runs("cuda", dtype, counts, slots, seed=7)
    tok, rid, w = routes("cuda", counts, T, seed=8)
    idx = torch.stack([tok, rid])
    outs = {}
    chosen = grouped_experts.chosen
    for mode in ("triton", "torch"):
        monkeypatch.setattr(grouped_experts, "chosen",
                            chosen if mode == "triton" else lambda x, runs, quant=None: False)
        assert grouped_experts.chosen(x, runs) == (mode == "triton")
        done = torch.cuda.Event()
        done.record()
        outs[mode] = torch.zeros(T, D, dtype=torch.float32, device="cuda")
        ffn.run_expert_runs(x, idx, w, outs[mode], runs, dtype, fill_done=done, first_fill=4)
    assert_rows(outs["triton"], outs["torch"], dtype, "run_expert_runs")
