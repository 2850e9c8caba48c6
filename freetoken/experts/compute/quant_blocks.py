"""Quantized expert weights as the Triton kernels read them (ftw/SPEC.md §9): QuantSpec, where
a bank's projections keep their blocks and scales, and the jit helpers that decode blocks in
registers for triton_experts.py (decode) and grouped_experts.py (prefill). Nothing here writes
a dequantized copy of a weight anywhere.

Types (kernel_args.DEVICE_QUANTS), each in blocks of 32 along a row (the reduction axis):
  q8_0   32 int8,                 fp16 scale d:  w = q * d
  q4_0   16 bytes: element j low, j + 16 high nibble,  fp16 d:  w = (nibble - 8) * d
  mxfp4  16 bytes: element 2k low, 2k + 1 high (e2m1), e8m0 scale e:  w = e2m1 * 2^(e - 127)
  fp8_e4m3  one e4m3 byte per element, an fp32 scale s per 128 x 128 tile (rows may end in a
         partial tile, any D and I):  w = e4m3 * s. The bytes are decoded with integer ops
         and a bitcast (e4m3_values: no fp8 dtype, which Triton's interpreter lacks). The decode
         kernels form w = e4m3 * s in fp32 (ftw.quant's rounding); the grouped ones take a
         32-block inside one tile, as the other types.

The block's values before its scale (int8, int4 - 8, e2m1, e4m3) are exact in bf16 and fp16,
so a kernel can dot them with x in x's dtype and scale each block's partial sum in fp32: no
rounding of the dequantized weight, as ftw.quant.dequantize's fp32 values.

Shape legend: BR rows of a program, NB blocks per step, BN output columns of a tile.
"""
from dataclasses import dataclass
from typing import Optional

import torch

from ftw.quant import regions
from ...kernel_args import DEVICE_QUANTS

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the callers keep their torch paths
    triton = None

# the kernels' constexpr code of each type (0: the bank's own dtype)
CODES = {"q8_0": 1, "q4_0": 2, "mxfp4": 3, "fp8_e4m3": 4}
SCALE_SIZES = {"q8_0": 2, "q4_0": 2, "mxfp4": 1, "fp8_e4m3": 4}  # fp16, e8m0, fp32
FP8_TILE = 128
assert tuple(CODES) == DEVICE_QUANTS


@dataclass(frozen=True)
class QuantSpec:
    """One quantized bank's layout as the kernels take it: the type's code, the expert's I and D
    and, per projection shape, the bytes from a projection's start to its scales
    (ftw.quant.regions; gate and up [I, D] share one, down [D, I] has its own)."""
    quant: str
    code: int
    I: int
    D: int
    gate_scales: int  # bytes from a gate (or up) projection's start to its scales
    down_scales: int
    scale_size: int  # bytes per scale: 2 (fp16), 1 (e8m0) or 4 (fp8_e4m3's fp32)

    @classmethod
    def of(cls, info) -> Optional["QuantSpec"]:
        """The spec of a BankInfo (None for a bank of plain elements); ValueError for a type no
        device kernel reads, or one with biases (a quantized bank has none: ftw/SPEC.md §9)."""
        quant = getattr(info, "quant", "none")
        if quant == "none":
            return None
        if quant not in DEVICE_QUANTS:
            raise ValueError(f"the device kernels read {', '.join(DEVICE_QUANTS)} experts, "
                             f"not {quant}")
        shapes = {p.name: tuple(p.shape) for p in info.projections}
        if set(shapes) != {"gate", "up", "down"}:
            raise ValueError(f"{info.name}: a {quant} bank holds gate, up and down alone, "
                             f"not {sorted(shapes)}")
        I, D = shapes["gate"]
        return cls(quant, CODES[quant], I, D, regions(quant, (I, D)).scales_offset,
                   regions(quant, (D, I)).scales_offset, SCALE_SIZES[quant])

    def scale_view(self, storage: torch.Tensor) -> torch.Tensor:
        """The bytes of a uint8 tensor read as scales: fp16 for q8_0 / q4_0, uint8 for mxfp4,
        fp32 for fp8_e4m3 (no copy; offsets into it are byte offsets / scale_size)."""
        return storage.view({2: torch.float16, 4: torch.float32, 1: torch.uint8}[self.scale_size])


if triton is not None:
    @triton.jit
    def scale_values(s, QUANT: tl.constexpr):
        """Loaded scales (fp16, or e8m0 bytes) -> fp32. e8m0 code e is 2^(e - 127): e as an
        fp32 exponent field (exact, no exp2 approximation); 0 is 2^-127, 255 NaN (§9.1)."""
        if QUANT == 3:
            e = s.to(tl.int32)
            v = (e << 23).to(tl.float32, bitcast=True)
            v = tl.where(e == 0, 5.877471754111438e-39, v)
            v = tl.where(e == 255, (e * 0 + 0x7FC00000).to(tl.float32, bitcast=True), v)
        else:
            v = s.to(tl.float32)
        return v

    @triton.jit
    def e4m3_values(code):
        """e4m3 codes (int32, 0..255) -> fp32 (OCP float8_e4m3fn, SPEC.md §9.1): a normal code's
        exponent and mantissa moved into an fp32's fields (exponent + 120), a subnormal's
        mantissa times 2^-9, 0x7f / 0xff NaN; integer ops and a bitcast, exact."""
        em = code & 0x7F
        e = em >> 3
        m = em & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
        mag = tl.where(em == 0x7F, (em * 0 + 0x7FC00000).to(tl.float32, bitcast=True), mag)
        return tl.where((code & 0x80) != 0, -mag, mag)

    @triton.jit
    def fp8_weights(qs, sc, rows, row_ok, cols, col_ok, n_cols: tl.constexpr):
        """[BR, BC] fp32 weights e4m3 * s of rows `rows`, columns `cols` of an fp8_e4m3
        [*, n_cols] projection (bytes at qs, fp32 tile scales at sc); masked ones 0."""
        ok = row_ok[:, None] & col_ok[None, :]
        code = tl.load(qs + rows[:, None] * n_cols + cols[None, :], mask=ok, other=0).to(tl.int32)
        tiles = (n_cols + 127) // 128
        s = tl.load(sc + (rows[:, None] // 128) * tiles + cols[None, :] // 128, mask=ok, other=0.0)
        return e4m3_values(code) * s

    @triton.jit
    def e2m1_values(code):
        """4-bit e2m1 codes (int32) -> fp32: sign bit 8, exponent bits 1-2, mantissa bit 0."""
        e = (code >> 1) & 3
        m = (code & 1).to(tl.float32)
        mag = tl.where(e == 0, m * 0.5, (2.0 + m) * (1 << e).to(tl.float32) * 0.25)
        return tl.where((code & 8) != 0, -mag, mag)

    @triton.jit
    def nibble_values(code, QUANT: tl.constexpr):
        """4-bit codes (int32) -> their values before the block's scale (q4_0: code - 8)."""
        if QUANT == 3:
            v = e2m1_values(code)
        else:
            v = (code - 8).to(tl.float32)
        return v

    @triton.jit
    def x_pairs(x_row, blk, blk_ok, QUANT: tl.constexpr):
        """x's elements for blocks blk [NB] of row x_row, fp32, as row_dot pairs them with the
        weights' bytes: q8_0 (x [NB, 32], the same); q4_0 (j, j + 16) and mxfp4 (2k, 2k + 1)
        as two [NB, 16]. (One return, after constexpr branches: the compiler visits the code
        after a branch's return too.)"""
        if QUANT == 1:
            j = tl.arange(0, 32)
            xa = tl.load(x_row + blk[:, None] * 32 + j[None, :], mask=blk_ok[:, None],
                         other=0.0).to(tl.float32)
            xb = xa
        else:
            j = tl.arange(0, 16)
            if QUANT == 2:
                first, second = blk[:, None] * 32 + j[None, :], 16
            else:
                first, second = blk[:, None] * 32 + 2 * j[None, :], 1
            xa = tl.load(x_row + first, mask=blk_ok[:, None], other=0.0).to(tl.float32)
            xb = tl.load(x_row + first + second, mask=blk_ok[:, None], other=0.0).to(tl.float32)
        return xa, xb

    @triton.jit
    def row_dot(qs, sc, rows, row_ok, n_cols, blk, blk_ok, xa, xb, QUANT: tl.constexpr):
        """[BR] fp32: rows `rows` of a quantized [*, n_cols] projection (blocks at qs, bytes;
        scales at sc) dotted with x over blocks blk [NB] (x_pairs' xa, xb); masked rows and
        blocks read nothing and give 0."""
        ok = row_ok[:, None, None] & blk_ok[None, :, None]
        if QUANT == 1:
            j = tl.arange(0, 32)
            at = rows[:, None, None] * n_cols + blk[None, :, None] * 32 + j[None, None, :]
            q = tl.load(qs + at, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            part = tl.sum(q * xa[None, :, :], axis=2)  # [BR, NB]
        else:
            j = tl.arange(0, 16)
            at = rows[:, None, None] * (n_cols // 2) + blk[None, :, None] * 16 + j[None, None, :]
            byte = tl.load(qs + at, mask=ok, other=0).to(tl.int32)
            lo = nibble_values(byte & 15, QUANT)
            hi = nibble_values(byte >> 4, QUANT)
            part = tl.sum(lo * xa[None, :, :] + hi * xb[None, :, :], axis=2)  # [BR, NB]
        s = tl.load(sc + rows[:, None] * (n_cols // 32) + blk[None, :],
                    mask=row_ok[:, None] & blk_ok[None, :], other=0)
        return tl.sum(part * scale_values(s, QUANT), axis=1)

    @triton.jit
    def tile_t(qs, sc, cols, col_ok, k0, n_cols, QUANT: tl.constexpr):
        """Block k0 / 32 of rows `cols` [BN] of a quantized [*, n_cols] projection, transposed:
        (values before the scale fp32 [32, BN], each row's scale fp32 [BN]); w[col, k0 + k] =
        values[k, col] * scale[col] (fp8_e4m3: the scale of the tile holding the block)."""
        k = tl.arange(0, 32)
        blk = k0 // 32
        ok = col_ok[None, :]
        if QUANT == 4:  # fp8_e4m3: the block lies in one tile column; n_cols any (masked)
            at = cols[None, :] * n_cols + (k0 + k)[:, None]
            code = tl.load(qs + at, mask=ok & ((k0 + k) < n_cols)[:, None], other=0).to(tl.int32)
            v = e4m3_values(code)
            s = tl.load(sc + (cols // 128) * ((n_cols + 127) // 128) + k0 // 128, mask=col_ok,
                        other=0.0)
        elif QUANT == 1:
            at = cols[None, :] * n_cols + (k0 + k)[:, None]
            v = tl.load(qs + at, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            s = scale_values(tl.load(sc + cols * (n_cols // 32) + blk, mask=col_ok, other=0), QUANT)
        else:
            if QUANT == 2:  # element k: byte k % 16, the high nibble from k = 16 on
                byte_at, shift = k % 16, (k // 16) * 4
            else:  # mxfp4: element k: byte k // 2, the high nibble for odd k
                byte_at, shift = k // 2, (k % 2) * 4
            at = cols[None, :] * (n_cols // 2) + blk * 16 + byte_at[:, None]
            byte = tl.load(qs + at, mask=ok, other=0).to(tl.int32)
            v = nibble_values((byte >> shift[:, None]) & 15, QUANT)
            s = scale_values(tl.load(sc + cols * (n_cols // 32) + blk, mask=col_ok, other=0), QUANT)
        return v, s
