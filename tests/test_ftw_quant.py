"""ftw/quant.py against SPEC.md §9: golden bytes worked by hand from the SPEC, the e2m1 / e4m3 /
e8m0 encodings exhaustively against their definitions, §9.4's error bounds on random data, shapes
refused, and q8_0 / q4_0 / mxfp4 against GGUF's block definitions (written out here, not taken
from ftw/quant.py)."""
import json
import math
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

import ftw
from ftw import constants as C
from ftw import errors as E
from ftw import quant as Q
from ftw import writer
from ftw.errors import QuantShapeError, UnknownQuantError

SPEC = Path(ftw.__file__).parent / "SPEC.md"
TYPES = tuple(C.QUANT_TYPES)


def _hex(s: str) -> bytes:
    return bytes.fromhex(s.replace(" ", ""))


def _pad_to(b: bytes, n: int) -> bytes:
    return b + bytes(n - len(b))


# --- SPEC.md vs constants ----------------------------------------------------------------------
def test_spec_tables_match_constants():
    text = SPEC.read_text().split("## §9 Quantized")[1].split("## Version history")[0]
    types = re.findall(r"^\| `(\w+)` \| (\d+) x (\d+) \| (\w+) \| (\d+) \| ([^|]+) \| ([^|]+) \|", text, re.M)
    assert {t[0] for t in types} == set(C.QUANT_TYPES)
    for name, br, bc, _, bits, _, tensor_scale in types:
        q = C.QUANT_TYPES[name]
        assert (q.block_rows, q.block_cols, q.bits) == (int(br), int(bc), int(bits))
        assert q.tensor_scale_bytes == (4 if "fp32" in tensor_scale else 0)
    scale_bytes = {"fp16": 2, "fp32": 4, "uint8 (e8m0)": 1, "uint8 (e4m3)": 1}
    layout = re.findall(r"^\| `(\w+)` \| rows \* cols[^|]*\| ([^|]+?) \| `\[([^]]+)\]` \|", text, re.M)
    assert {row[0] for row in layout} == set(C.QUANT_TYPES)
    for name, scale_t, _ in layout:
        assert C.QUANT_TYPES[name].scale_bytes == scale_bytes[scale_t]
    assert C.QUANT_TYPES["fp8_e4m3"].partial and not any(
        q.partial for q in C.QUANT_TYPES.values() if q.name != "fp8_e4m3")


def test_spec_worked_examples():
    r = Q.regions("q8_0", (2, 64))
    assert (r.qs_nbytes, r.scales_offset, r.scales_shape, r.nbytes) == (128, 128, (2, 2), 136)
    r = Q.regions("nvfp4", (1, 16))
    assert (r.qs_nbytes, r.scales_offset, r.tensor_scale_offset, r.nbytes) == (8, 64, 128, 132)


# --- golden bytes, worked by hand from SPEC.md §9.2 / §9.4 --------------------------------------
def _golden(quant, x, want: bytes, decoded):
    x = np.asarray(x, dtype=np.float32)
    got = Q.quantize(x, quant)
    assert got.hex() == want.hex()
    assert Q.dequantize(got, quant, x.shape).tolist() == np.asarray(decoded, np.float32).tolist()


def test_golden_q8_0():
    # amax 127 -> d = 1 (fp16 00 3c); 127, -63.5 -> -64 (half away from zero), 2.5 -> 3, -0.5 -> -1
    x = np.zeros((1, 32)); x[0, :4] = [127, -63.5, 2.5, -0.5]
    want = _pad_to(_hex("7f c0 03 ff"), 64) + _hex("00 3c")
    _golden("q8_0", x, want, [[127, -64, 3, -1] + [0] * 28])


def test_golden_q4_0():
    # block 0: m = -8 -> d = 1; q = floor(x + 8.5): -8 -> 0, 7 -> 15, 2.4 -> 10, 0 -> 8, 3.5 -> 12, -0.5 -> 8
    # block 1: m = +4 -> d = -0.5 (fp16 00 b8), 1/d = -2: 4 -> 0, -4 -> min(15, 16) = 15 (clips), 0 -> 8
    x = np.zeros((1, 64)); x[0, [0, 1, 2, 16, 17]] = [-8, 7, 2.4, 3.5, -0.5]; x[0, [32, 33]] = [4, -4]
    qs = _hex("c0 8f 8a") + _hex("88") * 13 + _hex("80 8f") + _hex("88") * 14  # byte j: q[j] | q[j+16] << 4
    want = _pad_to(qs, 64) + _hex("00 3c 00 b8")
    row = [-8, 7, 2, 0] + [0] * 12 + [4, 0] + [0] * 14 + [4, -3.5] + [0] * 30
    _golden("q4_0", x, want, [row])


def test_golden_mxfp4():
    # block 0: amax 6 -> e = 0 (stored 7f); 6 -> 7, -0.5 -> 9, 1.25 -> 2 (tie to even), 5 -> 6 (tie),
    #          -0.2 -> 0 (zero is +0), 2.5 -> 4 (tie), 0.75 -> 2 (tie), -3 -> 13
    # block 1: amax 7 -> e = 1 (stored 80); 7/2 = 3.5 -> 6 (tie, value 4 * 2 = 8), -0.1 -> 0
    x = np.zeros((1, 64)); x[0, :8] = [6, -0.5, 1.25, 5, -0.2, 2.5, 0.75, -3]; x[0, 32:34] = [7, -0.1]
    qs = _pad_to(_hex("97 62 40 d2"), 16) + _hex("06")  # byte k: code[2k] | code[2k+1] << 4
    want = _pad_to(_pad_to(qs, 32), 64) + _hex("7f 80")
    row = [6, -0.5, 1, 4, 0, 2, 1, -3] + [0] * 24 + [8] + [0] * 31
    _golden("mxfp4", x, want, [row])


def test_golden_nvfp4():
    # tensor amax 2688 -> g = 2688 / (6 * 448) = 1
    # block 0: s = e4m3(2688 / 6 = 448) = 7e; /448: 6 -> 7, -1 -> a, 1.5 -> 3
    # block 1: s = e4m3(13 / 6 = 2.17) = 41 (2.25); /2.25: 13 -> 5.78 -> 7 (6), -1.125 -> -0.5 -> 9
    x = np.zeros((1, 32)); x[0, :3] = [2688, -448, 672]; x[0, 16:18] = [13, -1.125]
    qs = _hex("a7 03") + bytes(6) + _hex("97") + bytes(7)
    want = _pad_to(_pad_to(qs, 64) + _hex("7e 41"), 128) + _hex("00 00 80 3f")
    row = [2688, -448, 672] + [0] * 13 + [13.5, -1.125] + [0] * 14
    _golden("nvfp4", x, want, [row])


def test_golden_fp8_e4m3():
    # one partial 128 x 128 tile, amax 448 -> s = 1 (fp32 00 00 80 3f)
    # 448 -> 7e, -1 -> b8, 0.3 -> 2a (0.3125), 2.5 -> 42, -2^-10 -> 00 (tie with 2^-9: even, +0), 17 -> 58 (tie: 16)
    x = [[448, -1, 0.3], [2.5, -2.0 ** -10, 17]]
    want = _pad_to(_hex("7e b8 2a 42 00 58"), 64) + _hex("00 00 80 3f")
    _golden("fp8_e4m3", x, want, [[448, -1, 0.3125], [2.5, 0, 16]])


# --- encodings, exhaustively against their definitions (§9.1) -----------------------------------
def _e2m1_def(c):
    sign = -1.0 if c & 8 else 1.0
    e, m = (c >> 1) & 3, c & 1
    return sign * (m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))


def _e4m3_def(c):
    sign = -1.0 if c & 0x80 else 1.0
    e, m = (c >> 3) & 15, c & 7
    if e == 15 and m == 7:
        return math.nan
    return sign * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def _check_encoding(decode, encode, definition, ncodes, sign_bit, largest):
    codes = np.arange(ncodes)
    want = np.array([definition(c) for c in codes])
    np.testing.assert_array_equal(decode(codes), want.astype(np.float32))
    finite = [c for c in codes if not math.isnan(want[c])]
    back = encode(want[finite])
    assert back.tolist() == [0 if c == sign_bit else c for c in finite]  # -0 is written as +0
    mags = [c for c in finite if c < sign_bit]  # ascending magnitudes
    for lo, hi in zip(mags, mags[1:]):
        mid = (want[lo] + want[hi]) / 2
        even = lo if lo % 2 == 0 else hi
        for sign in (1, -1):
            signed = (lambda c: c | sign_bit if sign < 0 and c else c)
            assert encode([sign * mid]).tolist() == [signed(even)], (lo, hi)
            assert encode([sign * np.nextafter(mid, 0)]).tolist() == [signed(lo)]
            assert encode([sign * np.nextafter(mid, np.inf)]).tolist() == [signed(hi)]
    assert encode([largest * 1.5, -largest * 1e6]).tolist() == [mags[-1], mags[-1] | sign_bit]


def test_e2m1_exhaustive():
    _check_encoding(Q.e2m1_decode, Q.e2m1_encode, _e2m1_def, 16, 8, 6.0)
    assert [_e2m1_def(c) for c in range(8)] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_e4m3_exhaustive():
    _check_encoding(Q.e4m3_decode, Q.e4m3_encode, _e4m3_def, 256, 0x80, 448.0)
    assert _e4m3_def(0x7E) == 448 and _e4m3_def(0x01) == 2.0 ** -9


def test_e4m3_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(20000) * np.exp(rng.uniform(-12, 6, 20000))).astype(np.float32)
    x = np.clip(x, -448, 448)
    ref = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    ref = np.where(ref == 0x80, 0, ref)  # torch keeps -0; §9.4 writes +0
    np.testing.assert_array_equal(Q.e4m3_encode(x), ref)


def test_e8m0_exhaustive():
    got = Q.e8m0_decode(np.arange(256))
    for e in range(255):
        assert float(got[e]) == 2.0 ** (e - 127)
    assert math.isnan(got[255])


# --- error bounds (§9.4) on random data ---------------------------------------------------------
def _data(rng, rows, cols):
    """Gaussian rows with per-row scales over 8 decades and a few outliers."""
    x = rng.standard_normal((rows, cols)) * np.exp(rng.uniform(-9, 9, (rows, 1)))
    x[rng.random((rows, cols)) < 0.01] *= 20
    return x.astype(np.float32)


def _block_amax(x, size):
    return np.repeat(np.abs(x.reshape(x.shape[0], -1, size)).max(-1), size, axis=1)


def _bound(quant, x, data):
    if quant == "q8_0":
        return _block_amax(x, 32) / 127 * (0.5 + 127 * 2.0 ** -11) + 127 * 2.0 ** -25
    if quant == "q4_0":
        return _block_amax(x, 32) / 8 * (1 + 8 * 2.0 ** -11) + 8 * 2.0 ** -25
    if quant == "mxfp4":
        return _block_amax(x, 32) / 3
    if quant == "nvfp4":
        g = np.frombuffer(data[-4:], "<f4")[0]
        return _block_amax(x, 16) / 6 * (1 + 2.0 ** -4) + 6 * 2.0 ** -10 * g
    r = Q.regions(quant, x.shape)
    s = np.frombuffer(data[r.scales_offset:r.nbytes], "<f4").reshape(r.scales_shape)
    s = np.repeat(np.repeat(s, 128, 0), 128, 1)[:x.shape[0], :x.shape[1]]
    return np.abs(x) * 2.0 ** -4 + 2.0 ** -10 * s


@pytest.mark.parametrize("quant", TYPES)
def test_error_bound(quant):
    rng = np.random.default_rng(7)
    for shape in [(33, 256), (3, 4096)] + ([(130, 200)] if quant == "fp8_e4m3" else []):
        x = _data(rng, *shape)
        data = Q.quantize(x, quant)
        assert len(data) == Q.quant_nbytes(quant, shape)
        err = np.abs(Q.dequantize(data, quant, shape) - x)
        bound = _bound(quant, x, data) * (1 + 1e-6)  # fp32 rounding of the scale arithmetic
        worst = np.unravel_index(np.argmax(err - bound), err.shape)
        assert (err <= bound).all(), f"{quant} {shape}: worst element {worst}: error {err[worst]} > {bound[worst]}"


@pytest.mark.parametrize("quant", TYPES)
def test_zeros(quant):
    zeros = np.zeros((2, 256), np.float32)
    assert not Q.dequantize(Q.quantize(zeros, quant), quant, zeros.shape).any()


@pytest.mark.parametrize("quant,values", [
    ("q8_0", [0, 1, -1, 127, -127, 5, -64, 100]),         # amax 127: d = 1
    ("q4_0", [0, 1, -1, -2, 0.5, -0.25, 1.75, 0]),        # m = -2: d = 0.25, steps -2 .. 1.75
    ("mxfp4", [0, 1, -1, -2, 0.5, -0.25, 1.5, 0.75])])    # amax 2: e = -1, the e2m1 grid / 2
def test_representable_values_are_exact(quant, values):
    x = np.tile(np.array(values, np.float32), (2, 32))
    assert Q.dequantize(Q.quantize(x, quant), quant, x.shape).tolist() == x.tolist()


def test_quantize_is_deterministic_and_padding_is_zero():
    x = _data(np.random.default_rng(1), 3, 96)
    for quant in ("q8_0", "q4_0", "mxfp4"):
        data = Q.quantize(x, quant)
        assert data == Q.quantize(x.copy(), quant)
        r = Q.regions(quant, x.shape)
        assert not any(data[r.qs_nbytes:r.scales_offset])


# --- shapes and bad input (§9.3) -----------------------------------------------------------------
@pytest.mark.parametrize("quant,cols", [("q8_0", 48), ("q4_0", 31), ("mxfp4", 16), ("nvfp4", 24)])
def test_cols_not_whole_blocks_refused(quant, cols):
    with pytest.raises(QuantShapeError, match=f"{quant} needs cols to be a multiple of"):
        Q.quantize(np.ones((2, cols), np.float32), quant)
    with pytest.raises(QuantShapeError):
        Q.quant_nbytes(quant, (2, cols))


def test_shapes_refused_and_accepted():
    for shape in [(64,), (2, 2, 64), (0, 64)]:
        with pytest.raises(QuantShapeError, match="must be 2-D"):
            Q.regions("q8_0", shape)
    assert Q.quant_nbytes("nvfp4", (3, 16)) == 128 + 4  # 16-element blocks: 16 cols are fine
    assert Q.quant_nbytes("q8_0", (1, 32)) == 66
    with pytest.raises(UnknownQuantError, match="'q5_k'.*knows q8_0, q4_0, mxfp4, nvfp4, fp8_e4m3"):
        Q.quantize(np.ones((1, 32), np.float32), "q5_k")
    with pytest.raises(ValueError, match="NaN or inf"):
        Q.quantize(np.full((1, 32), np.inf, np.float32), "q8_0")
    with pytest.raises(QuantShapeError, match="66 bytes, got 65"):
        Q.dequantize(bytes(65), "q8_0", (1, 32))


def test_fp8_partial_tiles():
    """Any shape; an edge tile's scale covers only the elements that exist (§9.3)."""
    x = np.zeros((130, 200), np.float32)
    x[:128, :128] = 1.0
    x[128:, :128] = 4.0      # bottom edge tile: 2 rows
    x[:128, 128:] = -8.0     # right edge tile: 72 cols
    x[129, 199] = 448 * 3.0  # the bottom-right tile: one element
    data = Q.quantize(x, "fp8_e4m3")
    r = Q.regions("fp8_e4m3", x.shape)
    assert r.scales_shape == (2, 2) and r.qs_nbytes == 130 * 200
    s = np.frombuffer(data[r.scales_offset:], "<f4").reshape(2, 2)
    assert s.tolist() == (np.array([[1, 8], [4, 448 * 3.0]], np.float32) / np.float32(448)).tolist()
    assert Q.dequantize(data, "fp8_e4m3", x.shape).tolist() == x.tolist()


# --- GGUF's blocks: written out here from GGUF's definitions -----------------------------------
def _f16(v) -> float:
    return float(np.float32(v).astype(np.float16))


def _gguf_q8_0_quantize(row) -> bytes:
    """GGUF's reference Q8_0, one block at a time: {fp16 d; int8 qs[32]}, d = amax/127, qs = roundf(x * (1/d))."""
    out = b""
    for b in range(0, len(row), 32):
        xs = [np.float32(v) for v in row[b:b + 32]]
        d = np.float32(max(abs(v) for v in xs) / np.float32(127))
        inv = np.float32(1) / d if d else np.float32(0)
        qs = [int(math.copysign(math.floor(abs(float(v * inv)) + 0.5), float(v))) for v in xs]
        out += struct.pack("<e32b", _f16(d), *qs)
    return out


def _gguf_q4_0_quantize(row) -> bytes:
    """GGUF's reference Q4_0: {fp16 d; uint8 qs[16]}, d = max/-8, q = min(15, (int)(x/d + 8.5)), j | (j+16) << 4."""
    out = b""
    for b in range(0, len(row), 32):
        xs = [np.float32(v) for v in row[b:b + 32]]
        amax, m = 0.0, np.float32(0)
        for v in xs:
            if abs(v) > amax:
                amax, m = abs(v), v
        d = np.float32(m / np.float32(-8))
        inv = np.float32(1) / d if d else np.float32(0)
        q = [min(15, int(np.float32(v * inv) + np.float32(8.5))) for v in xs]
        out += struct.pack("<e16B", _f16(d), *[q[j] | q[j + 16] << 4 for j in range(16)])
    return out


def _gguf_dequantize(quant, blocks: bytes, n: int):
    """GGUF's dequantizers: q8_0 qs*d; q4_0 ((qs[j] & 15) - 8)*d at j, (qs[j] >> 4) - 8 at j+16;
    mxfp4 {uint8 e; uint8 qs[16]} with kvalues {0,1,2,3,4,6,8,12,...negated} * 2^(e-128), same nibble order."""
    kvalues = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]
    size = {"q8_0": 34, "q4_0": 18, "mxfp4": 17}[quant]
    y = []
    for b in range(n // 32):
        blk = blocks[b * size:(b + 1) * size]
        if quant == "q8_0":
            d, *qs = struct.unpack("<e32b", blk)
            y += [q * np.float32(d) for q in qs]
            continue
        if quant == "q4_0":
            d, *qs = struct.unpack("<e16B", blk)
            scale, lo, hi = np.float32(d), [(q & 15) - 8 for q in qs], [(q >> 4) - 8 for q in qs]
        else:
            scale, qs = np.float32(2.0 ** (blk[0] - 128)), blk[1:]
            lo, hi = [kvalues[q & 15] for q in qs], [kvalues[q >> 4] for q in qs]
        y += [v * scale for v in lo] + [v * scale for v in hi]
    return np.array(y, np.float32)


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_gguf_quantizer_bytes_match(quant):
    """Quantizing like GGUF's reference gives GGUF's exact block bytes, moved (§9.1)."""
    x = _data(np.random.default_rng(5), 4, 128)
    x[0, :32] = 0  # an all-zero block
    x[1, 32:64] = np.float32(3)  # ties in magnitude: q4_0 takes the first
    x[1, 40] = -3
    ours = Q.to_gguf_blocks(Q.quantize(x, quant), quant, x.shape)
    gguf = {"q8_0": _gguf_q8_0_quantize, "q4_0": _gguf_q4_0_quantize}[quant]
    assert ours == b"".join(gguf(row) for row in x)


@pytest.mark.parametrize("quant", ["q8_0", "q4_0", "mxfp4"])
def test_gguf_blocks_mean_the_same(quant):
    """Any GGUF blocks, moved into §9.2's layout, dequantize to GGUF's values, and move back unchanged."""
    rng = np.random.default_rng(11)
    rows, cols = 3, 96
    size = Q.GGUF_BLOCK_BYTES[quant]
    blocks = bytearray(rng.integers(0, 256, rows * cols // 32 * size, dtype=np.uint8).tobytes())
    for b in range(rows * cols // 32):  # finite scales: fp16 in [-2, 2], e8m0 in 100..150
        if quant == "mxfp4":
            blocks[b * size] = int(rng.integers(100, 151))
        else:
            blocks[b * size:b * size + 2] = struct.pack("<e", float(rng.uniform(-2, 2)))
    blocks = bytes(blocks)
    data = Q.from_gguf_blocks(blocks, quant, (rows, cols))
    want = np.stack([_gguf_dequantize(quant, blocks[r * cols // 32 * size:(r + 1) * cols // 32 * size], cols)
                     for r in range(rows)])
    np.testing.assert_array_equal(Q.dequantize(data, quant, (rows, cols)), want)
    assert Q.to_gguf_blocks(data, quant, (rows, cols)) == blocks


def test_gguf_mxfp4_nibble_order_differs_from_ours():
    """Element 1 of a block: ours in the high nibble of byte 0 (gpt-oss), GGUF's in the low nibble of byte 1."""
    x = np.zeros((1, 32), np.float32); x[0, 1] = 6  # amax 6 -> e = 0 (7f), code 7
    ours = Q.quantize(x, "mxfp4")
    assert ours[:2] == _hex("70 00")
    assert Q.to_gguf_blocks(ours, "mxfp4", x.shape) == _hex("7f 00 07") + bytes(14)
    with pytest.raises(UnknownQuantError, match="no GGUF block form"):
        Q.to_gguf_blocks(Q.quantize(x, "nvfp4"), "nvfp4", x.shape)


# --- files: version 2 headers, slots sized by the quant type (SPEC.md §5, §9.2, §9.5) ------------
def _experts(rng, n, inter, hidden):
    return [{"gate": rng.standard_normal((inter, hidden)).astype(np.float32),
             "up": rng.standard_normal((inter, hidden)).astype(np.float32),
             "down": rng.standard_normal((hidden, inter)).astype(np.float32)} for _ in range(n)]


def _header(path):
    raw = path.read_bytes()
    _, version, n, _, _ = struct.unpack("<4sIQII", raw[:24])
    return version, json.loads(raw[24:24 + n])


def _rewrite_header(path, mutate):
    """Apply mutate(header), keep the version and data offset, fix the header crc."""
    raw = path.read_bytes()
    _, version, n, _, _ = struct.unpack("<4sIQII", raw[:24])
    header = json.loads(raw[24:24 + n])
    mutate(header)
    text = writer.dumps(header)
    data_offset = C.round_up(24 + n, C.ALIGNMENT)
    assert C.round_up(24 + len(text), C.ALIGNMENT) == data_offset
    prefix = struct.pack("<4sIQII", C.MAGIC, version, len(text), zlib.crc32(text), 0)
    path.write_bytes(prefix + text + bytes(data_offset - 24 - len(text)) + raw[data_offset:])


@pytest.fixture
def quantized(tmp_path):
    """A version 2 file: a q4_0 bank, a plain fp32 bank, a q8_0 tensor and a plain tensor."""
    rng = np.random.default_rng(2)
    experts = _experts(rng, 3, 64, 96)
    embd = rng.standard_normal((8, 64)).astype(np.float32)
    tensors = [writer.tensor_from_array("token_embd.weight", "bf16", embd, quant="q8_0"),
               writer.tensor_from_array("output_norm.weight", "fp32", np.ones(64, np.float32))]
    banks = [writer.bank_from_arrays(0, "bf16", experts, quant="q4_0"),
             writer.bank_from_arrays(1, "fp32", _experts(rng, 2, 8, 16))]
    path = tmp_path / "q.ftw"
    writer.write(str(path), {"model.config": {"family": "t"}}, tensors, banks)
    return path, experts, embd


def test_quantized_file_round_trip(quantized):
    path, experts, embd = quantized
    version, header = _header(path)
    assert version == 2 and all("quant" in e for e in header["tensors"] + header["banks"])
    with ftw.open(path, verify=True) as f:
        assert f.version == 2
        b = f.banks[0]
        assert (b.quant, b.dtype) == ("q4_0", "bf16") and f.banks[1].quant == "none"
        # slot layout of §5.2 with quant_nbytes: gate [64, 96] = 64*96/2 qs + 64*3 fp16 scales
        gate = Q.quant_nbytes("q4_0", (64, 96))
        assert gate == 3072 + 384
        assert [(p.name, p.offset, p.nbytes) for p in b.projections] == [
            ("gate", 0, gate), ("up", C.round_up(gate, 64), gate),
            ("down", C.round_up(C.round_up(gate, 64) + gate, 64), Q.quant_nbytes("q4_0", (96, 64)))]
        assert b.slot_stride == C.round_up(b.projections[-1].offset + b.projections[-1].nbytes, C.ALIGNMENT)
        for e, ex in enumerate(experts):
            slot = f.slot_bytes(0, e)
            for p in b.projections:
                data = slot[p.offset:p.offset + p.nbytes].tobytes()
                assert data == Q.quantize(ex[p.name], "q4_0")
                err = np.abs(Q.dequantize(data, "q4_0", p.shape) - ex[p.name])
                assert (err <= _bound("q4_0", ex[p.name], data) * (1 + 1e-6)).all()
        t = f.tensors["token_embd.weight"]
        assert t.quant == "q8_0" and t.nbytes == Q.quant_nbytes("q8_0", (8, 64))
        assert f.tensor_bytes(t.name).tobytes() == Q.quantize(embd, "q8_0")
        assert f.tensors["output_norm.weight"].quant == "none"
        assert f.tensor("output_norm.weight").tolist() == [1.0] * 64
        with pytest.raises(ftw.FTWError, match="quantized \\(q8_0\\).*ftw.quant.dequantize"):
            f.tensor("token_embd.weight")


def test_unquantized_file_stays_version_1(tmp_path):
    """Nothing quantized: version 1 and no quant keys, so older readers keep reading it (§9.5);
    a `quant` key in a version 1 file is not read (version 1 has none)."""
    path = tmp_path / "p.ftw"
    writer.write(str(path), {}, [], [writer.bank_from_arrays(0, "fp32", _experts(np.random.default_rng(0), 2, 32, 32))])
    version, header = _header(path)
    assert version == 1 and "quant" not in header["banks"][0]
    _rewrite_header(path, lambda h: h["banks"][0].update(quant="q4_0"))
    with ftw.open(path, verify=True) as f:
        assert f.version == 1 and f.banks[0].quant == "none"


def _t(header, name):
    return next(t for t in header["tensors"] if t["name"] == name)


def test_version_2_refusals(quantized):
    path = quantized[0]
    good = path.read_bytes()

    def refused(mutate, error, match):
        path.write_bytes(good)
        _rewrite_header(path, mutate)
        with pytest.raises(error, match=match):
            ftw.open(path)

    refused(lambda h: h["banks"][0].update(quant="q5_k"), UnknownQuantError,
            r"bank of layer 0 is quantized as 'q5_k', a type this freetoken does not know \(it knows q8_0")
    refused(lambda h: _t(h, "token_embd.weight").update(quant="Q4_0"), UnknownQuantError, "'Q4_0'")
    refused(lambda h: h["banks"][1].pop("quant"), E.HeaderError, "missing key 'quant'")
    refused(lambda h: _t(h, "output_norm.weight").update(quant=4), E.HeaderError, "quant: expected a string")
    # the bytes follow from the quant type: another type, or another shape, no longer fits
    refused(lambda h: h["banks"][0].update(quant="q8_0"), E.SizeMismatchError, "gate has 3456 bytes, not q8_0")
    refused(lambda h: _t(h, "token_embd.weight").update(quant="none"), E.SizeMismatchError, "544 bytes but bf16")
    refused(lambda h: _t(h, "output_norm.weight").update(quant="q8_0"), QuantShapeError,
            "output_norm.weight: a q8_0 tensor must be 2-D")
    refused(lambda h: h["banks"][0]["projections"][2].update(shape=[96, 48]), QuantShapeError,
            "down: q4_0 needs cols to be a multiple of 32")
    # don't over-reject: a version 2 file whose entries all say "none" is fine
    path.write_bytes(good)
    _rewrite_header(path, lambda h: None)
    ftw.open(path).close()


def test_bank_entry_sizes_follow_the_quant_type():
    read = (lambda e: None)
    for quant in TYPES:
        b = writer.BankEntry(0, "bf16", 4, 256, 128, read, quant=quant)
        sizes = [Q.quant_nbytes(quant, (256, 128))] * 2 + [Q.quant_nbytes(quant, (128, 256))]
        assert [p["nbytes"] for p in b.projections] == sizes
        assert all(p["offset"] % C.PROJ_ALIGNMENT == 0 for p in b.projections)
        assert b.nbytes == 4 * b.slot_stride
    bf16 = writer.BankEntry(0, "bf16", 4, 256, 128, read).slot_stride
    assert writer.BankEntry(0, "bf16", 4, 256, 128, read, quant="q4_0").slot_stride < bf16 / 3
    with pytest.raises(QuantShapeError, match="q4_0 needs cols to be a multiple of 32"):
        writer.BankEntry(0, "bf16", 4, 256, 100, read, quant="q4_0")
    with pytest.raises(UnknownQuantError, match="'int3'"):
        writer.BankEntry(0, "bf16", 4, 256, 128, read, quant="int3")


def test_inspect_shows_quant_types(quantized):
    from ftw.inspect import inspect_file
    path = quantized[0]
    info = json.loads(inspect_file(path, as_json=True))
    assert [b["quant"] for b in info["banks"]] == ["q4_0", "none"] and info["version"] == 2
    quants = {t["name"]: t["quant"] for t in info["tensors"]}
    assert quants == {"token_embd.weight": "q8_0", "output_norm.weight": "none"}
    text = inspect_file(path, verify=True)
    assert re.search(r"blk\.0\.ffn_exps +bf16 +q4_0 +3 ", text)
    assert re.search(r"token_embd\.weight +bf16 +q8_0 +8x64", text)


def test_the_engine_refuses_quantized_dense_tensors_by_name(quantized):
    """The format holds quantized dense tensors before the engine runs them: opening one is a
    ModelError naming the type and what to do, never bf16 reads of q8_0 bytes (the engine's
    quantized experts: tests/test_quant_engine.py)."""
    from freetoken.engine import Engine
    from freetoken.errors import ModelError
    with pytest.raises(ModelError, match="holds q8_0 dense .*quantizes the experts alone"):
        Engine(str(quantized[0]), None)
