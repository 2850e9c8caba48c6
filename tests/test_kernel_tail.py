"""The kernel's tail knob (KernelTuning.tail, ft_tune.tail in cython/ffn_impl.c): small work items
at the end of each phase change the item partition, never the results (bit for bit against
tail=0, and torch within test_kernels' tolerance); the clamp paths (few rows, items already
small, direct mode); its parsing. Banks, reference and pools are tests/test_kernels.py's."""
import numpy as np
import pytest
import torch

from freetoken import kernels
from freetoken.errors import ConfigError
from test_kernels import ISAS, assert_close, make_bank, pools, reference, rtol_for  # noqa: F401 (a fixture)

TAILS = (1, 2, 8)


def expert_routes(T, U, E, rng):
    """Routes of T tokens over exactly U distinct experts out of E: token 0 takes all of them,
    the others a random non-empty subset each (so the experts get different input counts)."""
    chosen = rng.choice(E, size=U, replace=False)
    tok, exp = [0] * U, list(chosen)
    for t in range(1, T):
        sub = rng.choice(chosen, size=int(rng.integers(1, U + 1)), replace=False)
        tok += [t] * len(sub)
        exp += list(sub)
    w = rng.random(len(tok), dtype=np.float32)
    return np.array(tok, np.int32), np.array(exp, np.int32), w


def run_traced(pool, text, x, bank, layout, tok, exp, w, poison=None):
    """Run with tuning `text`; returns (out, trace info). `poison`: first run that x with tail=0
    (every row of the pool's scratch rewritten with other values), so a row the tail's items
    missed cannot keep the value an earlier run left."""
    T, D = x.shape
    if poison is not None:
        pool.tuning = kernels.KernelTuning.parse(text + ",tail=0")
        pool.run(poison, bank, layout, tok, exp, w, np.zeros((T, D), np.float32))
    pool.tuning = kernels.KernelTuning.parse(text)
    pool.set_trace(4096)
    try:
        out = pool.run(x, bank, layout, tok, exp, w, np.zeros((T, D), np.float32))
        info = pool.last_trace()
    finally:
        pool.set_trace(0)
    assert len(info["records"]) == info["items"]
    return out, info


# D, I not multiples of 4 / 16 (the last small item and block shorter; passes of 1..4 rows);
# item_kb 16 makes G items of 12 rows and D blocks of 48 rows, so the tail mixes big and small
# items, and at tail 8 the D blocks are all small.
D_, I_, E_ = 263, 150, 6


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [2, 3])
def test_tail_is_bit_identical_and_matches_torch(pools, isa, threads):
    pool = pools(threads, isa)
    bank, layout, _, w3 = make_bank(E_, D_, I_, "bf16", seed=threads)
    rng = np.random.default_rng(threads)
    for U in (1, 2, 5):
        for T in (1, 3):
            x = torch.randn(T, D_, generator=torch.Generator().manual_seed(10 * U + T))
            tok, exp, w = expert_routes(T, U, E_, rng)
            xn, poison = x.numpy(), (-1.7 * x).numpy()
            for base in ("item_kb=16,help=0", "item_kb=16,help=1,rows=4,down_rows=2"):
                want, info0 = run_traced(pool, base, xn, bank, layout, tok, exp, w)
                what = f"{isa} threads={threads} U={U} T={T} {base}"
                assert_close(want, reference(x, w3, tok, exp, w), rtol_for(isa, "bf16"), what)
                for k in TAILS:
                    got, info = run_traced(pool, f"{base},tail={k}", xn, bank, layout, tok, exp, w, poison)
                    assert np.array_equal(got, want), f"{what} tail={k} differs from tail=0"
                    assert info["items"] > info0["items"], f"{what} tail={k} made no small items"


def test_tail_item_counts_of_one_expert(pools):
    """One expert, D=263, I=150, bf16, item_kb 16: G items of 12 rows, D blocks of 48; 2 workers
    and no helper, so tail=k wants 2k small items per phase. Without a tail 13 G items (12 x 12
    + 6) and 6 D blocks (5 x 48 + 23); tail=1: G 11 x 12 (132) + 5 small (4, 4, 4, 4, 2), D
    4 x 48 (192) + 5 small (4 x 16 + 7); tail=8 (16 wanted): G 7 x 12 (84) + 17 small (16 x 4
    + 2), and D more rows wanted than there are: 17 small blocks (16 x 16 + 7)."""
    pool = pools(2, ISAS[0])
    bank, layout, _, _ = make_bank(2, D_, I_, "bf16", seed=1)
    x = np.random.default_rng(0).standard_normal((1, D_)).astype(np.float32)
    one = (np.zeros(1, np.int32), np.ones(1, np.int32), np.ones(1, np.float32))
    counts = {}
    for k in (0, 1, 8):
        _, info = run_traced(pool, f"item_kb=16,help=0,tail={k}", x, bank, layout, *one)
        counts[k] = (info["g_items"], info["items"] - info["g_items"])
    assert counts == {0: (13, 6), 1: (16, 9), 8: (24, 17)}, counts


@pytest.mark.parametrize("isa", ISAS)
def test_tail_clamps_where_rows_are_few(pools, isa):
    """I=24 (3 G items of 8 rows without a tail): tail 1 keeps some big items, tail 8 makes all
    of them small; both give tail=0's bits and torch's values."""
    pool = pools(2, isa)
    D, I = 256, 24
    bank, layout, _, w3 = make_bank(4, D, I, "bf16", seed=2)
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(3))
    tok, exp, w = expert_routes(3, 2, 4, np.random.default_rng(4))
    want, info0 = run_traced(pool, "item_kb=8,help=0", x.numpy(), bank, layout, tok, exp, w)
    assert_close(want, reference(x, w3, tok, exp, w), rtol_for(isa, "bf16"), f"{isa} I=24")
    assert info0["g_items"] == 2 * 3
    g_items = []
    for k in (1, 8):
        got, info = run_traced(pool, f"item_kb=8,help=0,tail={k}", x.numpy(), bank, layout, tok, exp, w,
                               poison=(-x).numpy())
        assert np.array_equal(got, want), f"{isa} I=24 tail={k}"
        g_items.append(info["g_items"])
    assert g_items == [2 * 4, 2 * 6], g_items  # per expert, tail 1: 2 x 8 + 2 x 4 rows; tail 8: 6 x 4


@pytest.mark.parametrize("isa", ISAS)
def test_tail_changes_nothing_where_items_are_already_small(pools, isa):
    """item_kb 4 with D=600, I=72: G items of 4 rows and D blocks of 16 rows already, the tail's
    sizes: the same items and the same bits."""
    pool = pools(3, isa)
    D, I = 600, 72
    bank, layout, _, _ = make_bank(3, D, I, "bf16", seed=5)
    x = np.random.default_rng(6).standard_normal((2, D)).astype(np.float32)
    tok, exp, w = expert_routes(2, 2, 3, np.random.default_rng(7))
    want, info0 = run_traced(pool, "item_kb=4", x, bank, layout, tok, exp, w)
    got, info = run_traced(pool, "item_kb=4,tail=8", x, bank, layout, tok, exp, w, poison=-x)
    assert np.array_equal(got, want)
    assert (info["g_items"], info["items"]) == (info0["g_items"], info0["items"]) == (2 * 18, 2 * 18 + 2 * 38)


def test_direct_mode_ignores_the_tail(pools, monkeypatch):
    """Large prefill calls (direct mode) keep their items: same count, same bits."""
    monkeypatch.setattr(kernels, "STAGE_MAX_BYTES", 0)
    pool = pools(2, ISAS[-1])
    bank, layout, _, w3 = make_bank(E_, D_, I_, "bf16", seed=8)
    x = torch.randn(3, D_, generator=torch.Generator().manual_seed(9))
    tok, exp, w = expert_routes(3, 3, E_, np.random.default_rng(10))
    want, info0 = run_traced(pool, "item_kb=16", x.numpy(), bank, layout, tok, exp, w)
    got, info = run_traced(pool, "item_kb=16,tail=4", x.numpy(), bank, layout, tok, exp, w, poison=(-x).numpy())
    assert not info["staged"] and info["items"] == info0["items"]
    assert np.array_equal(got, want)


def test_tail_parse_validation_and_native_args():
    t = kernels.KernelTuning.parse("tail=2,item_kb=96")
    assert t.tail == 2 and kernels.KernelTuning().tail == 0
    assert kernels.KernelTuning.parse(str(t)) == t and "tail=2" in str(t)
    assert t.native_args(2, "generic", "bf16")[6] == 2 and len(t.native_args(2, "generic", "bf16")) == 7
    assert kernels.KernelTuning().native_args(1, "generic", "bf16")[6] == 0
    assert t.resolved("generic").tail == 2
    assert kernels.KernelTuning.parse("tail=64").tail == 64
    for bad in ("tail=-1", "tail=65", "tail=x", "tail=auto"):
        with pytest.raises(ConfigError, match="kernel tuning"):
            kernels.KernelTuning.parse(bad)


def test_tail_reaches_the_serve_table_and_the_environment(monkeypatch):
    """FREETOKEN_KERNEL_TUNE=tail=... sets the pool's tuning; the serve table takes the longer
    native tuple (kernels.CpuExpertPool.serve_table passes native_args' tuple whole)."""
    monkeypatch.setenv(kernels.TUNE_ENV, "tail=3")
    pool = kernels.CpuExpertPool(1)
    assert pool.tuning.tail == 3
    bank, _, _, _ = make_bank(1, 64, 32, "bf16")
    entry = (0, 1, 0, 64, 32, 0, bank, bank.nbytes, 0, 0, 0, 0,
             tuple(pool.tuning.native_args(1, "generic", "bf16")), 0, 0, 0, 0, 0, 0, 1)
    assert kernels._native.ServeTable([entry]).n == 1
