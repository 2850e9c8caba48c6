"""Reference quantizers and dequantizers for SPEC.md §9 (numpy): the oracle the CPU and GPU
kernels are tested against, and `convert --quant`'s encoder. Exact and slow: every rounding
step follows §9.4 and every decode §9.1; nothing here runs on a hot path.

    data = quantize(x, "q4_0")                 # x: fp32 [rows, cols] -> bytes in §9.2's layout
    y = dequantize(data, "q4_0", x.shape)      # -> fp32 [rows, cols]
    r = regions("q4_0", x.shape)               # where qs, scales (and nvfp4's g) sit

quantize() takes the native quantizer (freetoken._quant, cython/quant.pyx) where it is built:
the same bytes for q8_0, q4_0, mxfp4 and nvfp4, 5-30x faster on one core and without the GIL,
so convert's writer threads quantize side by side. The numpy bodies below stay the reference
(`reference_quantize` runs them alone; tests/test_quant_native.py holds the native path to them)
and answer whatever the native path leaves to them (non-finite input, scale-overflow blocks).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import constants as C
from .errors import QuantShapeError, UnknownQuantError

try:  # NOTE: compiled modules are outside the import layers; ftw works without the build
    from freetoken import _quant as _native
except ImportError:
    _native = None

E2M1_MAX = 6.0
E4M3_MAX = 448.0


# --- element and scale encodings (§9.1) ----------------------------------------------------------
def _e2m1_magnitudes() -> np.ndarray:
    codes = np.arange(8)
    e, m = codes >> 1, codes & 1
    return np.where(e == 0, m * 0.5, (1 + m / 2) * 2.0 ** (e - 1))


def _e4m3_magnitudes() -> np.ndarray:
    """Magnitudes of codes 0..126 (127 is NaN), ascending."""
    codes = np.arange(127)
    e, m = codes >> 3, codes & 7
    return np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))


E2M1_GRID = _e2m1_magnitudes()
E4M3_GRID = _e4m3_magnitudes()


def e2m1_decode(codes) -> np.ndarray:
    codes = np.asarray(codes, dtype=np.uint8)
    mag = E2M1_GRID[codes & 7]
    return np.where(codes & 8, -mag, mag).astype(np.float32)


def e4m3_decode(codes) -> np.ndarray:
    codes = np.asarray(codes, dtype=np.uint8)
    low = codes & 0x7F
    mag = np.where(low == 0x7F, np.nan, E4M3_GRID[np.minimum(low, 126)])
    return np.where(codes & 0x80, -mag, mag).astype(np.float32)


def e8m0_decode(codes) -> np.ndarray:
    codes = np.asarray(codes, dtype=np.int64)
    return np.where(codes == 255, np.nan, np.ldexp(1.0, codes - 127)).astype(np.float32)


def _nearest(values, grid: np.ndarray, sign_bit: int) -> np.ndarray:
    """Codes of `grid` (ascending magnitudes, index = code) nearest to `values`: ties to the even
    code, saturating at the largest, zero as code 0 (§9.4)."""
    v = np.asarray(values, dtype=np.float64)
    a = np.minimum(np.abs(v), grid[-1])
    hi = np.searchsorted(grid, a, side="left").clip(0, len(grid) - 1)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    code = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    return np.where((v < 0) & (code != 0), code | sign_bit, code).astype(np.uint8)


def e2m1_encode(values) -> np.ndarray:
    return _nearest(values, E2M1_GRID, 8)


def e4m3_encode(values) -> np.ndarray:
    return _nearest(values, E4M3_GRID, 0x80)


# --- where the bytes go (§9.2, §9.3) -------------------------------------------------------------
@dataclass(frozen=True)
class Regions:
    """The byte regions of one quantized [rows, cols] tensor, relative to its start (§9.2)."""
    quant: str
    rows: int
    cols: int
    qs_nbytes: int
    scales_offset: int
    scales_shape: tuple
    tensor_scale_offset: Optional[int]  # nvfp4's fp32 g, else None
    nbytes: int


def quant_type(quant: str) -> C.QuantType:
    """The §9.1 row of `quant`; UnknownQuantError names an unknown one."""
    q = C.QUANT_TYPES.get(quant)
    if q is None:
        raise UnknownQuantError(f"unknown quant type {quant!r}; this freetoken knows "
                                f"{', '.join(C.QUANT_TYPES)} (a newer freetoken may know more)")
    return q


def regions(quant: str, shape) -> Regions:
    """Layout of a `quant` tensor of `shape`; QuantShapeError when the shape cannot hold it (§9.3)."""
    q = quant_type(quant)
    shape = tuple(int(d) for d in shape)
    if len(shape) != 2 or min(shape) < 1:
        raise QuantShapeError(f"a {quant} tensor must be 2-D [rows, cols] with both dims >= 1, "
                              f"not {list(shape)}; keep this tensor unquantized")
    rows, cols = shape
    if not q.partial and cols % q.block_cols:
        raise QuantShapeError(f"{quant} needs cols to be a multiple of {q.block_cols}, but the shape "
                              f"is {list(shape)}; choose another quant type or keep it unquantized")
    qs_nbytes = rows * cols * q.bits // 8
    scales_shape = (-(-rows // q.block_rows), -(-cols // q.block_cols))
    scales_offset = C.round_up(qs_nbytes, C.QUANT_REGION_ALIGNMENT)
    end = scales_offset + scales_shape[0] * scales_shape[1] * q.scale_bytes
    g_offset = None
    if q.tensor_scale_bytes:
        g_offset = C.round_up(end, C.QUANT_REGION_ALIGNMENT)
        end = g_offset + q.tensor_scale_bytes
    return Regions(quant, rows, cols, qs_nbytes, scales_offset, scales_shape, g_offset, end)


def quant_nbytes(quant: str, shape) -> int:
    return regions(quant, shape).nbytes


def _assemble(r: Regions, qs: np.ndarray, scales: np.ndarray, g=None) -> bytes:
    out = np.zeros(r.nbytes, dtype=np.uint8)
    out[:r.qs_nbytes] = np.ascontiguousarray(qs).view(np.uint8).reshape(-1)
    sb = np.ascontiguousarray(scales).view(np.uint8).reshape(-1)
    out[r.scales_offset:r.scales_offset + sb.size] = sb
    if g is not None:
        out[r.tensor_scale_offset:] = np.array([g], dtype="<f4").view(np.uint8)
    return out.tobytes()


def assemble(quant: str, shape, qs, scales, g=None) -> bytes:
    """The bytes of a `quant` tensor of `shape` from its element bytes `qs` (row-major, §9.2's
    order) and its block scales as stored (and nvfp4's g): how a published checkpoint's blocks
    and scales are copied in, unchanged (§9.1)."""
    r = regions(quant, shape)
    qs, scales = np.ascontiguousarray(qs), np.ascontiguousarray(scales)
    n = r.scales_shape[0] * r.scales_shape[1] * quant_type(quant).scale_bytes
    if qs.nbytes != r.qs_nbytes or scales.nbytes != n or (g is None) != (r.tensor_scale_offset is None):
        raise QuantShapeError(f"{quant} {[r.rows, r.cols]} takes {r.qs_nbytes} element bytes and "
                              f"{n} scale bytes, got {qs.nbytes} and {scales.nbytes}")
    return _assemble(r, qs, scales, g)


def _split(data, r: Regions, scale_dtype):
    raw = np.frombuffer(data, dtype=np.uint8)
    if raw.size != r.nbytes:
        raise QuantShapeError(f"{r.quant} {[r.rows, r.cols]} is {r.nbytes} bytes, got {raw.size}")
    qs = raw[:r.qs_nbytes].reshape(r.rows, -1)
    n = r.scales_shape[0] * r.scales_shape[1] * np.dtype(scale_dtype).itemsize
    scales = raw[r.scales_offset:r.scales_offset + n].view(scale_dtype).reshape(r.scales_shape)
    g = None
    if r.tensor_scale_offset is not None:
        g = raw[r.tensor_scale_offset:r.tensor_scale_offset + 4].view("<f4")[0]
    return qs, scales, g


def _pack_pairs(codes: np.ndarray) -> np.ndarray:
    """[rows, cols] 4-bit codes -> [rows, cols/2] bytes, element 2k low, 2k+1 high (mxfp4, nvfp4)."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def _unpack_pairs(qs: np.ndarray) -> np.ndarray:
    return np.stack([qs & 0x0F, qs >> 4], axis=-1).reshape(qs.shape[0], -1)


def _pack_halves(codes: np.ndarray) -> np.ndarray:
    """[rows, cols] 4-bit codes -> bytes, per 32-block element j low, j+16 high (q4_0, GGUF's order)."""
    b = codes.reshape(codes.shape[0], -1, 32)
    return (b[..., :16] | (b[..., 16:] << 4)).astype(np.uint8).reshape(codes.shape[0], -1)


def _unpack_halves(qs: np.ndarray) -> np.ndarray:
    b = qs.reshape(qs.shape[0], -1, 16)
    return np.concatenate([b & 0x0F, b >> 4], axis=-1).reshape(qs.shape[0], -1)


# --- quantize / dequantize (§9.4, §9.1) ----------------------------------------------------------
def quantize(x, quant: str) -> bytes:
    """fp32 [rows, cols] -> the bytes of a `quant` tensor (§9.2), rounded as §9.4 says.
    Refuses non-finite values and shapes the type cannot hold. Safe to call from several
    threads: the native path holds no GIL while it quantizes."""
    x = np.asarray(x, dtype=np.float32)
    r = regions(quant, x.shape)
    if _native is not None and quant in _native.QUANTS:
        data = _native.quantize(np.require(x, requirements="CA"), quant, r)
        if data is not None:  # None: NaN / inf, or blocks only the reference answers (quant.h)
            return data
    return _reference(x, quant, r)


def reference_quantize(x, quant: str) -> bytes:
    """quantize() by the numpy bodies alone: the oracle of the native path."""
    x = np.asarray(x, dtype=np.float32)
    return _reference(x, quant, regions(quant, x.shape))


def _reference(x: np.ndarray, quant: str, r: Regions) -> bytes:
    if not np.isfinite(x).all():
        raise ValueError(f"cannot quantize to {quant}: the tensor holds NaN or inf")
    return _QUANTIZE[quant](x, r)


def dequantize(data, quant: str, shape) -> np.ndarray:
    """The bytes of a `quant` tensor of `shape` -> fp32 [rows, cols] (§9.1, every step in fp32)."""
    r = regions(quant, shape)
    return _DEQUANTIZE[quant](data, r)


def _blocks(x: np.ndarray, size: int) -> np.ndarray:
    return x.reshape(x.shape[0], -1, size)


def _quantize_q8_0(x, r):
    xb = _blocks(x, 32)
    d = np.abs(xb).max(axis=-1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    v = (xb * inv[..., None]).astype(np.float64)  # x * (1/d) in fp32, then rounded exactly
    q = np.clip(np.sign(v) * np.floor(np.abs(v) + 0.5), -127, 127).astype(np.int8)
    return _assemble(r, q.reshape(r.rows, r.cols), d.astype("<f2"))


def _dequantize_q8_0(data, r):
    qs, d, _ = _split(data, r, "<f2")
    q = qs.view(np.int8).astype(np.float32)
    return (_blocks(q, 32) * d.astype(np.float32)[..., None]).reshape(r.rows, r.cols)


def _quantize_q4_0(x, r):
    xb = _blocks(x, 32)
    idx = np.abs(xb).argmax(axis=-1)[..., None]  # the first of equal magnitudes
    d = (np.take_along_axis(xb, idx, axis=-1)[..., 0] / np.float32(-8)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    v = (xb * inv[..., None]).astype(np.float32) + np.float32(8.5)  # fp32, as GGUF's reference
    q = np.minimum(15, np.floor(v)).astype(np.uint8)
    return _assemble(r, _pack_halves(q.reshape(r.rows, r.cols)), d.astype("<f2"))


def _dequantize_q4_0(data, r):
    qs, d, _ = _split(data, r, "<f2")
    q = _unpack_halves(qs).astype(np.float32) - np.float32(8)
    return (_blocks(q, 32) * d.astype(np.float32)[..., None]).reshape(r.rows, r.cols)


def _quantize_mxfp4(x, r):
    xb = _blocks(x, 32)
    mant, exp = np.frexp(np.abs(xb).max(axis=-1).astype(np.float64))  # amax = mant * 2^exp
    e = np.where(mant <= 0.75, exp - 3, exp - 2)  # smallest e with 6 * 2^e >= amax
    stored = np.where(mant == 0, 0, np.clip(e + 127, 0, 254)).astype(np.uint8)
    scale = e8m0_decode(stored)
    q = e2m1_encode(xb / scale[..., None]).reshape(r.rows, r.cols)
    return _assemble(r, _pack_pairs(q), stored)


def _dequantize_mxfp4(data, r):
    qs, e, _ = _split(data, r, np.uint8)
    v = e2m1_decode(_unpack_pairs(qs))
    return (_blocks(v, 32) * e8m0_decode(e)[..., None]).reshape(r.rows, r.cols)


def _quantize_nvfp4(x, r):
    tamax = np.abs(x).max()
    g = np.float32(tamax / np.float32(6 * 448)) if tamax > 0 else np.float32(1)
    xb = _blocks(x, 16)
    s = e4m3_encode(np.abs(xb).max(axis=-1) / (np.float32(6) * g))
    denom = (e4m3_decode(s) * g).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(denom[..., None] > 0, xb / denom[..., None], 0)
    q = e2m1_encode(v).reshape(r.rows, r.cols)
    return _assemble(r, _pack_pairs(q), s, g)


def _dequantize_nvfp4(data, r):
    qs, s, g = _split(data, r, np.uint8)
    v = e2m1_decode(_unpack_pairs(qs))
    return ((_blocks(v, 16) * e4m3_decode(s)[..., None]) * np.float32(g)).reshape(r.rows, r.cols)


def _tiles(x: np.ndarray, r: Regions) -> np.ndarray:
    """[rows, cols] -> zero-padded [tile rows, 128, tile cols, 128]."""
    tr, tc = r.scales_shape
    padded = np.zeros((tr * 128, tc * 128), dtype=x.dtype)
    padded[:r.rows, :r.cols] = x
    return padded.reshape(tr, 128, tc, 128)


def _quantize_fp8_e4m3(x, r):
    amax = np.abs(_tiles(x, r)).max(axis=(1, 3))  # padding zeros never raise a tile's amax
    s = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)
    full = np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[:r.rows, :r.cols]
    return _assemble(r, e4m3_encode(x / full), s.astype("<f4"))


def _dequantize_fp8_e4m3(data, r):
    qs, s, _ = _split(data, r, "<f4")
    full = np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[:r.rows, :r.cols]
    return e4m3_decode(qs) * full


_QUANTIZE = {"q8_0": _quantize_q8_0, "q4_0": _quantize_q4_0, "mxfp4": _quantize_mxfp4,
             "nvfp4": _quantize_nvfp4, "fp8_e4m3": _quantize_fp8_e4m3}
_DEQUANTIZE = {"q8_0": _dequantize_q8_0, "q4_0": _dequantize_q4_0, "mxfp4": _dequantize_mxfp4,
               "nvfp4": _dequantize_nvfp4, "fp8_e4m3": _dequantize_fp8_e4m3}


# --- GGUF's interleaved blocks (§9.1: the same values, moved) --------------------------------------
GGUF_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "mxfp4": 17}


def to_gguf_blocks(data, quant: str, shape) -> bytes:
    """Our `q8_0` / `q4_0` / `mxfp4` bytes -> GGUF's blocks (`{fp16 d; qs}` / `{uint8 e; qs[16]}`),
    row-major, the same values; mxfp4's nibbles move to GGUF's (j, j+16) order."""
    r = _gguf_regions(quant, shape)
    qs, scales, _ = _split(data, r, np.uint8 if quant == "mxfp4" else "<f2")
    if quant == "mxfp4":
        qs = _pack_halves(_unpack_pairs(qs))
    per = qs.reshape(r.rows, r.cols // 32, -1)
    head = scales.reshape(r.rows, r.cols // 32, 1).view(np.uint8)
    return np.concatenate([head, per], axis=-1).tobytes()


def from_gguf_blocks(blocks, quant: str, shape) -> bytes:
    """GGUF's `q8_0` / `q4_0` / `mxfp4` blocks of a [rows, cols] tensor -> our bytes (§9.2)."""
    r = _gguf_regions(quant, shape)
    head = 1 if quant == "mxfp4" else 2
    raw = np.frombuffer(blocks, dtype=np.uint8)
    want = r.rows * r.cols // 32 * GGUF_BLOCK_BYTES[quant]
    if raw.size != want:
        raise QuantShapeError(f"GGUF {quant} {[r.rows, r.cols]} is {want} bytes, got {raw.size}")
    b = raw.reshape(r.rows, r.cols // 32, GGUF_BLOCK_BYTES[quant])
    scales = np.ascontiguousarray(b[..., :head])
    qs = np.ascontiguousarray(b[..., head:]).reshape(r.rows, -1)
    if quant == "mxfp4":
        qs = _pack_pairs(_unpack_halves(qs))
    return _assemble(r, qs, scales)


def _gguf_regions(quant: str, shape) -> Regions:
    if quant not in GGUF_BLOCK_BYTES:
        raise UnknownQuantError(f"{quant!r} has no GGUF block form here; GGUF blocks exist for "
                                f"{', '.join(GGUF_BLOCK_BYTES)}")
    return regions(quant, shape)
