"""The native quantizer (cython/quant.pyx, freetoken._quant) against ftw/quant.py's numpy
reference, byte for byte: random data over many scales, zero and negative-zero blocks, exact
rounding ties and their neighbours (q8_0's halves, q4_0's floors, e2m1's and e4m3's midpoints),
fp16 scale boundaries, subnormal and huge magnitudes, odd row counts. Where the native code
defers (NaN / inf; blocks whose reference bytes are numpy's casts of inf / NaN) it must say
None and quantize() must still give the reference's answer. Without the build, quantize() is
the reference."""
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest

from ftw import quant as Q

N = Q._native
TYPES = ("q8_0", "q4_0", "mxfp4", "nvfp4")
BLOCK = {"q8_0": 32, "q4_0": 32, "mxfp4": 32, "nvfp4": 16}
native_only = pytest.mark.skipif(N is None, reason="freetoken._quant is not built")


def _first_bad_block(quant: str, x: np.ndarray, got: bytes, want: bytes) -> str:
    """Where got and want first differ: the block (its values) whose element bytes or scale
    differ, or the padding / nvfp4's g."""
    r = Q.regions(quant, x.shape)
    a, b = np.frombuffer(got, np.uint8), np.frombuffer(want, np.uint8)
    at = int(np.argmax(a != b))
    nblocks = x.size // BLOCK[quant]
    scale_bytes = Q.quant_type(quant).scale_bytes
    if at < r.qs_nbytes:
        blk = at // (r.qs_nbytes // nblocks)
    elif r.scales_offset <= at < r.scales_offset + nblocks * scale_bytes:
        blk = (at - r.scales_offset) // scale_bytes
    else:
        return f"{quant} {x.shape}: byte {at} (padding or g) is {a[at]}, the reference's {b[at]}"
    return (f"{quant} {x.shape}: block {blk} first differs at byte {at} ({a[at]} vs the "
            f"reference's {b[at]}); its values {x.reshape(-1, BLOCK[quant])[blk].tolist()}")


def _same(x, quant: str) -> None:
    """The native path answers (not None) and equals the reference; quantize() too."""
    x = np.asarray(x, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference's fp16 overflow of huge scales
        want = Q.reference_quantize(x, quant)
    got = N.quantize(np.ascontiguousarray(x), quant, Q.regions(quant, x.shape))
    assert got is not None, f"{quant} {x.shape}: the native path deferred"
    assert got == want, _first_bad_block(quant, x, got, want)
    assert Q.quantize(x, quant) == want


def _rows(blocks: np.ndarray, quant: str) -> np.ndarray:
    """[n, block] -> [ceil(n / 3), 3 blocks]: zero blocks fill the last row."""
    b = BLOCK[quant]
    blocks = np.concatenate([blocks, np.zeros((-len(blocks) % 3, b), np.float32)])
    return blocks.reshape(-1, 3 * b)


def _blocks(values, quant: str, head) -> np.ndarray:
    """values in blocks that each start with `head` (which sets the block's scale), the last
    padded with zeros, three blocks a row."""
    per = BLOCK[quant] - 1
    values = np.asarray(values, np.float32)
    v = np.concatenate([values, np.zeros(-len(values) % per, np.float32)]).reshape(-1, per)
    return _rows(np.concatenate([np.full((len(v), 1), head, np.float32), v], axis=1), quant)


def _around(points, ulps: int) -> np.ndarray:
    """Every fp32 within `ulps` steps of each point (both signs)."""
    p = np.asarray(points, np.float32).view(np.int32)
    steps = np.arange(-ulps, ulps + 1, dtype=np.int32)
    out = (p[:, None] + steps[None, :]).reshape(-1).view(np.float32)
    return np.concatenate([out, -out])


# --- random data -------------------------------------------------------------------------------
@native_only
@pytest.mark.parametrize("quant", TYPES)
@pytest.mark.parametrize("scale", [1e-35, 1e-12, 1e-3, 0.02, 1.0, 3e4, 1e20, 1e36])
def test_random_normal(quant, scale):
    rng = np.random.default_rng([TYPES.index(quant), int(np.log10(scale) + 50)])
    for rows, cols in [(1, BLOCK[quant]), (3, 64), (97, 256), (8, 2048)]:
        _same(rng.standard_normal((rows, cols)) * scale, quant)


@native_only
@pytest.mark.parametrize("quant", TYPES)
def test_block_scales_over_the_whole_range(quant):
    """Each block its own magnitude, 1e-36 .. 1e38: the scales' fp16 / e8m0 / e4m3 rounding at
    every exponent, subnormal and overflowing fp16 scales included."""
    rng = np.random.default_rng(3)
    n = 4096
    mag = 10.0 ** rng.uniform(-36, 38, size=(n, 1))
    x = (rng.standard_normal((n, BLOCK[quant])) * mag).astype(np.float32)
    _same(x.reshape(64, -1), quant)
    _same(np.abs(x).reshape(64, -1), quant)  # the q4_0 scale's sign from the largest


@native_only
@pytest.mark.parametrize("quant", TYPES)
def test_subnormal_and_tiny_values(quant):
    rng = np.random.default_rng(4)
    sub = (rng.integers(1, 1 << 23, size=4096, dtype=np.uint32)).view(np.float32)  # subnormals
    sub = sub * rng.choice([-1, 1], size=sub.size).astype(np.float32)
    if quant in ("mxfp4", "nvfp4"):  # their scales reach down to the subnormals
        _same(sub.reshape(-1, 256), quant)
    # tiny elements under a normal scale: they round to zero codes, their sign dropped
    _same(_blocks(sub, quant, 1.0), quant)


@native_only
@pytest.mark.parametrize("quant", TYPES)
def test_huge_values(quant):
    big = np.float32(3.4e38)
    x = np.array([[big, -big, 1e38, 1.0, -1e-30, 0.0, 3e38, -2e38] * (BLOCK[quant] // 8)] * 3,
                 np.float32)
    _same(x, quant)
    _same(-x, quant)


# --- zeros and signs ---------------------------------------------------------------------------
@native_only
@pytest.mark.parametrize("quant", TYPES)
def test_zero_blocks(quant):
    b = BLOCK[quant]
    pz, nz = np.zeros(b, np.float32), np.full(b, -0.0, np.float32)
    mixed_p = np.where(np.arange(b) % 2 == 0, pz, nz)  # first +0: q4_0's d = -0.0
    mixed_n = np.where(np.arange(b) % 2 == 1, pz, nz)  # first -0: q4_0's d = +0.0
    data = np.random.default_rng(5).standard_normal(b).astype(np.float32)
    x = np.stack([pz, nz, mixed_p, mixed_n, data, pz]).reshape(3, -1)
    _same(x, quant)
    _same(np.zeros((5, 4 * b), np.float32), quant)
    _same(np.full((1, b), -0.0, np.float32), quant)


@native_only
def test_q4_0_scale_is_the_first_of_equal_magnitudes():
    """m = x[argmax |x|], the first: +a before -a and -a before +a give opposite scales."""
    for a in (1.0, 3.5e-30, 7e30):
        x = np.zeros((2, 32), np.float32)
        x[0, 3], x[0, 20] = a, -a
        x[1, 3], x[1, 20] = -a, a
        _same(x, "q4_0")


# --- rounding ties -----------------------------------------------------------------------------
@native_only
def test_q8_0_halves():
    """amax 127 gives d = 1 and 1 / d = 1, so v = x: every k + 1/2 (rounded away from zero)
    and its fp32 neighbours."""
    halves = np.arange(-127, 127, dtype=np.float32) + np.float32(0.5)
    _same(_blocks(_around(halves, 3), "q8_0", 127.0), "q8_0")
    # v = x * (1/d) in fp32: ties of the product, d = amax / 127 not a power of two
    for amax in (100.0, 3.0, 1e-20, 5e25):
        d = np.float32(amax) / np.float32(127)
        inv = np.float32(1) / d
        ks = np.arange(0, 127, dtype=np.float32) + np.float32(0.5)
        x = _around(ks / inv, 2)  # values whose product lands on or next to k + 1/2
        _same(_blocks(x[np.abs(x) <= amax], "q8_0", amax), "q8_0")


@native_only
def test_q4_0_floor_edges():
    """m = -8 gives d = 1, 1 / d = 1, v = x + 8.5 in fp32: the floor's integer edges, the
    rounding of the + 8.5 (tiny x lands on 8.5 itself), the clamp at 15."""
    edges = np.arange(-8, 9, dtype=np.float32) - np.float32(0.5)  # v = k
    vals = np.concatenate([_around(edges, 4), _around([1e-8, 3e-7, 4.7e-7, 1e-30], 2)])
    vals = vals[np.abs(vals) <= 8]
    _same(_blocks(vals, "q4_0", -8.0), "q4_0")
    _same(_blocks(np.float32([8.0, 7.5, 7.49, -7.9]), "q4_0", 8.0), "q4_0")  # d = -1: clamp
    # d no power of two: x * inv rounds to fp32 first, then + 8.5 rounds again (never fused)
    for m in (-7.0, -3.0, 13.0, -7e-20, 9e25):
        inv = np.float32(1) / (np.float32(m) / np.float32(-8))
        x = _around((np.arange(0, 17, dtype=np.float32) - np.float32(8.5)) / inv, 3)
        _same(_blocks(x[np.abs(x) < abs(m)], "q4_0", m), "q4_0")


E2M1_MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


@native_only
def test_mxfp4_e2m1_ties():
    """A block holding 6 gets scale 2^0, so the codes are e2m1 of x itself: every midpoint
    (ties to the even code), every grid value, their neighbours, and beyond 6 (saturating)."""
    pts = E2M1_MIDPOINTS + E2M1_VALUES[1:] + [1e-30, 2.0 ** -126]
    vals = _around(pts, 5)
    _same(_blocks(vals[np.abs(vals) <= 6], "mxfp4", 6.0), "mxfp4")
    tiny = np.float32(2.0 ** -40)  # the same ties under the scale 2^-40
    _same(_blocks(np.float32(E2M1_MIDPOINTS) * tiny, "mxfp4", 6 * tiny), "mxfp4")
    # the e8m0 boundary: amax = 6 * 2^e (mant 0.75) and just above it
    for amax in _around([6.0, 3.0, 6 * 2.0 ** -100, 6 * 2.0 ** 100, 6 * 2.0 ** -130], 2):
        if amax > 0:
            _same(_blocks(np.float32([amax / 3, -amax / 7]), "mxfp4", amax), "mxfp4")


@native_only
def test_nvfp4_ties():
    """tamax = 2688 gives g = 1 and 6g = 6: a block whose largest is 6t has the e4m3 scale of t
    (the e4m3 midpoints, ties to the even code, and their neighbours); with denom = the scale's
    value, elements midpoint * denom are e2m1 ties."""
    grid = Q.E4M3_GRID.astype(np.float32)
    mids = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)
    ts = _around(np.concatenate([mids, grid[1:], [448.0, 460.0, 479.0, 480.0, 2.0 ** -10]]), 1)
    ts = ts[(ts > 0) & (ts <= 448)]
    blocks = [np.float32([2688.0] + [0.0] * 15)]  # tamax
    for t in ts:
        amax = np.float32(6) * t  # exact for the midpoints (few bits); near them otherwise
        denom = grid[Q.e4m3_encode(amax / np.float32(6))]
        els = np.float32(E2M1_MIDPOINTS + E2M1_VALUES[1:]) * denom
        els = np.concatenate([els, -els])[:15] if denom > 0 else np.zeros(15, np.float32)
        blocks.append(np.concatenate([[amax], np.where(np.abs(els) <= amax, els, 0)]))
    _same(_rows(np.array(blocks, np.float32), "nvfp4"), "nvfp4")


@native_only
def test_fp16_scale_boundaries():
    """q8_0 / q4_0 store d in fp16: amax near 127 (or 8) times the fp16 rounding edges (the
    largest finite half 65504, its overflow edge 65520, the smallest normal 2^-14, the
    subnormal steps down to 2^-25) and their neighbours."""
    edges = [65504.0, 65520.0, 65536.0, 2.0 ** -14, 2.0 ** -14 * (1 - 2.0 ** -11), 2.0 ** -24,
             2.0 ** -25, 3 * 2.0 ** -26, 1.5 * 2.0 ** -24, 1.0 + 2.0 ** -11, 2049.0]
    for quant, k in (("q8_0", 127.0), ("q4_0", 8.0)):
        heads = _around(np.float32(edges) * np.float32(k), 24)  # q4_0: d = head / -8
        blocks = np.zeros((len(heads), 32), np.float32)
        blocks[:, 0], blocks[:, 1] = heads, heads / np.float32(5)
        _same(_rows(blocks, quant), quant)


# --- shapes, layouts and the deferring cases ------------------------------------------------------
@native_only
@pytest.mark.parametrize("quant", TYPES)
def test_odd_rows_and_layouts(quant):
    rng = np.random.default_rng(6)
    b = BLOCK[quant]
    for rows, cols in [(1, b), (5, b), (7, 3 * b), (33, 5 * b), (1, 4096)]:
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        _same(x, quant)
        want = Q.reference_quantize(x, quant)
        assert Q.quantize(x.astype(np.float64), quant) == want  # converted like the reference
        assert Q.quantize(np.asfortranarray(x), quant) == want  # not C-contiguous
        raw = np.frombuffer(b"\0" + x.tobytes(), np.float32, offset=1).reshape(x.shape)
        assert Q.quantize(raw, quant) == want  # unaligned


@native_only
@pytest.mark.parametrize("quant", TYPES)
def test_non_finite_defers_and_raises(quant):
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones((3, 4 * BLOCK[quant]), np.float32)
        x[2, 5] = bad
        assert N.quantize(x, quant, Q.regions(quant, x.shape)) is None
        with pytest.raises(ValueError, match="NaN or inf"):
            Q.quantize(x, quant)


@native_only
@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_overflowing_reciprocal_defers(quant):
    """amax below ~1e-37: 1 / d overflows to inf, and the reference's bytes are numpy's casts
    of inf and NaN. The native path says None; quantize() gives the reference's bytes."""
    x = np.random.default_rng(8).standard_normal((4, 64)).astype(np.float32)
    x[1, :32] *= np.float32(1e-39)
    x[1, 3] = 0.0
    assert N.quantize(x, quant, Q.regions(quant, x.shape)) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert Q.quantize(x, quant) == Q.reference_quantize(x, quant)


@native_only
def test_nvfp4_zero_tensor_scale_defers():
    x = np.zeros((2, 32), np.float32)
    x[0, 1] = 1e-42  # tamax / 2688 rounds to g = 0
    assert N.quantize(x, "nvfp4", Q.regions("nvfp4", x.shape)) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert Q.quantize(x, "nvfp4") == Q.reference_quantize(x, "nvfp4")
    _same(np.zeros((2, 32), np.float32), "nvfp4")  # tamax 0: g = 1, natively


@native_only
def test_regions_must_fit():
    x = np.ones((2, 64), np.float32)
    with pytest.raises(ValueError, match="do not fit"):
        N.quantize(x, "q8_0", Q.regions("q4_0", x.shape))
    with pytest.raises(ValueError, match="do not fit"):
        N.quantize(x, "q8_0", Q.regions("q8_0", (4, 32)))
    with pytest.raises(ValueError, match="fp32 2-D"):
        N.quantize(x.astype(np.float64), "q8_0", Q.regions("q8_0", x.shape))


@native_only
def test_threads_agree():
    """Several threads at once (the GIL is released inside): each gets the reference's bytes."""
    rng = np.random.default_rng(9)
    xs = [rng.standard_normal((64, 2048)).astype(np.float32) for _ in range(4)]
    want = {(i, q): Q.reference_quantize(x, q) for i, x in enumerate(xs) for q in TYPES}
    got = {}

    def work(i):
        for _ in range(3):
            for q in TYPES:
                got[(i, q)] = Q.quantize(xs[i], q)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


# --- without the build ---------------------------------------------------------------------------
def test_fallback_is_the_reference(monkeypatch):
    """With no native module, quantize() runs the numpy bodies (and only them)."""
    monkeypatch.setattr(Q, "_native", None)
    calls = []
    for q in TYPES:
        body = Q._QUANTIZE[q]
        monkeypatch.setitem(Q._QUANTIZE, q,
                            lambda x, r, body=body, q=q: calls.append(q) or body(x, r))
    x = np.random.default_rng(10).standard_normal((3, 64)).astype(np.float32)
    for q in TYPES:
        assert Q.quantize(x, q) == Q.reference_quantize(x, q)
    assert calls == [q for q in TYPES for _ in range(2)]


def test_ftw_imports_without_the_build():
    """freetoken._quant unimportable: ftw.quant still imports and quantizes (numpy)."""
    code = ("import sys; sys.modules['freetoken._quant'] = None\n"
            "import numpy as np; from ftw import quant as Q\n"
            "assert Q._native is None\n"
            "x = np.arange(64, dtype=np.float32).reshape(2, 32)\n"
            "assert Q.quantize(x, 'q4_0') == Q._QUANTIZE['q4_0'](x, Q.regions('q4_0', x.shape))\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=str(Q.__file__).rsplit("/ftw/", 1)[0])
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@native_only
def test_native_is_used_where_built():
    assert set(N.QUANTS) == set(TYPES)
    x = np.ones((1, 32), np.float32)
    assert N.quantize(x, "q8_0", Q.regions("q8_0", x.shape)) == Q.quantize(x, "q8_0")
