/* Dot products of quantized weight rows (q8_0, q4_0, mxfp4, nvfp4, fp8_e4m3: its own kernels,
 * below the generic ones; qdot.h) with fp32 inputs,
 * one set per ISA path. Per 32-element block: widen the int8 (or the two nibbles of 16 bytes,
 * less 8; or the e2m1 codes through a 16-entry lookup) to fp32, multiply by the block's scale
 * widened to fp32 (exact: an int of at most 8 bits, or an e2m1 value, times an fp16, an e8m0 or
 * an e4m3), then multiply-add into every input's sums. So the kernel reads only the quantized
 * bytes; the arithmetic equals a dequantize-then-fp32 dot product up to the order of additions
 * (and nvfp4's g, qdot.h).
 *
 *   path      element -> fp32                               scale       multiply-add
 *   generic   scalar C (e2m1: a 16-float table)             scalar      scalar, 8 sums per input
 *   avx2      vpmovsxbd / vpmovzxbd + and, shift (8 lanes);  vcvtph2ps   vfmadd, 4 x 8 lanes per input
 *             e2m1: vpshufb of 2 * e2m1 as int8, vpmovsxbd  (fp4: table)
 *   avx512    the same at 16 lanes (avx512bf16 takes it);   vcvtph2ps   vfmadd, 4 x 16 lanes per input
 *             e2m1: vpermps of the 16 e2m1 floats            (fp4: table)
 *
 The 4-bit e2m1 types keep element 2k in the low nibble of byte k and 2k + 1 in the high one:
 * the nibbles are split (and, shift) and interleaved again (vpunpcklbw / hbw) into 16 codes in
 * element order, before the lookup. nvfp4 rows may end in a half block (K % 32 == 16: 16
 * elements, one scale), taken after the whole blocks. Each input keeps its own sums, so a
 * (row, input) result does not depend on how many rows or inputs share the call. Speeds, and
 * why the scales are widened per 8 / 16 blocks (q8_0, q4_0; the 4-bit e2m1 types are not
 * measured yet): docs/MEASUREMENTS.md#quantized-experts-on-the-cpu. Not yet here
 * (issue 35): activations quantized per block for integer dot products (llama.cpp's way; it
 * changes the results, so the fp32 path stays the oracle), several rows sharing one pass.
 */
#include <stdint.h>
#include <string.h>

#include "qdot.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define KERNEL(path, name, dt)                                                                     \
    static void qdot_##path##_##name(const void *const *ws, const void *const *ss, const float *gs, \
                                     int nr, int K, const float *const *xs, int nx, float *res,   \
                                     int pf) {                                                    \
        qdot_##path(ws, ss, gs, nr, K, xs, nx, res, pf, dt);                                      \
    }

/* e2m1 codes 0-15 (SPEC.md §9.1): the generic path's table; the avx512 path's vpermps table */
static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
/* The 4-bit types' block scales as fp32, one load each (filled once when the module loads). */
static float E8M0_F32[256], E4M3_F32[256];

__attribute__((constructor)) static void fill_scale_tables(void) {
    for (int c = 0; c < 256; c++) {
        E8M0_F32[c] = ft_e8m0_to_f32((uint8_t)c);
        E4M3_F32[c] = ft_e4m3_to_f32((uint8_t)c);
    }
}

/* Scales per 32-element block: nvfp4 has two (elements 0-15, 16-31). */
#define SPB(dt) ((dt) == FT_NVFP4 ? 2 : 1)

/* The fp32 scales of blocks b0 .. b0 + n - 1 into sf (SPB per block), each times mul, from the
 * row's scales s; m8[i] = -8 * sf[i] for q4_0. The vector paths widen whole groups of fp16
 * scales themselves and call this for the rest. */
ALWAYS_INLINE void scales_scalar(const void *s, int b0, int n, int dt, float mul, float *sf, float *m8) {
    if (dt == FT_MXFP4) {
        for (int i = 0; i < n; i++) sf[i] = E8M0_F32[((const uint8_t *)s)[b0 + i]] * mul;
    } else if (dt == FT_NVFP4) {
        for (int i = 0; i < 2 * n; i++) sf[i] = E4M3_F32[((const uint8_t *)s)[2 * b0 + i]] * mul;
    } else {
        for (int i = 0; i < n; i++) m8[i] = -8.0f * (sf[i] = ft_f16_to_f32(((const uint16_t *)s)[b0 + i]));
    }
}

/* Bytes of one block's elements. */
#define BLOCK_BYTES(dt) ((dt) == FT_Q8_0 ? FT_QBLOCK : FT_QBLOCK / 2)

/* ---- generic ---------------------------------------------------------------------------- */
/* The 32 weights of block b, sf its scale(s) */
ALWAYS_INLINE void deq_block(const uint8_t *q, const float *sf, int b, int dt, float *w) {
    const float d = sf[0];
    if (dt == FT_Q8_0) {
        const int8_t *qb = (const int8_t *)q + (size_t)b * FT_QBLOCK;
        for (int k = 0; k < FT_QBLOCK; k++) w[k] = (float)qb[k] * d;
    } else if (dt == FT_Q4_0) {  /* element k in the low nibble of byte k, element k + 16 in its high one */
        const uint8_t *qb = q + (size_t)b * (FT_QBLOCK / 2);
        for (int k = 0; k < FT_QBLOCK / 2; k++) {
            w[k] = (float)((qb[k] & 15) - 8) * d;
            w[k + 16] = (float)((qb[k] >> 4) - 8) * d;
        }
    } else {  /* e2m1: element 2k in the low nibble of byte k, 2k + 1 in its high one */
        const uint8_t *qb = q + (size_t)b * (FT_QBLOCK / 2);
        for (int k = 0; k < FT_QBLOCK / 2; k++) {
            const float dk = dt == FT_NVFP4 ? sf[k >> 3] : d;
            w[2 * k] = E2M1[qb[k] & 15] * dk;
            w[2 * k + 1] = E2M1[qb[k] >> 4] * dk;
        }
    }
}

/* One row with nx <= 4 inputs: each block dequantized once, eight sums per input. */
ALWAYS_INLINE void qgeneric_core(const uint8_t *q, const void *s, float g, int K, const float *const *xs,
                                 float *res, const int nx, int dt) {
    float acc[4][8] = {{0}};
    for (int b = 0; b < K / FT_QBLOCK; b++) {
        float w[FT_QBLOCK], sf[2], m8[1];
        scales_scalar(s, b, 1, dt, 1.0f, sf, m8);
        deq_block(q, sf, b, dt, w);
        for (int j = 0; j < nx; j++) {
            const float *x = xs[j] + (size_t)b * FT_QBLOCK;
            for (int k = 0; k < FT_QBLOCK; k++) acc[j][k & 7] += w[k] * x[k];
        }
    }
    if (dt == FT_NVFP4 && (K & 16)) {  /* the last half block: 16 elements, one scale */
        const int b = K / FT_QBLOCK;
        const uint8_t *qb = q + (size_t)b * (FT_QBLOCK / 2);
        const float d = E4M3_F32[((const uint8_t *)s)[2 * b]];
        for (int j = 0; j < nx; j++) {
            const float *x = xs[j] + (size_t)b * FT_QBLOCK;
            for (int k = 0; k < 8; k++) {
                acc[j][(2 * k) & 7] += E2M1[qb[k] & 15] * d * x[2 * k];
                acc[j][(2 * k + 1) & 7] += E2M1[qb[k] >> 4] * d * x[2 * k + 1];
            }
        }
    }
    for (int j = 0; j < nx; j++) {
        const float *a = acc[j];
        res[j] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
        if (dt == FT_NVFP4) res[j] *= g;
    }
}

ALWAYS_INLINE void qdot_generic(const void *const *ws, const void *const *ss, const float *gs, int nr,
                                int K, const float *const *xs, int nx, float *res, int pf, int dt) {
    (void)pf;  /* no prefetch */
    for (int r = 0; r < nr; r++) {
        const uint8_t *q = (const uint8_t *)ws[r];
        const float g = dt == FT_NVFP4 ? gs[r] : 1.0f;
        for (int j = 0; j < nx; j += 4) {
            const int n = nx - j < 4 ? nx - j : 4;
            float *out = res + r * nx + j;
            switch (n) {  /* a constant group size: the sums stay in registers */
            case 4: qgeneric_core(q, ss[r], g, K, xs + j, out, 4, dt); break;
            case 3: qgeneric_core(q, ss[r], g, K, xs + j, out, 3, dt); break;
            case 2: qgeneric_core(q, ss[r], g, K, xs + j, out, 2, dt); break;
            default: qgeneric_core(q, ss[r], g, K, xs + j, out, 1, dt); break;
            }
        }
    }
}

KERNEL(generic, q8_0, FT_Q8_0)
KERNEL(generic, q4_0, FT_Q4_0)
KERNEL(generic, mxfp4, FT_MXFP4)
KERNEL(generic, nvfp4, FT_NVFP4)

/* ---- fp8_e4m3 (every path) --------------------------------------------------------------
 * A row is K e4m3 bytes (any K) in tiles of 128 columns, ss[r] the row's tile scales (fp32, one
 * per 128 columns, shared by the 128 rows of its tile row): w = e4m3(q) * s, rounded once in
 * fp32 as ftw.quant's. The generic path looks e4m3 up in E4M3_F32. The vector paths widen 16
 * codes at a time to fp16 bits (the sign to bit 15, exponent and mantissa shifted up by 7: the
 * e4m3 value / 2^8, subnormals as fp16 subnormals; codes 0x7f / 0xff made fp16 NaNs), vcvtph2ps
 * them (exact) and multiply by s * 2^8 (exact: a power of two), so each weight is the same
 * single rounding of e4m3(q) * s; a tile's last K % 16 columns are scalar, into their own sums. */
ALWAYS_INLINE void fp8_generic_core(const uint8_t *q, const float *s, int K, const float *const *xs,
                                    float *res, const int nx) {
    float acc[4][8] = {{0}};
    for (int k0 = 0; k0 < K; k0 += FT_FP8_TILE) {
        const float d = s[k0 / FT_FP8_TILE];
        const int k1 = K - k0 < FT_FP8_TILE ? K : k0 + FT_FP8_TILE;
        for (int k = k0; k < k1; k++) {
            const float w = E4M3_F32[q[k]] * d;
            for (int j = 0; j < nx; j++) acc[j][k & 7] += w * xs[j][k];
        }
    }
    for (int j = 0; j < nx; j++) {
        const float *a = acc[j];
        res[j] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    }
}

static void qdot_generic_fp8_e4m3(const void *const *ws, const void *const *ss, const float *gs, int nr,
                                  int K, const float *const *xs, int nx, float *res, int pf) {
    (void)gs; (void)pf;
    for (int r = 0; r < nr; r++) {
        const uint8_t *q = (const uint8_t *)ws[r];
        const float *s = (const float *)ss[r];
        for (int j = 0; j < nx; j += 4) {
            float *out = res + r * nx + j;
            switch (nx - j < 4 ? nx - j : 4) {
            case 4: fp8_generic_core(q, s, K, xs + j, out, 4); break;
            case 3: fp8_generic_core(q, s, K, xs + j, out, 3); break;
            case 2: fp8_generic_core(q, s, K, xs + j, out, 2); break;
            default: fp8_generic_core(q, s, K, xs + j, out, 1); break;
            }
        }
    }
}

#if defined(__x86_64__)
#include <immintrin.h>

/* Software prefetch of the row's elements pf bytes ahead of block b (pf: bytes, the low 2 bits
 * the hint, 1: into L2, else L1; 0: none), once per 64 bytes. Past the row's end it reaches
 * the next row of the projection, the one the job's next pass takes. */
ALWAYS_INLINE void qprefetch(const uint8_t *q, int b, int pf, int dt) {
    const int bb = BLOCK_BYTES(dt);
    if (pf <= 0 || (b * bb) & 63) return;
    const char *p = (const char *)q + (size_t)b * bb + (pf & ~3);
    if ((pf & 3) == 1) _mm_prefetch(p, _MM_HINT_T1);
    else _mm_prefetch(p, _MM_HINT_T0);
}

/* The 32 e2m1 codes of a 4-bit block (16 bytes, pairs) in element order: *lo16 elements 0-15,
 * *hi16 elements 16-31, one code per byte (SSE2 only: any x86_64). */
ALWAYS_INLINE void e2m1_codes(const uint8_t *qb, __m128i *lo16, __m128i *hi16) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qb), m4 = _mm_set1_epi8(15);
    const __m128i even = _mm_and_si128(raw, m4), odd = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
    *lo16 = _mm_unpacklo_epi8(even, odd);
    *hi16 = _mm_unpackhi_epi8(even, odd);
}

/* The 16 e2m1 codes of nvfp4's last half block (8 bytes) in element order, one per byte. */
ALWAYS_INLINE __m128i e2m1_codes_half(const uint8_t *qb) {
    const __m128i raw = _mm_loadl_epi64((const __m128i *)qb), m4 = _mm_set1_epi8(15);
    return _mm_unpacklo_epi8(_mm_and_si128(raw, m4), _mm_and_si128(_mm_srli_epi16(raw, 4), m4));
}

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

/* ---- avx2 ------------------------------------------------------------------------------- */
/* The 32 weights of block b as four vectors of 8 (elements 0-7, 8-15, 16-23, 24-31); sf / m8
 * point at the block's scale(s) d and -8 d, as fp32. q8_0, q4_0: widened straight from memory
 * (vpmovsxbd / vpmovzxbd with a load operand); q4_0's (q - 8) * d is one FMA, q * d - 8 * d:
 * exact, as the product is. e2m1: vpshufb looks the codes up as 2 * e2m1 (int8: 0, 1, 2, 3, 4,
 * 6, 8, 12 and negated), so sf holds d / 2 (exact): 2 * e2m1 * (d / 2) = e2m1 * d. */
ALWAYS_INLINE void deq_avx2(const uint8_t *q, const float *sf, const float *m8, int b, int dt,
                            __m256 w[4]) {
    const __m256 d = _mm256_broadcast_ss(sf);
    if (dt == FT_Q8_0) {
        const uint8_t *qb = q + (size_t)b * FT_QBLOCK;
        for (int v = 0; v < 4; v++)
            w[v] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                       _mm_loadl_epi64((const __m128i *)(qb + 8 * v)))), d);
    } else if (dt == FT_Q4_0) {  /* bytes 0-7 hold elements 0-7 (low nibbles) and 16-23 (high); bytes 8-15 the rest */
        const uint8_t *qb = q + (size_t)b * (FT_QBLOCK / 2);
        const __m256i m = _mm256_set1_epi32(15);
        const __m256 m8d = _mm256_broadcast_ss(m8);
        const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qb));
        const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qb + 8)));
        w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(a, m)), d, m8d);
        w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c, m)), d, m8d);
        w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), d, m8d);
        w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4)), d, m8d);
    } else {
        const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
        const __m256 d1 = dt == FT_NVFP4 ? _mm256_broadcast_ss(sf + 1) : d;
        __m128i a, c;
        e2m1_codes(q + (size_t)b * (FT_QBLOCK / 2), &a, &c);
        a = _mm_shuffle_epi8(lut, a);
        c = _mm_shuffle_epi8(lut, c);
        w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a)), d);
        w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(a, a))), d);
        w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), d1);
        w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(c, c))), d1);
    }
}

ALWAYS_INLINE float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One row with nx (1 or 2) inputs: four independent FMA chains per input (one per vector of
 * the block), so a block's four FMAs do not wait on each other. */
ALWAYS_INLINE void qavx2_core(const uint8_t *q, const void *s, float g, int K, const float *const *xs,
                              float *res, int pf, const int nx, const int dt) {
    __m256 acc[2][4];
    for (int j = 0; j < nx; j++)
        for (int v = 0; v < 4; v++) acc[j][v] = _mm256_setzero_ps();
    const int nb = K / FT_QBLOCK;
    for (int b0 = 0; b0 < nb; b0 += 8) {
        float sf[16], m8[8];
        const int n = nb - b0 < 8 ? nb - b0 : 8;
        if (n == 8 && (dt == FT_Q8_0 || dt == FT_Q4_0)) {  /* 8 fp16 scales widened at once */
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)s + b0)));
            _mm256_storeu_ps(sf, d);
            _mm256_storeu_ps(m8, _mm256_mul_ps(d, _mm256_set1_ps(-8.0f)));
        } else {
            scales_scalar(s, b0, n, dt, dt == FT_MXFP4 || dt == FT_NVFP4 ? 0.5f : 1.0f, sf, m8);
        }
        for (int i = 0; i < n; i++) {
            const int b = b0 + i;
            __m256 w[4];
            qprefetch(q, b, pf, dt);
            deq_avx2(q, sf + SPB(dt) * i, m8 + i, b, dt, w);
            for (int j = 0; j < nx; j++) {
                const float *x = xs[j] + (size_t)b * FT_QBLOCK;
                for (int v = 0; v < 4; v++)
                    acc[j][v] = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(x + 8 * v), acc[j][v]);
            }
        }
    }
    if (dt == FT_NVFP4 && (K & 16)) {  /* the last half block: 16 elements, one scale */
        const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
        const __m256 hd = _mm256_set1_ps(0.5f * E4M3_F32[((const uint8_t *)s)[2 * nb]]);
        const __m128i a = _mm_shuffle_epi8(lut, e2m1_codes_half(q + (size_t)nb * (FT_QBLOCK / 2)));
        const __m256 w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a)), hd);
        const __m256 w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(a, a))), hd);
        for (int j = 0; j < nx; j++) {
            const float *x = xs[j] + (size_t)nb * FT_QBLOCK;
            acc[j][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), acc[j][1]);
        }
    }
    for (int j = 0; j < nx; j++) {
        res[j] = hsum256(_mm256_add_ps(_mm256_add_ps(acc[j][0], acc[j][1]),
                                       _mm256_add_ps(acc[j][2], acc[j][3])));
        if (dt == FT_NVFP4) res[j] *= g;
    }
}

ALWAYS_INLINE void qdot_avx2(const void *const *ws, const void *const *ss, const float *gs, int nr,
                             int K, const float *const *xs, int nx, float *res, int pf, const int dt) {
    for (int r = 0; r < nr; r++) {
        const uint8_t *q = (const uint8_t *)ws[r];
        const float g = dt == FT_NVFP4 ? gs[r] : 1.0f;
        int j = 0;
        for (; j + 2 <= nx; j += 2) qavx2_core(q, ss[r], g, K, xs + j, res + r * nx + j, j ? 0 : pf, 2, dt);
        if (j < nx) qavx2_core(q, ss[r], g, K, xs + j, res + r * nx + j, j ? 0 : pf, 1, dt);
    }
}

KERNEL(avx2, q8_0, FT_Q8_0)
KERNEL(avx2, q4_0, FT_Q4_0)
KERNEL(avx2, mxfp4, FT_MXFP4)
KERNEL(avx2, nvfp4, FT_NVFP4)

/* The 16 fp16 words of 16 e4m3 codes at p (the fp8_e4m3 comment above). */
ALWAYS_INLINE __m256i fp8_to_f16x16(const uint8_t *p) {
    const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i em = _mm256_and_si256(c, _mm256_set1_epi16(0x7f));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(em, 7),
                                      _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x80)), 8));
    const __m256i nan = _mm256_cmpeq_epi16(em, _mm256_set1_epi16(0x7f));
    return _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7e00)));
}

ALWAYS_INLINE void fp8_prefetch(const uint8_t *q, int k, int pf) {
    if (pf <= 0 || (k & 63)) return;
    const char *p = (const char *)q + k + (pf & ~3);
    if ((pf & 3) == 1) _mm_prefetch(p, _MM_HINT_T1);
    else _mm_prefetch(p, _MM_HINT_T0);
}

/* One row with nx (1 or 2) inputs: 32 columns a step in four FMA chains per input. */
ALWAYS_INLINE void fp8_avx2_core(const uint8_t *q, const float *s, int K, const float *const *xs,
                                 float *res, int pf, const int nx) {
    __m256 acc[2][4];
    float tail[2] = {0.0f, 0.0f};
    for (int j = 0; j < nx; j++)
        for (int v = 0; v < 4; v++) acc[j][v] = _mm256_setzero_ps();
    for (int k0 = 0; k0 < K; k0 += FT_FP8_TILE) {
        const float d = s[k0 / FT_FP8_TILE];
        const __m256 d256 = _mm256_set1_ps(d * 256.0f);
        const int k1 = K - k0 < FT_FP8_TILE ? K : k0 + FT_FP8_TILE;
        int k = k0;
        for (; k + 32 <= k1; k += 32) {
            fp8_prefetch(q, k, pf);
            const __m256i a = fp8_to_f16x16(q + k), b = fp8_to_f16x16(q + k + 16);
            const __m256 w[4] = {_mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(a)), d256),
                                 _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(a, 1)), d256),
                                 _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(b)), d256),
                                 _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(b, 1)), d256)};
            for (int j = 0; j < nx; j++)
                for (int v = 0; v < 4; v++)
                    acc[j][v] = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(xs[j] + k + 8 * v), acc[j][v]);
        }
        if (k + 16 <= k1) {
            const __m256i a = fp8_to_f16x16(q + k);
            const __m256 w0 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(a)), d256);
            const __m256 w1 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(a, 1)), d256);
            for (int j = 0; j < nx; j++) {
                acc[j][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xs[j] + k), acc[j][0]);
                acc[j][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xs[j] + k + 8), acc[j][1]);
            }
            k += 16;
        }
        for (; k < k1; k++) {
            const float w = E4M3_F32[q[k]] * d;
            for (int j = 0; j < nx; j++) tail[j] += w * xs[j][k];
        }
    }
    for (int j = 0; j < nx; j++)
        res[j] = hsum256(_mm256_add_ps(_mm256_add_ps(acc[j][0], acc[j][1]),
                                       _mm256_add_ps(acc[j][2], acc[j][3]))) + tail[j];
}

static void qdot_avx2_fp8_e4m3(const void *const *ws, const void *const *ss, const float *gs, int nr,
                               int K, const float *const *xs, int nx, float *res, int pf) {
    (void)gs;
    for (int r = 0; r < nr; r++) {
        const uint8_t *q = (const uint8_t *)ws[r];
        const float *s = (const float *)ss[r];
        int j = 0;
        for (; j + 2 <= nx; j += 2) fp8_avx2_core(q, s, K, xs + j, res + r * nx + j, j ? 0 : pf, 2);
        if (j < nx) fp8_avx2_core(q, s, K, xs + j, res + r * nx + j, j ? 0 : pf, 1);
    }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,f16c")
#endif

/* ---- avx512 ----------------------------------------------------------------------------- */
/* The 32 weights of block b as two vectors of 16 (elements 0-15, 16-31); q4_0's 16 bytes
 * widen once, the low nibbles are elements 0-15 and the high ones 16-31. e2m1: the codes in
 * element order, widened to 32 bits, index a vpermps of the 16 e2m1 values (exact), times the
 * scale (nvfp4: elements 16-31 take the block's second). sf, m8: as avx2's (sf not halved). */
ALWAYS_INLINE void deq_avx512(const uint8_t *q, const float *sf, const float *m8, int b, int dt,
                              __m512 w[2]) {
    const __m512 d = _mm512_set1_ps(*sf);
    if (dt == FT_Q8_0) {
        const uint8_t *qb = q + (size_t)b * FT_QBLOCK;
        for (int v = 0; v < 2; v++)
            w[v] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                       _mm_loadu_si128((const __m128i *)(qb + 16 * v)))), d);
    } else if (dt == FT_Q4_0) {
        const __m512 m8d = _mm512_set1_ps(*m8);
        const uint8_t *qb = q + (size_t)b * (FT_QBLOCK / 2);
        const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qb));
        w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(a, _mm512_set1_epi32(15))), d, m8d);
        w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(a, 4)), d, m8d);
    } else {
        const __m512 lut = _mm512_loadu_ps(E2M1);
        const __m512 d1 = dt == FT_NVFP4 ? _mm512_set1_ps(sf[1]) : d;
        __m128i a, c;
        e2m1_codes(q + (size_t)b * (FT_QBLOCK / 2), &a, &c);
        w[0] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(a), lut), d);
        w[1] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(c), lut), d1);
    }
}

/* One row with nx (1 or 2) inputs: four FMA chains per input, the even blocks' two vectors
 * in two of them and the odd blocks' in the other two. */
ALWAYS_INLINE void qavx512_core(const uint8_t *q, const void *s, float g, int K, const float *const *xs,
                                float *res, int pf, const int nx, const int dt) {
    __m512 acc[2][4];
    for (int j = 0; j < nx; j++)
        for (int v = 0; v < 4; v++) acc[j][v] = _mm512_setzero_ps();
    const int nb = K / FT_QBLOCK;
    for (int b0 = 0; b0 < nb; b0 += 16) {
        float sf[32], m8[16];
        const int n = nb - b0 < 16 ? nb - b0 : 16;
        if (n == 16 && (dt == FT_Q8_0 || dt == FT_Q4_0)) {  /* 16 fp16 scales widened at once */
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)s + b0)));
            _mm512_storeu_ps(sf, d);
            _mm512_storeu_ps(m8, _mm512_mul_ps(d, _mm512_set1_ps(-8.0f)));
        } else {
            scales_scalar(s, b0, n, dt, 1.0f, sf, m8);
        }
        for (int i = 0; i < n; i += 2) {  /* the chains by constant index: acc stays in registers */
            for (int c = 0; c < 4 && i + c / 2 < n; c += 2) {
                const int b = b0 + i + c / 2;
                __m512 w[2];
                qprefetch(q, b, pf, dt);
                deq_avx512(q, sf + SPB(dt) * (i + c / 2), m8 + i + c / 2, b, dt, w);
                for (int j = 0; j < nx; j++) {
                    const float *x = xs[j] + (size_t)b * FT_QBLOCK;
                    acc[j][c] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(x), acc[j][c]);
                    acc[j][c + 1] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(x + 16), acc[j][c + 1]);
                }
            }
        }
    }
    if (dt == FT_NVFP4 && (K & 16)) {  /* the last half block: 16 elements, one scale */
        const __m512 d = _mm512_set1_ps(E4M3_F32[((const uint8_t *)s)[2 * nb]]);
        const __m128i a = e2m1_codes_half(q + (size_t)nb * (FT_QBLOCK / 2));
        const __m512 w0 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(a), _mm512_loadu_ps(E2M1)), d);
        for (int j = 0; j < nx; j++)
            acc[j][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xs[j] + (size_t)nb * FT_QBLOCK), acc[j][0]);
    }
    for (int j = 0; j < nx; j++) {
        res[j] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[j][0], acc[j][1]),
                                                    _mm512_add_ps(acc[j][2], acc[j][3])));
        if (dt == FT_NVFP4) res[j] *= g;
    }
}

ALWAYS_INLINE void qdot_avx512(const void *const *ws, const void *const *ss, const float *gs, int nr,
                               int K, const float *const *xs, int nx, float *res, int pf, const int dt) {
    for (int r = 0; r < nr; r++) {
        const uint8_t *q = (const uint8_t *)ws[r];
        const float g = dt == FT_NVFP4 ? gs[r] : 1.0f;
        int j = 0;
        for (; j + 2 <= nx; j += 2) qavx512_core(q, ss[r], g, K, xs + j, res + r * nx + j, j ? 0 : pf, 2, dt);
        if (j < nx) qavx512_core(q, ss[r], g, K, xs + j, res + r * nx + j, j ? 0 : pf, 1, dt);
    }
}

KERNEL(avx512, q8_0, FT_Q8_0)
KERNEL(avx512, q4_0, FT_Q4_0)
KERNEL(avx512, mxfp4, FT_MXFP4)
KERNEL(avx512, nvfp4, FT_NVFP4)

/* 16 e4m3 codes at p as fp32 times d256 (= s * 2^8; the fp8_e4m3 comment above). */
ALWAYS_INLINE __m512 fp8_deq16_avx512(const uint8_t *p, __m512 d256) {
    const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i em = _mm256_and_si256(c, _mm256_set1_epi16(0x7f));
    __m256i h = _mm256_or_si256(_mm256_slli_epi16(em, 7),
                                _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x80)), 8));
    h = _mm256_or_si256(h, _mm256_and_si256(_mm256_cmpeq_epi16(em, _mm256_set1_epi16(0x7f)),
                                            _mm256_set1_epi16(0x7e00)));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), d256);
}

/* One row with nx (1 or 2) inputs: 64 columns a step in four FMA chains per input. */
ALWAYS_INLINE void fp8_avx512_core(const uint8_t *q, const float *s, int K, const float *const *xs,
                                   float *res, int pf, const int nx) {
    __m512 acc[2][4];
    float tail[2] = {0.0f, 0.0f};
    for (int j = 0; j < nx; j++)
        for (int v = 0; v < 4; v++) acc[j][v] = _mm512_setzero_ps();
    for (int k0 = 0; k0 < K; k0 += FT_FP8_TILE) {
        const float d = s[k0 / FT_FP8_TILE];
        const __m512 d256 = _mm512_set1_ps(d * 256.0f);
        const int k1 = K - k0 < FT_FP8_TILE ? K : k0 + FT_FP8_TILE;
        int k = k0;
        for (; k + 64 <= k1; k += 64) {
            if (pf > 0) {
                const char *p = (const char *)q + k + (pf & ~3);
                if ((pf & 3) == 1) _mm_prefetch(p, _MM_HINT_T1);
                else _mm_prefetch(p, _MM_HINT_T0);
            }
            __m512 w[4];
            for (int v = 0; v < 4; v++) w[v] = fp8_deq16_avx512(q + k + 16 * v, d256);
            for (int j = 0; j < nx; j++)
                for (int v = 0; v < 4; v++)
                    acc[j][v] = _mm512_fmadd_ps(w[v], _mm512_loadu_ps(xs[j] + k + 16 * v), acc[j][v]);
        }
        for (; k + 16 <= k1; k += 16) {
            const __m512 w = fp8_deq16_avx512(q + k, d256);
            for (int j = 0; j < nx; j++) acc[j][0] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xs[j] + k), acc[j][0]);
        }
        for (; k < k1; k++) {
            const float w = E4M3_F32[q[k]] * d;
            for (int j = 0; j < nx; j++) tail[j] += w * xs[j][k];
        }
    }
    for (int j = 0; j < nx; j++)
        res[j] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[j][0], acc[j][1]),
                                                    _mm512_add_ps(acc[j][2], acc[j][3]))) + tail[j];
}

static void qdot_avx512_fp8_e4m3(const void *const *ws, const void *const *ss, const float *gs, int nr,
                                 int K, const float *const *xs, int nx, float *res, int pf) {
    (void)gs;
    for (int r = 0; r < nr; r++) {
        const uint8_t *q = (const uint8_t *)ws[r];
        const float *s = (const float *)ss[r];
        int j = 0;
        for (; j + 2 <= nx; j += 2) fp8_avx512_core(q, s, K, xs + j, res + r * nx + j, j ? 0 : pf, 2);
        if (j < nx) fp8_avx512_core(q, s, K, xs + j, res + r * nx + j, j ? 0 : pf, 1);
    }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif /* __x86_64__ */

int ft_qdot_isa(int isa) {
    /* the avx512bf16 path has no use for its bf16 dot here: the avx512 kernel */
    if (isa >= FT_ISA_AVX512 && ft_isa_supported(FT_ISA_AVX512)) return FT_ISA_AVX512;
    return isa >= FT_ISA_AVX2 && ft_isa_supported(FT_ISA_AVX2) ? FT_ISA_AVX2 : FT_ISA_GENERIC;
}

ft_qdot_fn ft_qdot_select(int isa, int dtype) {
    if (!ft_is_quant(dtype)) return 0;
    const int k = dtype - FT_Q8_0;  /* q8_0, q4_0, mxfp4, nvfp4, fp8_e4m3 */
#if defined(__x86_64__)
    static const ft_qdot_fn avx512[5] = {qdot_avx512_q8_0, qdot_avx512_q4_0, qdot_avx512_mxfp4,
                                         qdot_avx512_nvfp4, qdot_avx512_fp8_e4m3};
    static const ft_qdot_fn avx2[5] = {qdot_avx2_q8_0, qdot_avx2_q4_0, qdot_avx2_mxfp4, qdot_avx2_nvfp4,
                                       qdot_avx2_fp8_e4m3};
    const int path = ft_qdot_isa(isa);
    if (path == FT_ISA_AVX512) return avx512[k];
    if (path == FT_ISA_AVX2) return avx2[k];
#endif
    (void)isa;
    static const ft_qdot_fn generic[5] = {qdot_generic_q8_0, qdot_generic_q4_0, qdot_generic_mxfp4,
                                          qdot_generic_nvfp4, qdot_generic_fp8_e4m3};
    return generic[k];
}
