/* Quantized expert weights (ftw/SPEC.md §9): the dot products of q8_0, q4_0, mxfp4, nvfp4 and
 * fp8_e4m3 rows, the blocks dequantized in registers (never a dequantized copy in memory).
 *
 * A quantized [rows, K] projection is its qs region (row-major, ft_qrow_bytes per row), at
 * ft_qscales_offset its block scales (row-major, ft_qrow_scale_bytes per row: fp16 per 32
 * elements for q8_0 / q4_0, e8m0 per 32 for mxfp4, e4m3 per 16 for nvfp4; fp8_e4m3: fp32 per
 * 128 x 128 tile, so the 128 rows of a tile row share one row of ceil(K / 128) scales) and,
 * nvfp4 only, at ft_qtensor_scale_offset its fp32 tensor scale g; all lie inside the slot, at
 * the projection's offset. The job (ffn_impl.c) hands a kernel each row's qs, scales (from
 * ft_qrow_scales) and g.
 */
#ifndef FT_QDOT_H
#define FT_QDOT_H

#include <stdint.h>
#include <string.h>

#include "ffn.h"

#define FT_QBLOCK 32  /* the kernels' block: 32 elements (nvfp4: two scale blocks of 16) */

#define FT_FP8_TILE 128  /* fp8_e4m3's tiles: 128 x 128 elements, one fp32 scale each */

static inline int ft_is_quant(int dtype) { return dtype >= FT_Q8_0 && dtype <= FT_FP8_E4M3; }
/* What K must be a multiple of: 32, nvfp4's 16 (its kernels take a last half block), or 1
 * (fp8_e4m3's tiles may be partial, SPEC.md §9.3: its kernels take any K). */
static inline int ft_qk_multiple(int dtype) {
    return dtype == FT_NVFP4 ? 16 : (dtype == FT_FP8_E4M3 ? 1 : FT_QBLOCK);
}
/* Bytes of one row's elements: K int8 / e4m3 (q8_0, fp8_e4m3) or K / 2 bytes of nibble pairs
 * (the 4-bit types). */
static inline int64_t ft_qrow_bytes(int dtype, int64_t K) {
    return dtype == FT_Q8_0 || dtype == FT_FP8_E4M3 ? K : K / 2;
}
/* Bytes of one row's block scales (fp8_e4m3: of one tile row's, shared by its 128 rows). */
static inline int64_t ft_qrow_scale_bytes(int dtype, int64_t K) {
    if (dtype == FT_FP8_E4M3) return (K + FT_FP8_TILE - 1) / FT_FP8_TILE * 4;
    if (dtype == FT_NVFP4) return K / 16;
    return dtype == FT_MXFP4 ? K / 32 : K / 32 * 2;
}
/* Rows of scales in a [rows, K] projection. */
static inline int64_t ft_qscale_rows(int dtype, int64_t rows) {
    return dtype == FT_FP8_E4M3 ? (rows + FT_FP8_TILE - 1) / FT_FP8_TILE : rows;
}
/* The scales of row `row` of a projection with K-element rows, its scales at `scales`. */
static inline const void *ft_qrow_scales(int dtype, const uint8_t *scales, int64_t row, int64_t K) {
    if (dtype == FT_FP8_E4M3) row /= FT_FP8_TILE;
    return scales + row * ft_qrow_scale_bytes(dtype, K);
}
/* Where the scales start inside a [rows, K] projection: round_up(qs bytes, 64) (SPEC.md §9.2). */
static inline int64_t ft_qscales_offset(int dtype, int64_t rows, int64_t K) {
    return (rows * ft_qrow_bytes(dtype, K) + 63) / 64 * 64;
}
/* nvfp4: where g sits, round_up(end of the scales, 64); -1 for the other types. */
static inline int64_t ft_qtensor_scale_offset(int dtype, int64_t rows, int64_t K) {
    if (dtype != FT_NVFP4) return -1;
    return (ft_qscales_offset(dtype, rows, K) + rows * ft_qrow_scale_bytes(dtype, K) + 63) / 64 * 64;
}
/* Bytes of the whole projection (the end of its last region): ftw.quant.quant_nbytes. */
static inline int64_t ft_qproj_bytes(int dtype, int64_t rows, int64_t K) {
    if (dtype == FT_NVFP4) return ft_qtensor_scale_offset(dtype, rows, K) + 4;
    return ft_qscales_offset(dtype, rows, K) + ft_qscale_rows(dtype, rows) * ft_qrow_scale_bytes(dtype, K);
}

/* e8m0 (mxfp4's block scale): 2^(e - 127), e = 0 the subnormal 2^-127, e = 255 NaN. */
static inline float ft_e8m0_to_f32(uint8_t e) {
    uint32_t u = e == 255 ? 0x7fc00000u : (e ? (uint32_t)e << 23 : 0x00400000u);
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* e4m3 (OCP float8_e4m3fn, nvfp4's block scale and fp8_e4m3's element): exact in fp32; 0x7f /
 * 0xff NaN. */
static inline float ft_e4m3_to_f32(uint8_t c) {
    const uint32_t e = (c >> 3) & 15, m = c & 7;
    float f;
    if ((c & 0x7f) == 0x7f) {
        const uint32_t nan = 0x7fc00000u;
        memcpy(&f, &nan, 4);
    } else if (e == 0) {
        f = (float)m * 0x1p-9f;  /* subnormal: m / 8 * 2^-6 */
    } else {
        const uint32_t u = (e + 120) << 23 | m << 20;  /* (1 + m / 8) * 2^(e - 7) */
        memcpy(&f, &u, 4);
    }
    return c & 0x80 ? -f : f;
}

/* res[r * nx + j] = sum_k dequant(row r)[k] * xs[j][k] for r < nr, j < nx: ws[r] the row's qs,
 * ss[r] its block scales (ft_qrow_scales), gs[r] its projection's tensor scale g (nvfp4;
 * unread, and may be NULL, for the other types); K a multiple of ft_qk_multiple; the xs fp32 in natural
 * order. Each block's weights are dequantized once, exactly in fp32, as (element value) *
 * (block scale): q * d, (q - 8) * d, e2m1(q) * 2^(e - 127), e2m1(q) * e4m3(s); fp8_e4m3's
 * e4m3(q) * s rounds once in fp32, as SPEC.md's; nvfp4's g then
 * multiplies the row's sums (SPEC.md's (e2m1(q) * e4m3(s)) * g rounds each weight instead: a
 * relative 2^-24 apart). They are multiply-added into every input's sums; the order of a
 * (row, input) sum's additions does not depend on nr or nx. pf: software prefetch distance in
 * bytes, its low 2 bits the hint (as ft_dotn_fn's; 0: none; the generic kernel has none). */
typedef void (*ft_qdot_fn)(const void *const *ws, const void *const *ss, const float *gs, int nr,
                           int K, const float *const *xs, int nx, float *res, int pf);
/* The kernel of (isa, dtype), or NULL when dtype is not quantized. The avx512bf16 path takes
 * the avx512 kernel (its bf16 dot products have no quantized form here). */
ft_qdot_fn ft_qdot_select(int isa, int dtype);
/* The path ft_qdot_select runs for isa (what a job reports as its ISA). */
int ft_qdot_isa(int isa);

/* ---- the integer-dot path (issue 35; llama.cpp's way, no code of its) ----------------------
 * The input of a quantized projection is quantized once per call (x: per token; h: per route),
 * per 32-block: d = amax / 127 (fp32), q = round-half-even(x * (127 / amax)) (int8, |q| <= 127;
 * an all-zero block has d = 0, q = 0). Each (row, input) block is then an exact int32 dot
 * product of the weight's int8 (or nibble) codes and q, times the weight's scale and d in fp32.
 * So the results differ from the fp32 path's by the input's rounding (at most d / 2 per element;
 * the bound the tests hold it to: tests/test_quant_kernels.py).
 * nvfp4 (16-blocks, e4m3 scales, a tensor scale) and fp8_e4m3 (e4m3 elements: not integers)
 * have no integer kernel: they stay on the fp32 path.
 *
 * A quantized input of K elements (K a multiple of 32) is ft_xq_stride(K) bytes:
 *
 *   [0, K)          int8 codes, block by block; mxfp4 keeps each block's even elements first,
 *                   then its odd ones (the order its nibbles unpack in), q8_0 and q4_0 the
 *                   natural order
 *   [K, K + K/8)    fp32 d per block
 *   [K + K/8, K + K/4)  fp32 c = d * (the block's sum of codes): the vector kernels' correction
 *                   for the 4-bit types' unsigned codes (qdot8_impl.c)
 */
static inline int ft_has_qdot8(int dtype) { return dtype >= FT_Q8_0 && dtype <= FT_MXFP4; }
static inline int64_t ft_xq_stride(int64_t K) { return (K + K / 4 + 63) / 64 * 64; }

/* Blocks b0 .. b1 - 1 of the K-element fp32 input x into dst (the layout above) for dtype's
 * kernels. */
void ft_quantize_x8(const float *x, int K, int b0, int b1, int dtype, uint8_t *dst);

/* res[r * nx + j] = sum over blocks of (row r's int codes . xq[j]'s codes) * d_w * d_x, for
 * r < nr, j < nx: ws, ss, pf as ft_qdot_fn's; xq[j] quantized inputs (ft_quantize_x8 of the
 * same dtype). The order of a (row, input) sum's additions does not depend on nr or nx. */
typedef void (*ft_qdot8_fn)(const void *const *ws, const void *const *ss, int nr, int K,
                            const uint8_t *const *xq, int nx, float *res, int pf);
/* The integer kernel of (isa, dtype), or NULL where the type has none (nvfp4, unquantized).
 * avx512 and avx512bf16 take the avx512-vnni kernel where the CPU has AVX512-VNNI (and BW,
 * VL), else the avx2 one. */
ft_qdot8_fn ft_qdot8_select(int isa, int dtype);
/* The path ft_qdot8_select runs for isa: FT_ISA_AVX512 (the vnni kernel), AVX2 or GENERIC. */
int ft_qdot8_isa(int isa);
/* Whether this CPU runs the avx512-vnni integer kernels. */
int ft_qdot8_has_vnni(void);

#endif
