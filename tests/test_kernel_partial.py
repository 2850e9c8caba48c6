"""Partial experts on the CPU kernels: ExpertLayout.rows(lo, hi) runs intermediate rows [lo, hi)
of each expert (gate/up rows lo.., down columns lo.. with down's rows still I apart: down_ld),
on every ISA path this CPU supports, against torch on the sliced weights; the shares of disjoint
ranges add up to the whole expert; a down matrix with padded rows (down_ld > I) reads only its
I columns; the serve path takes partial layouts too."""
import threading

import numpy as np
import pytest
import torch

from freetoken import kernels
from freetoken.experts.device_plan import Mailbox

from test_kernels import (ISAS, TORCH_DTYPES, TUNINGS, assert_close, make_bank, pools,  # noqa: F401
                          reference, rtol_for)

# (D, I, T, K, E, lo, hi): D and I not multiples of 8/16/32, tokens 1..16, top-k 1..8
CASES = [(100, 37, 1, 1, 3, 5, 37), (129, 67, 5, 8, 10, 1, 66), (33, 17, 16, 8, 8, 16, 17),
         (250, 95, 3, 2, 2, 31, 64), (72, 200, 9, 4, 6, 0, 129)]


def _round_up(n, m):
    return (n + m - 1) // m * m


def sliced(w3, lo, hi):
    """The fp32 weights of rows [lo, hi): gate/up rows, down columns."""
    gate, up, down = w3
    return gate[:, lo:hi], up[:, lo:hi], down[:, :, lo:hi]


def bank_of(w3, dtype, down_ld=None, fill=0.0):
    """A bank holding these (exactly representable) fp32 weights in `dtype`, down's rows down_ld
    elements apart (None: I), the gap columns set to `fill` -> (bank, layout)."""
    gate, up, down = (w.to(TORCH_DTYPES[dtype]) for w in w3)
    E, I, D = gate.shape
    ld = down_ld or I
    esize = gate.element_size()
    padded = torch.full((E, D, ld), fill, dtype=down.dtype)
    padded[:, :, :I] = down
    og, ou = 0, _round_up(I * D * esize, 64)
    od = ou + _round_up(I * D * esize, 64)
    stride = _round_up(od + D * ld * esize, 4096)
    bank = np.zeros(E * stride, np.uint8)
    for e in range(E):
        for off, w in ((og, gate[e]), (ou, up[e]), (od, padded[e])):
            raw = w.contiguous().view(torch.uint8).numpy().ravel()
            bank[e * stride + off:e * stride + off + raw.size] = raw
    return bank, kernels.ExpertLayout(stride, dtype, D, I, og, ou, od, down_ld)


def routes_dup(T, K, E, rng):
    """Top-K experts per token drawn with replacement (repeated (token, expert) routes), in a
    shuffled order."""
    exp = rng.integers(0, E, size=(T, K)).astype(np.int32).ravel()
    tok = np.repeat(np.arange(T, dtype=np.int32), K)
    w = rng.random(T * K, dtype=np.float32)
    order = rng.permutation(T * K)
    return tok[order], exp[order], w[order]


def run(pool, x, bank, layout, tok, exp, w, out=None):
    out = np.zeros(tuple(x.shape), np.float32) if out is None else out
    return pool.run(x.numpy(), bank, layout, tok, exp, w, out)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("threads", [1, 2])
def test_partial_matches_sliced_weights_and_sums_to_whole(pools, isa, dtype, threads):
    """(a) rows(lo, hi) against torch on the sliced weights and, bit for bit, against a bank that
    holds only those rows; (b) the shares of [0, lo) and [lo, I) add up to the whole expert,
    summed apart or accumulated into one out; (c) rows(0, I) is the layout and gives its bits."""
    pool = pools(threads, isa)
    rng = np.random.default_rng(3)
    rtol = rtol_for(isa, dtype)
    for i, (D, I, T, K, E, lo, hi) in enumerate(CASES):
        what = f"{isa} {dtype} threads={threads} D={D} I={I} T={T} K={K} rows [{lo}, {hi})"
        bank, layout, _, w3 = make_bank(E, D, I, dtype, seed=i)
        x = torch.randn(T, D, generator=torch.Generator().manual_seed(i))
        tok, exp, w = routes_dup(T, K, E, rng)
        part = layout.rows(lo, hi)
        esize = kernels.DTYPE_SIZES[dtype]
        assert (part.I, part.down_ld, part.expert_nbytes) == (hi - lo, I, 3 * D * (hi - lo) * esize)
        got = run(pool, x, bank, part, tok, exp, w)
        assert_close(got, reference(x, sliced(w3, lo, hi), tok, exp, w), rtol, what)
        own_bank, own_layout = bank_of(sliced(w3, lo, hi), dtype)
        assert np.array_equal(got, run(pool, x, own_bank, own_layout, tok, exp, w)), \
            f"{what}: differs from a bank of the sliced weights"

        full = run(pool, x, bank, layout, tok, exp, w)
        assert layout.rows(0, I) == layout
        assert np.array_equal(run(pool, x, bank, layout.rows(0, I), tok, exp, w), full), what
        cut = max(lo, 1)  # a split point inside (0, I)
        a = run(pool, x, bank, layout.rows(0, cut), tok, exp, w)
        b = run(pool, x, bank, layout.rows(cut, I), tok, exp, w)
        assert_close(a + b, full, 1e-4, f"{what}: [0, {cut}) + [{cut}, {I}) against the whole")
        both = run(pool, x, bank, layout.rows(cut, I), tok, exp, w, out=a.copy())
        assert_close(both, full, 1e-4, f"{what}: [{cut}, {I}) added into [0, {cut})'s out")
        assert_close(a + b, reference(x, w3, tok, exp, w), rtol, f"{what}: the sum against torch")


@pytest.mark.parametrize("isa", ISAS)
def test_padded_down_rows_read_only_their_columns(isa, monkeypatch):
    """down_ld > I with NaN in every gap column: the same bits as the contiguous bank, in the
    staged and the direct down mode and under every tuning (blocking, prefetch, items)."""
    D, I, T, E = 131, 45, 12, 5
    _, _, _, w3 = make_bank(E, D, I, "bf16", seed=8)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(8))
    tok, exp, w = routes_dup(T, 4, E, np.random.default_rng(8))
    plain_bank, plain = bank_of(w3, "bf16")
    pad_bank, padded = bank_of(w3, "bf16", down_ld=I + 19, fill=float("nan"))
    assert padded.down_ld == I + 19 and padded.expert_nbytes == plain.expert_nbytes
    pool = kernels.CpuExpertPool(2, isa=isa)
    for cap in (kernels.STAGE_MAX_BYTES, 0):
        monkeypatch.setattr(kernels, "STAGE_MAX_BYTES", cap)
        want = run(pool, x, plain_bank, plain, tok, exp, w)
        for text in ("default",) + TUNINGS:
            pool.tuning = kernels.KernelTuning.parse(text)
            got = run(pool, x, pad_bank, padded, tok, exp, w)
            assert np.array_equal(got, want), f"{isa} stage_max={cap} {text}"
            half = padded.rows(7, 30)
            assert np.array_equal(run(pool, x, pad_bank, half, tok, exp, w),
                                  run(pool, x, plain_bank, plain.rows(7, 30), tok, exp, w)), f"{isa} {text}"
    assert_close(want, reference(x, w3, tok, exp, w), rtol_for(isa, "bf16"), isa)


@pytest.mark.parametrize("isa", ISAS)
def test_long_partial_rows_with_many_inputs(isa):
    """Down rows long enough for several K-chunks of the avx2/avx512 bf16 kernels, more than 16
    inputs on one expert, a split at an odd row: the two shares sum to the whole expert under
    the tunings that change the down blocking and prefetch."""
    D, I, T, lo = 40, 1100, 21, 357
    bank, layout, _, w3 = make_bank(3, D, I, "bf16", seed=9)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(9))
    tok = np.concatenate([np.arange(T), np.arange(3), [5]]).astype(np.int32)
    exp = np.array([0] * T + [1] * 3 + [2], np.int32)
    w = np.random.default_rng(9).random(len(tok), dtype=np.float32)
    pool = kernels.CpuExpertPool(2, isa=isa)
    full = run(pool, x, bank, layout, tok, exp, w)
    for text in TUNINGS[:2] + TUNINGS[5:6]:
        pool.tuning = kernels.KernelTuning.parse(text)
        a = run(pool, x, bank, layout.rows(0, lo), tok, exp, w)
        b = run(pool, x, bank, layout.rows(lo, I), tok, exp, w)
        assert_close(a + b, full, 1e-4, f"{isa} {text}")
        assert_close(b, reference(x, sliced(w3, lo, I), tok, exp, w), rtol_for(isa, "bf16"), f"{isa} {text}")


def test_bad_ranges_and_strides_raise():
    bank, layout, _, _ = make_bank(3, 40, 24, "bf16")
    for lo, hi in ((-1, 4), (3, 3), (5, 2), (0, 25), (24, 25), (1.5, 4), (0, "8")):
        with pytest.raises(kernels.KernelArgumentError, match="rows"):
            layout.rows(lo, hi)
    with pytest.raises(kernels.KernelArgumentError, match="rows"):
        layout.rows(2, 10).rows(0, 9)  # a partial layout's own I bounds its ranges
    args = (layout.slot_stride, "bf16", 40, 24, layout.offset_gate, layout.offset_up, layout.offset_down)
    for ld in (23, -5, 2.5):
        with pytest.raises(kernels.KernelArgumentError, match="down_ld"):
            kernels.ExpertLayout(*args, ld)
    room = (layout.slot_stride - layout.offset_down) // 2  # bf16 elements after offset_down
    widest = (room - 24) // 39  # the largest stride whose 40th row still ends in the slot
    assert kernels.ExpertLayout(*args, widest).down_ld == widest
    with pytest.raises(kernels.KernelArgumentError, match="slot_stride"):
        kernels.ExpertLayout(*args, widest + 1)
    for ld in (None, 0, 24):
        assert kernels.ExpertLayout(*args, ld) == layout
    with pytest.raises(kernels.KernelArgumentError, match="aligned"):
        kernels.ExpertLayout(layout.slot_stride, "bf16", 40, 24, 0, 1, layout.offset_down)
    # The native check behind the Python one: a stride below I never reaches the kernel.
    bad = layout.rows(0, 24)
    object.__setattr__(bad, "down_ld", 23)
    x = np.ones((1, 40), np.float32)
    with pytest.raises(kernels.KernelArgumentError, match="down_ld"):
        kernels.CpuExpertPool(1).run(x, bank, bad, np.zeros(1, np.int32), np.zeros(1, np.int32),
                                     np.ones(1, np.float32), np.zeros((1, 40), np.float32))


def test_serve_runs_partial_layouts():
    """The native server takes each layer's layout, partial ones included: a step of two layers
    (rows [lo, I) of one bank, a padded-down bank's rows [0, hi)) writes the partials the
    kernel gives for the same routes."""
    pool = kernels.CpuExpertPool(2, spin_us=0)
    D, I, K, E = 70, 45, 4, 6
    bank, layout, _, w3 = make_bank(E, D, I, "bf16", seed=12)
    pad_bank, padded = bank_of(w3, "bf16", down_ld=I + 5, fill=float("nan"))
    layers = [(bank, layout.rows(13, I), Mailbox(K, D, "cpu")),
              (pad_bank, padded.rows(0, 29), Mailbox(K, D, "cpu"))]
    table = pool.serve_table([(b, lay, "silu", box) for b, lay, box in layers])
    rng = np.random.default_rng(12)
    ids = [torch.from_numpy(rng.choice(E, size=K, replace=False)) for _ in layers]
    for (_, _, box), i in zip(layers, ids):
        box.ids.copy_(i)
        box.ids[1] = -1  # one route not the CPU's
        box.w.copy_(torch.from_numpy(rng.random(K).astype(np.float32)))
        box.x.copy_(torch.randn(D))
        box.partial.fill_(float("nan"))
    log = []

    def gpu():
        for _, _, box in layers:
            box.flags[0] = 1
            while int(box.flags[1]) != 1:
                pass
            log.append(box.partial.clone())
            box.flags[1] = 0
    t = threading.Thread(target=gpu)
    t.start()
    pool.serve(table, timeout_s=30)
    t.join()
    assert len(log) == 2
    for (b, lay, box), partial in zip(layers, log):
        on = box.ids >= 0
        exp = box.ids[on].numpy().astype(np.int32)
        want = run(pool, box.x[None], b, lay, np.zeros(len(exp), np.int32), exp, box.w[on].numpy())
        assert torch.isfinite(partial).all()
        torch.testing.assert_close(partial, torch.from_numpy(want[0]), rtol=1e-5, atol=1e-6)
        lo, hi = (13, I) if b is bank else (0, 29)
        ref = reference(box.x[None], sliced(w3, lo, hi), np.zeros(len(exp), np.int64), exp, box.w[on].numpy())
        assert_close(partial[None], ref, rtol_for(pool.isa, "bf16"), f"serve rows [{lo}, {hi})")
