/* Quantized expert weights (ftw/SPEC.md §9): the dot products of q8_0 and q4_0 rows, the
 * blocks dequantized in registers (never a dequantized copy in memory).
 *
 * A quantized [rows, K] projection is its qs region (row-major, ft_qrow_bytes per row) and, at
 * ft_qscales_offset, its fp16 block scales [rows, K / 32]; both lie inside the slot, at the
 * projection's offset. The job (ffn_impl.c) hands a kernel each row's qs and scales.
 */
#ifndef FT_QDOT_H
#define FT_QDOT_H

#include <stdint.h>

#include "ffn.h"

#define FT_QBLOCK 32

static inline int ft_is_quant(int dtype) { return dtype == FT_Q8_0 || dtype == FT_Q4_0; }
/* Bytes of one row's elements: K int8 (q8_0) or K / 2 bytes of nibble pairs (q4_0). */
static inline int64_t ft_qrow_bytes(int dtype, int64_t K) { return dtype == FT_Q8_0 ? K : K / 2; }
/* Where the scales start inside a [rows, K] projection: round_up(qs bytes, 64) (SPEC.md §9.2). */
static inline int64_t ft_qscales_offset(int dtype, int64_t rows, int64_t K) {
    return (rows * ft_qrow_bytes(dtype, K) + 63) / 64 * 64;
}
/* Bytes of the whole projection (the end of its scales): ftw.quant.quant_nbytes. */
static inline int64_t ft_qproj_bytes(int dtype, int64_t rows, int64_t K) {
    return ft_qscales_offset(dtype, rows, K) + rows * (K / FT_QBLOCK) * 2;
}

/* res[r * nx + j] = sum_k dequant(row r)[k] * xs[j][k] for r < nr, j < nx: ws[r] the row's qs,
 * ss[r] its K / 32 fp16 scales; K a multiple of 32; the xs fp32 in natural order. Each block's
 * 32 weights are widened and scaled once (value q * d, or (q - 8) * d: exact in fp32) and
 * multiply-added into every input's sums; the order of a (row, input) sum's additions does not
 * depend on nr or nx. pf: software prefetch distance in bytes, its low 2 bits the hint (as
 * ft_dotn_fn's; 0: none; the generic kernel has none). */
typedef void (*ft_qdot_fn)(const void *const *ws, const uint16_t *const *ss, int nr, int K,
                           const float *const *xs, int nx, float *res, int pf);
/* The kernel of (isa, dtype), or NULL when dtype is not quantized. The avx512bf16 path takes
 * the avx512 kernel (its bf16 dot products have no quantized form here). */
ft_qdot_fn ft_qdot_select(int isa, int dtype);
/* The path ft_qdot_select runs for isa (what a job reports as its ISA). */
int ft_qdot_isa(int isa);

#endif
