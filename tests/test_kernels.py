"""CPU expert kernels (freetoken.kernels) against a torch fp32 reference, on every ISA path this
CPU supports, with banks laid out here per docs/INTERFACES.md section 3."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from freetoken import kernels
from freetoken.experts import ffn

ISAS = kernels.available_isas()
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ACT_REF = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}


def _round_up(n, m):
    return (n + m - 1) // m * m


def make_bank(E, D, I, dtype, seed=0):
    """A bank of E experts with random weights -> (bank uint8, layout, info, (gate, up, down) fp32)."""
    g = torch.Generator().manual_seed(seed)
    tdt = TORCH_DTYPES[dtype]
    gate = (torch.randn(E, I, D, generator=g) / D ** 0.5).to(tdt)
    up = (torch.randn(E, I, D, generator=g) / D ** 0.5).to(tdt)
    down = (torch.randn(E, D, I, generator=g) / I ** 0.5).to(tdt)
    nbytes = D * I * gate.element_size()
    og, ou = 0, _round_up(nbytes, 64)
    od = ou + _round_up(nbytes, 64)
    stride = _round_up(od + nbytes, 4096)
    bank = np.zeros(E * stride, np.uint8)
    for e in range(E):
        for off, w in ((og, gate[e]), (ou, up[e]), (od, down[e])):
            bank[e * stride + off:e * stride + off + nbytes] = w.contiguous().view(torch.uint8).numpy().ravel()
    projs = (SimpleNamespace(name="gate", shape=(I, D), offset=og, nbytes=nbytes),
             SimpleNamespace(name="up", shape=(I, D), offset=ou, nbytes=nbytes),
             SimpleNamespace(name="down", shape=(D, I), offset=od, nbytes=nbytes))
    info = SimpleNamespace(name="blk.0.ffn_exps", slot_stride=stride, dtype=dtype, projections=projs)
    return bank, kernels.layout_from_bank_info(info), info, (gate.float(), up.float(), down.float())


def reference(x, weights3, tok, exp, w, act="silu"):
    gate, up, down = weights3
    out = torch.zeros_like(x)
    for t, e, wt in zip(tok.tolist(), exp.tolist(), w.tolist()):
        g, u = gate[e] @ x[t], up[e] @ x[t]
        # clamped_swiglu with ExpertAct's default alpha and limit, as submit takes the name
        h = (ffn.activate(g, u, kernels.ExpertAct(act)) if act == "clamped_swiglu"
             else ACT_REF[act](g) * u)
        out[t] += wt * (down[e] @ h)
    return out


def assert_close(got, want, rtol, what):
    """Max error relative to the output's scale; on failure name the worst element."""
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    err = (got - want).abs()
    scale = want.abs().max().item() + 1e-6
    worst = int(err.argmax())
    t, d = divmod(worst, want.shape[1])
    assert err.max().item() <= rtol * scale, (
        f"{what}: worst element out[{t}, {d}] = {got.flatten()[worst].item():.6g}, reference "
        f"{want.flatten()[worst].item():.6g} (error {err.max().item():.3g}, scale {scale:.3g}, rtol {rtol})")


def rtol_for(isa, dtype):
    # avx512bf16 rounds x and the hidden activations to bf16 (cython/ffn_dot_impl.c).
    return 2e-2 if (isa == "avx512bf16" and dtype == "bf16") else 1e-4


def routes(T, K, E, rng):
    """Top-K distinct experts per token (as a router gives them), flattened to R = T*K routes."""
    exp = np.stack([rng.choice(E, size=K, replace=False) for _ in range(T)]).astype(np.int32)
    tok = np.repeat(np.arange(T, dtype=np.int32), K)
    w = rng.random(T * K, dtype=np.float32)
    return tok, exp.ravel(), w


@pytest.fixture(scope="module")
def pools():
    made = {}

    def get(threads, isa):
        if (threads, isa) not in made:
            made[threads, isa] = kernels.CpuExpertPool(threads, isa=isa)
        return made[threads, isa]
    return get


# (D, I, T, K, E): D and I not multiples of 8/16/32, tokens 1..64, top-k 1..8
CASES = [(100, 37, 1, 1, 3), (129, 67, 5, 8, 10), (72, 200, 64, 4, 6), (33, 17, 17, 8, 8), (250, 95, 3, 2, 2)]

# Tunings that change the blocking, prefetching, work-item size and who runs items.
TUNINGS = ("rows=2,down_rows=2", "rows=4,down_rows=4,prefetch=1024", "rows=4,prefetch=512,prefetch_hint=t1,item_kb=4",
           "help=0,item_kb=8,down_rows=4", "help=1,prefetch=0", "rows=1,down_rows=1,item_kb=192,prefetch=2048",
           "item_kb=4,spread=2")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_torch_reference(pools, isa, dtype, threads):
    pool = pools(threads, isa)
    rng = np.random.default_rng(7)
    for i, (D, I, T, K, E) in enumerate(CASES):
        bank, layout, _, w3 = make_bank(E, D, I, dtype, seed=i)
        x = torch.randn(T, D, generator=torch.Generator().manual_seed(i))
        tok, exp, w = routes(T, K, E, rng)
        out = np.zeros((T, D), np.float32)
        pool.run(x.numpy(), bank, layout, tok, exp, w, out)
        assert_close(out, reference(x, w3, tok, exp, w), rtol_for(isa, dtype),
                     f"{isa} {dtype} threads={threads} D={D} I={I} T={T} K={K}")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_activations_and_duplicate_routes(pools, isa, act):
    """Several routes of the same (token, expert) and unsorted routes all accumulate."""
    bank, layout, _, w3 = make_bank(5, 70, 45, "bf16", seed=3)
    x = torch.randn(4, 70)
    tok = np.array([3, 0, 0, 3, 1, 0, 2, 2], np.int32)
    exp = np.array([4, 1, 1, 0, 4, 4, 2, 2], np.int32)
    w = np.linspace(0.1, 0.8, 8).astype(np.float32)
    out = np.zeros((4, 70), np.float32)
    pools(2, isa).run(x.numpy(), bank, layout, tok, exp, w, out, act=act)
    assert_close(out, reference(x, w3, tok, exp, w, act), rtol_for(isa, "bf16"), f"{isa} {act}")


@pytest.mark.parametrize("isa", ISAS)
def test_staged_and_direct_modes_agree_bit_for_bit(pools, isa, monkeypatch):
    """The staged down mode (decode-sized calls) and the direct mode (large calls) add the same
    terms in the same order, on any thread count: results are identical, and match torch."""
    bank, layout, _, w3 = make_bank(12, 150, 70, "bf16", seed=4)
    x = torch.randn(9, 150)
    tok, exp, w = routes(9, 6, 12, np.random.default_rng(5))
    outs = {}
    for mode, cap in (("staged", kernels.STAGE_MAX_BYTES), ("direct", 0)):
        monkeypatch.setattr(kernels, "STAGE_MAX_BYTES", cap)
        for threads in (1, 2):
            out = np.zeros((9, 150), np.float32)
            outs[mode, threads] = pools(threads, isa).run(x.numpy(), bank, layout, tok, exp, w, out)
    first = outs["staged", 1]
    assert_close(first, reference(x, w3, tok, exp, w), rtol_for(isa, "bf16"), f"{isa} staged")
    for key, out in outs.items():
        assert np.array_equal(out, first), f"{isa} {key} differs from staged on 1 thread"


@pytest.mark.parametrize("isa", ISAS)
def test_many_inputs_per_expert_and_long_rows(isa):
    """Experts with 1, 5 and over 16 inputs (the avx2 bf16 kernel's input groups, odd ones
    included) and rows long enough to be cut in several K-chunks, with a tail: every path
    matches torch, and every tuning gives the same bits."""
    D, I, T = 1203, 45, 37
    bank, layout, _, w3 = make_bank(4, D, I, "bf16", seed=11)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(2))
    # expert 0: every token; 1: all but 5; 2: 5 tokens; 3: one token
    exp = [0] * T + [1] * (T - 5) + [2] * 5 + [3]
    tok = list(range(T)) + list(range(5, T)) + list(range(5)) + [7]
    tok, exp = np.array(tok, np.int32), np.array(exp, np.int32)
    w = np.random.default_rng(1).random(len(tok), dtype=np.float32)
    pool = kernels.CpuExpertPool(2, isa=isa)
    want = pool.run(x.numpy(), bank, layout, tok, exp, w, np.zeros((T, D), np.float32))
    assert_close(want, reference(x, w3, tok, exp, w), rtol_for(isa, "bf16"), f"{isa} many inputs")
    for text in TUNINGS[:3] + TUNINGS[5:6]:  # rows 2 and 4, 1 row pair, items of 4 KiB
        pool.tuning = kernels.KernelTuning.parse(text)
        got = pool.run(x.numpy(), bank, layout, tok, exp, w, np.zeros((T, D), np.float32))
        assert np.array_equal(got, want), f"{isa} {text}"


def test_bf16_path_is_close_when_x_is_bf16(pools):
    if "avx512bf16" not in ISAS:
        pytest.skip("CPU lacks AVX-512-BF16")
    bank, layout, _, w3 = make_bank(8, 256, 96, "bf16", seed=5)
    x = torch.randn(2, 256).bfloat16().float()  # what a bf16 compute dtype hands over
    tok, exp, w = routes(2, 8, 8, np.random.default_rng(0))
    out = pools(2, "avx512bf16").run(x.numpy(), bank, layout, tok, exp, w, np.zeros((2, 256), np.float32))
    assert_close(out, reference(x, w3, tok, exp, w), 1e-2, "avx512bf16 with bf16 x")


def test_auto_path_takes_bf16_dot_only_for_bf16_exact_x(monkeypatch):
    monkeypatch.delenv("FREETOKEN_ISA", raising=False)
    pool = kernels.CpuExpertPool(1)
    bank, layout, _, w3 = make_bank(4, 64, 32, "bf16")
    tok, exp, w = routes(2, 2, 4, np.random.default_rng(0))
    for x in (torch.randn(2, 64), torch.randn(2, 64).bfloat16().float()):
        out = pool.run(x.numpy(), bank, layout, tok, exp, w, np.zeros((2, 64), np.float32))
        is_bf16 = bool((x.bfloat16().float() == x).all())
        want = "avx512bf16" if (pool.isa == "avx512bf16" and is_bf16) else \
            ("avx512" if pool.isa == "avx512bf16" else pool.isa)
        assert pool.last_isa == want
        assert_close(out, reference(x, w3, tok, exp, w), 1e-2 if want == "avx512bf16" else 1e-4, want)


def test_empty_routes_and_bad_arguments():
    pool = kernels.CpuExpertPool(1)
    bank, layout, _, _ = make_bank(3, 40, 24, "bf16")
    x = np.ones((2, 40), np.float32)
    out = np.zeros((2, 40), np.float32)
    none = np.zeros(0, np.int32)
    assert pool.run(x, bank, layout, none, none, np.zeros(0, np.float32), out) is out
    assert not out.any()
    ok = (np.array([0], np.int32), np.array([2], np.int32), np.array([1.0], np.float32))
    bad = {
        "expert id": (x, np.array([0], np.int32), np.array([3], np.int32), ok[2], out),
        "token id": (x, np.array([2], np.int32), ok[1], ok[2], out),
        "float64 x": (x.astype(np.float64), *ok, out),
        "strided x": (np.ones((2, 80), np.float32)[:, ::2], *ok, out),
        "int64 ids": (x, ok[0].astype(np.int64), *ok[1:], out),
        "out shape": (x, *ok, np.zeros((3, 40), np.float32)),
    }
    for what, (xx, t, e, w, o) in bad.items():
        with pytest.raises(kernels.KernelArgumentError):
            pool.run(xx, bank, layout, t, e, w, o)
    with pytest.raises(kernels.KernelArgumentError):
        pool.run(x, bank, layout, *ok, out, act="relu")
    handle = pool.submit(x, bank, layout, *ok, out)
    with pytest.raises(kernels.KernelArgumentError, match="not waited"):
        pool.submit(x, bank, layout, *ok, out)
    handle.wait()


def test_layout_from_bank_info_checks_shapes():
    _, layout, info, _ = make_bank(2, 40, 24, "fp16")
    assert (layout.D, layout.I, layout.dtype, layout.offset_gate) == (40, 24, "fp16", 0)
    assert layout.offset_down == info.projections[2].offset
    wrong = SimpleNamespace(slot_stride=info.slot_stride, dtype="fp16", projections=(
        info.projections[0], info.projections[1],
        SimpleNamespace(name="down", shape=(24, 40), offset=info.projections[2].offset, nbytes=1920)))
    with pytest.raises(kernels.KernelArgumentError, match="shapes disagree"):
        kernels.layout_from_bank_info(wrong)
    with pytest.raises(kernels.KernelArgumentError, match="slot_stride"):
        kernels.ExpertLayout(4096, "bf16", 64, 64, 0, 8192, 16384)
