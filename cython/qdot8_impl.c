/* Integer dot products of quantized weight rows (q8_0, q4_0, mxfp4) with inputs quantized per
 * 32-block to int8 (qdot.h: the layout, the rounding, the error against the fp32 path of
 * qdot_impl.c, which stays the oracle). Per (row, input, block): the weight's 32 codes as
 * signed int8 (q8_0 as stored; q4_0 nibble - 8; mxfp4 2 * e2m1 through a 16-entry table, so
 * its scale is e8m0 / 2, exact), an exact int32 dot product with the input's codes, then one
 * fp32 multiply-add by d_w * d_x.
 *
 *   path         int8 x int8 -> int32                                 per block, per input
 *   generic      scalar C, signed codes                               1 cvt, 1 fma
 *   avx2         q8_0: |w| as u8 (vpabsb), x signed by w (vpsignb);   8 int32 lanes, vcvtdq2ps,
 *                4-bit: the codes + BIAS as u8, x as it is;           vfmadd by d_w * d_x
 *                vpmaddubsw then vpmaddwd by ones                     (8 blocks' at once)
 *   avx512-vnni  two blocks per 64 bytes, the operands as avx2's      16 lanes (8 per block),
 *                (q8_0: x negated where w < 0, a vpmovb2m mask),      the two blocks' d_w * d_x
 *                vpdpbusd                                             by vpermps
 *
 * The 4-bit types' unsigned codes (q4_0's nibble, mxfp4's 2 * e2m1 + 12) spare the vector
 * kernels the sign trick per input: the row's sum is then less BIAS times the sum over blocks
 * of d_w * c_x, c_x = d_x * (the input block's code sum), kept with the input (qdot.h), one
 * multiply-add per 8 (16) blocks; exact in the integers, a rounding of fp32 in the sums.
 *
 * The 4-bit types unpack a block's 16 bytes as low nibbles then high ones: q4_0's natural
 * order (elements 0-15, 16-31), mxfp4's even elements then odd ones, which is why the input of
 * an mxfp4 projection keeps that order (ft_quantize_x8). Each input keeps its own sums, so a
 * (row, input) result does not depend on how many rows or inputs share the call. nvfp4 has no
 * integer kernel here (16-blocks with their own e4m3 scales and a tensor scale: two partial
 * sums per 32-block would fit the lanes, not measured yet). Speeds:
 * docs/MEASUREMENTS.md#quantized-experts-on-the-cpu.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "qdot.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define KERNEL8(path, name, dt)                                                                     \
    static void qdot8_##path##_##name(const void *const *ws, const void *const *ss, int nr, int K,    \
                                      const uint8_t *const *xq, int nx, float *res, int pf) {     \
        qdot8_##path(ws, ss, nr, K, xq, nx, res, pf, dt);                                         \
    }

/* 2 * e2m1 of codes 0-15 as int8 (SPEC.md §9.1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negated) */
static const int8_t E2M1X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
/* the same plus 12 (0..24): the unsigned codes of the avx2 and avx512-vnni kernels */
static const uint8_t E2M1X2_U[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
/* What the vector kernels add to the 4-bit types' codes to make them unsigned (q8_0: none, it
 * takes the sign trick). */
#define BIAS(dt) ((dt) == FT_Q4_0 ? 8 : (dt) == FT_MXFP4 ? 12 : 0)
/* mxfp4's e8m0 block scales / 2 (the codes are 2 * e2m1), filled once when the module loads */
static float E8M0_HALF[256];

__attribute__((constructor)) static void fill_e8m0_half(void) {
    for (int c = 0; c < 256; c++) E8M0_HALF[c] = ft_e8m0_to_f32((uint8_t)c) * 0.5f;
}

static inline const float *xq_scales(const uint8_t *xq, int K) { return (const float *)(xq + K); }

void ft_quantize_x8(const float *x, int K, int b0, int b1, int dtype, uint8_t *dst) {
    float *d = (float *)(dst + K);
    for (int b = b0; b < b1; b++) {
        const float *xb = x + (size_t)b * FT_QBLOCK;
        int8_t *q = (int8_t *)dst + (size_t)b * FT_QBLOCK;
        float amax = 0.0f;
        for (int k = 0; k < FT_QBLOCK; k++) amax = fmaxf(amax, fabsf(xb[k]));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int k = 0; k < FT_QBLOCK; k++) {
            const int src = dtype == FT_MXFP4 ? (k < 16 ? 2 * k : 2 * (k - 16) + 1) : k;
            const int v = (int)nearbyintf(xb[src] * id);  /* round half to even: |q| <= 127 */
            q[k] = (int8_t)v;
            sum += v;
        }
        d[b] = amax / 127.0f;
        d[K / FT_QBLOCK + b] = d[b] * (float)sum;
    }
}

/* The fp32 scales of a row's blocks b0 .. b0 + n - 1 (mxfp4: e8m0 / 2). */
ALWAYS_INLINE void wscales(const void *s, int b0, int n, int dt, float *sw) {
    if (dt == FT_MXFP4)
        for (int i = 0; i < n; i++) sw[i] = E8M0_HALF[((const uint8_t *)s)[b0 + i]];
    else
        for (int i = 0; i < n; i++) sw[i] = ft_f16_to_f32(((const uint16_t *)s)[b0 + i]);
}

/* ---- generic ---------------------------------------------------------------------------- */
ALWAYS_INLINE void codes_scalar(const uint8_t *q, int b, int dt, int8_t *w) {
    if (dt == FT_Q8_0) {
        memcpy(w, q + (size_t)b * FT_QBLOCK, FT_QBLOCK);
        return;
    }
    const uint8_t *qb = q + (size_t)b * (FT_QBLOCK / 2);
    for (int k = 0; k < FT_QBLOCK / 2; k++) {
        w[k] = dt == FT_Q4_0 ? (int8_t)((qb[k] & 15) - 8) : E2M1X2[qb[k] & 15];
        w[k + 16] = dt == FT_Q4_0 ? (int8_t)((qb[k] >> 4) - 8) : E2M1X2[qb[k] >> 4];
    }
}

ALWAYS_INLINE void qdot8_generic(const void *const *ws, const void *const *ss, int nr, int K,
                                 const uint8_t *const *xq, int nx, float *res, int pf, int dt) {
    (void)pf;
    for (int r = 0; r < nr; r++) {
        const uint8_t *q = (const uint8_t *)ws[r];
        for (int j = 0; j < nx; j++) {
            const int8_t *xc = (const int8_t *)xq[j];
            const float *xd = xq_scales(xq[j], K);
            float acc = 0.0f;
            for (int b = 0; b < K / FT_QBLOCK; b++) {
                int8_t w[FT_QBLOCK];
                float sw;
                codes_scalar(q, b, dt, w);
                wscales(ss[r], b, 1, dt, &sw);
                int32_t isum = 0;
                for (int k = 0; k < FT_QBLOCK; k++) isum += (int32_t)w[k] * xc[b * FT_QBLOCK + k];
                acc += (float)isum * (sw * xd[b]);
            }
            res[r * nx + j] = acc;
        }
    }
}

KERNEL8(generic, q8_0, FT_Q8_0)
KERNEL8(generic, q4_0, FT_Q4_0)
KERNEL8(generic, mxfp4, FT_MXFP4)

#if defined(__x86_64__)
#include <immintrin.h>

/* Software prefetch as qdot_impl.c's: pf bytes ahead (low 2 bits the hint), once per 64 bytes. */
ALWAYS_INLINE void q8prefetch(const uint8_t *q, int b, int pf, int dt) {
    const int bb = dt == FT_Q8_0 ? FT_QBLOCK : FT_QBLOCK / 2;
    if (pf <= 0 || (b * bb) & 63) return;
    const char *p = (const char *)q + (size_t)b * bb + (pf & ~3);
    if ((pf & 3) == 1) _mm_prefetch(p, _MM_HINT_T1);
    else _mm_prefetch(p, _MM_HINT_T0);
}

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

/* ---- avx2 ------------------------------------------------------------------------------- */
/* Block b's 32 codes in the order of the input's codes: q8_0 signed (as stored); q4_0 its
 * nibbles and mxfp4 2 * e2m1 + 12 through the table, unsigned (0..15, 0..24): the operand
 * vpmaddubsw takes unsigned as it is, and the kernel subtracts BIAS(dt) * (the input block's
 * code sum) afterwards (the input's c = d * sum, qdot.h), which saves the sign trick's vpsignb
 * per input. */
ALWAYS_INLINE __m256i codes_avx2(const uint8_t *q, int b, int dt) {
    if (dt == FT_Q8_0) return _mm256_loadu_si256((const __m256i *)(q + (size_t)b * FT_QBLOCK));
    /* the 16 bytes in both lanes by the load port (no lane insert), the upper lane's shifted */
    const __m256i r = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(q + (size_t)b * (FT_QBLOCK / 2))));
    const __m256i n = _mm256_and_si256(_mm256_blend_epi32(r, _mm256_srli_epi16(r, 4), 0xF0), _mm256_set1_epi8(15));
    if (dt == FT_Q4_0) return n;
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)E2M1X2_U)), n);
}

/* One block into the sums acc[0..nx-1]: w its codes (codes_avx2), pr[j][i] d_w * d_x. q8_0:
 * |w| as u8 times x signed by w (vpmaddubsw's pairs at most 2 * 128 * 127: never saturates);
 * the 4-bit types: the unsigned codes times x (at most 2 * 24 * 127). */
ALWAYS_INLINE void block_avx2(__m256i w, int i, int b, const uint8_t *const *xq, float pr[][8],
                              __m256 *acc, const int nx, const int dt) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i aw = dt == FT_Q8_0 ? _mm256_abs_epi8(w) : w;
    for (int j = 0; j < nx; j++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq[j] + (size_t)b * FT_QBLOCK));
        const __m256i p = _mm256_madd_epi16(
            _mm256_maddubs_epi16(aw, dt == FT_Q8_0 ? _mm256_sign_epi8(x, w) : x), ones);
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&pr[j][i]), acc[j]);
    }
}

/* 8 e8m0 codes as fp32, halved (E8M0_HALF's values): the code shifted into the exponent,
 * 0 the subnormal 2^-127, 255 NaN. */
ALWAYS_INLINE __m256 e8m0_half8(const uint8_t *s) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)s));
    __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
    f = _mm256_blendv_ps(f, _mm256_castsi256_ps(_mm256_set1_epi32(0x00400000)),
                         _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, _mm256_setzero_si256())));
    f = _mm256_blendv_ps(f, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                         _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, _mm256_set1_epi32(255))));
    return _mm256_mul_ps(f, _mm256_set1_ps(0.5f));
}

ALWAYS_INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One row, nx <= 4 inputs: per 8 blocks the products d_w * d_x of each input (and the 4-bit
 * types' correction sums d_w * c_x), then two chains per input (even and odd blocks). */
ALWAYS_INLINE void q8avx2_core(const uint8_t *q, const void *s, int K, const uint8_t *const *xq,
                               float *res, int pf, const int nx, const int dt) {
    __m256 acc0[4], acc1[4], corr[4];
    const float *xd[4];
    const int nb = K / FT_QBLOCK;
    for (int j = 0; j < nx; j++) {
        acc0[j] = acc1[j] = corr[j] = _mm256_setzero_ps();
        xd[j] = xq_scales(xq[j], K);
    }
    for (int b0 = 0; b0 < nb; b0 += 8) {
        float sw[8] = {0}, pr[4][8];
        const int n = nb - b0 < 8 ? nb - b0 : 8;
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        if (n == 8 && dt == FT_MXFP4)  /* 8 scales widened at once */
            _mm256_storeu_ps(sw, e8m0_half8((const uint8_t *)s + b0));
        else if (n == 8)
            _mm256_storeu_ps(sw, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)s + b0))));
        else
            wscales(s, b0, n, dt, sw);
        const __m256 dw = _mm256_loadu_ps(sw);
        for (int j = 0; j < nx; j++) {
            _mm256_storeu_ps(pr[j], _mm256_mul_ps(dw, _mm256_maskload_ps(xd[j] + b0, m)));
            if (dt != FT_Q8_0) corr[j] = _mm256_fmadd_ps(dw, _mm256_maskload_ps(xd[j] + nb + b0, m), corr[j]);
        }
        int i = 0;
        for (; i + 2 <= n; i += 2) {
            const int b = b0 + i;
            q8prefetch(q, b, pf, dt);
            block_avx2(codes_avx2(q, b, dt), i, b, xq, pr, acc0, nx, dt);
            block_avx2(codes_avx2(q, b + 1, dt), i + 1, b + 1, xq, pr, acc1, nx, dt);
        }
        if (i < n) {
            q8prefetch(q, b0 + i, pf, dt);
            block_avx2(codes_avx2(q, b0 + i, dt), i, b0 + i, xq, pr, acc0, nx, dt);
        }
    }
    for (int j = 0; j < nx; j++)
        res[j] = hsum8(_mm256_add_ps(acc0[j], acc1[j])) - (float)BIAS(dt) * hsum8(corr[j]);
}

/* NR rows (2 or 4), one input: q8avx2_core's arithmetic for each row (its two chains, its
 * order), the rows' blocks interleaved, so a (row, input) sum has the same bits as
 * q8avx2_core's; NR streams in flight per pass and the input's blocks loaded once for them. */
ALWAYS_INLINE void q8avx2_rows(const uint8_t *const *q, const void *const *s, int K, const uint8_t *xq,
                               float *res, int pf, const int NR, const int dt) {
    __m256 acc0[4], acc1[4], corr[4];
    const float *xd = xq_scales(xq, K);
    const int nb = K / FT_QBLOCK;
    for (int r = 0; r < NR; r++) acc0[r] = acc1[r] = corr[r] = _mm256_setzero_ps();
    for (int b0 = 0; b0 < nb; b0 += 8) {
        float pr[4][1][8];
        const int n = nb - b0 < 8 ? nb - b0 : 8;
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 xs = _mm256_maskload_ps(xd + b0, m);
        for (int r = 0; r < NR; r++) {
            float sw[8] = {0};
            if (n == 8 && dt == FT_MXFP4)
                _mm256_storeu_ps(sw, e8m0_half8((const uint8_t *)s[r] + b0));
            else if (n == 8)
                _mm256_storeu_ps(sw, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)s[r] + b0))));
            else
                wscales(s[r], b0, n, dt, sw);
            const __m256 dw = _mm256_loadu_ps(sw);
            _mm256_storeu_ps(pr[r][0], _mm256_mul_ps(dw, xs));
            if (dt != FT_Q8_0) corr[r] = _mm256_fmadd_ps(dw, _mm256_maskload_ps(xd + nb + b0, m), corr[r]);
        }
        const uint8_t *const xp[1] = {xq};
        int i = 0;
        for (; i + 2 <= n; i += 2) {
            const int b = b0 + i;
            for (int r = 0; r < NR; r++) {
                q8prefetch(q[r], b, pf, dt);
                block_avx2(codes_avx2(q[r], b, dt), i, b, xp, pr[r], &acc0[r], 1, dt);
                block_avx2(codes_avx2(q[r], b + 1, dt), i + 1, b + 1, xp, pr[r], &acc1[r], 1, dt);
            }
        }
        if (i < n)
            for (int r = 0; r < NR; r++) {
                q8prefetch(q[r], b0 + i, pf, dt);
                block_avx2(codes_avx2(q[r], b0 + i, dt), i, b0 + i, xp, pr[r], &acc0[r], 1, dt);
            }
    }
    for (int r = 0; r < NR; r++)
        res[r] = hsum8(_mm256_add_ps(acc0[r], acc1[r])) - (float)BIAS(dt) * hsum8(corr[r]);
}

ALWAYS_INLINE void qdot8_avx2(const void *const *ws, const void *const *ss, int nr, int K,
                              const uint8_t *const *xq, int nx, float *res, int pf, const int dt) {
    float tmp[4];
    int r = 0;
    if (nx == 1) {  /* one input (decode's usual call): rows in fours, then a pair */
        for (; r + 4 <= nr; r += 4)
            q8avx2_rows((const uint8_t *const *)ws + r, ss + r, K, xq[0], res + r, pf, 4, dt);
        for (; r + 2 <= nr; r += 2)
            q8avx2_rows((const uint8_t *const *)ws + r, ss + r, K, xq[0], res + r, pf, 2, dt);
    }
    for (; r < nr; r++) {
        const uint8_t *q = (const uint8_t *)ws[r];
        for (int j = 0; j < nx; j += 4) {
            const int n = nx - j < 4 ? nx - j : 4, p = j ? 0 : pf;
            switch (n) {  /* a constant group size: the sums stay in registers */
            case 4: q8avx2_core(q, ss[r], K, xq + j, tmp, p, 4, dt); break;
            case 3: q8avx2_core(q, ss[r], K, xq + j, tmp, p, 3, dt); break;
            case 2: q8avx2_core(q, ss[r], K, xq + j, tmp, p, 2, dt); break;
            default: q8avx2_core(q, ss[r], K, xq + j, tmp, p, 1, dt); break;
            }
            memcpy(res + r * nx + j, tmp, n * sizeof(float));
        }
    }
}

KERNEL8(avx2, q8_0, FT_Q8_0)
KERNEL8(avx2, q4_0, FT_Q4_0)
KERNEL8(avx2, mxfp4, FT_MXFP4)

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#endif

/* ---- avx512-vnni ------------------------------------------------------------------------ */
/* Blocks b and b + 1 (two: else b alone, the upper half zero) as 64 codes, as codes_avx2's
 * (q8_0 signed, the 4-bit types unsigned). The 4-bit types' 2 x 16 bytes go to
 * [b lo | b hi | b+1 lo | b+1 hi] (128-bit lanes: each block's 16 bytes in two lanes, the
 * second shifted right by 4). */
ALWAYS_INLINE __m512i codes_vnni(const uint8_t *q, int b, int two, int dt) {
    if (dt == FT_Q8_0) {
        const uint8_t *p = q + (size_t)b * FT_QBLOCK;
        return two ? _mm512_loadu_si512(p) : _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)p));
    }
    const uint8_t *p = q + (size_t)b * (FT_QBLOCK / 2);
    const __m256i r = two ? _mm256_loadu_si256((const __m256i *)p)
                          : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)p));
    __m512i z = _mm512_permutexvar_epi64(_mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0), _mm512_castsi256_si512(r));
    z = _mm512_and_si512(_mm512_srlv_epi64(z, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0)), _mm512_set1_epi8(15));
    if (dt == FT_Q4_0) return z;
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)E2M1X2_U)), z);
}

/* NR rows (1 or 2), nx <= 4 inputs: per 16 blocks the products d_w * d_x per row and input
 * (and the 4-bit types' correction sums); per two blocks one vpdpbusd per row and input (q8_0:
 * |w| times x negated where w < 0), its 16 lanes scaled by the two blocks' products (vpermps).
 * An odd last block goes alone, the upper half of both operands zero (x zero: its products
 * vanish). Each (row, input) sum is one chain in block order whatever NR is, so a pair of rows
 * gives each row the bits it has alone; the pair keeps two weight streams in flight and loads
 * each input block once for both. */
ALWAYS_INLINE void q8vnni_core(const uint8_t *const *q, const void *const *s, int K, const uint8_t *const *xq,
                               float *res, int pf, const int NR, const int nx, const int dt) {
    __m512 acc[2][4], corr[2][4];
    const float *xd[4];
    const int nb = K / FT_QBLOCK;
    for (int j = 0; j < nx; j++) xd[j] = xq_scales(xq[j], K);
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < nx; j++) acc[r][j] = corr[r][j] = _mm512_setzero_ps();
    const __m512i zero = _mm512_setzero_si512();
    for (int b0 = 0; b0 < nb; b0 += 16) {
        const int n = nb - b0 < 16 ? nb - b0 : 16;
        const __mmask16 m = (__mmask16)((1u << n) - 1);
        __m512 prod[2][4];
        for (int r = 0; r < NR; r++) {
            float sw[16];
            if (n == 16 && dt == FT_MXFP4) {
                _mm256_storeu_ps(sw, e8m0_half8((const uint8_t *)s[r] + b0));
                _mm256_storeu_ps(sw + 8, e8m0_half8((const uint8_t *)s[r] + b0 + 8));
            } else if (n == 16) {
                _mm512_storeu_ps(sw, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)s[r] + b0))));
            } else
                wscales(s[r], b0, n, dt, sw);
            const __m512 dw = _mm512_maskz_loadu_ps(m, sw);
            for (int j = 0; j < nx; j++) {
                prod[r][j] = _mm512_mul_ps(dw, _mm512_maskz_loadu_ps(m, xd[j] + b0));
                if (dt != FT_Q8_0)
                    corr[r][j] = _mm512_fmadd_ps(dw, _mm512_maskz_loadu_ps(m, xd[j] + nb + b0), corr[r][j]);
            }
        }
        __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        for (int i = 0; i < n; i += 2) {
            const int b = b0 + i, two = i + 1 < n;
            __m512i x[4];
            for (int j = 0; j < nx; j++) {
                const uint8_t *xp = xq[j] + (size_t)b * FT_QBLOCK;
                x[j] = two ? _mm512_loadu_si512(xp) : _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)xp));
            }
            for (int r = 0; r < NR; r++) {
                q8prefetch(q[r], b, pf, dt);  /* b even: every 64 bytes of q8_0, every 2nd pair of 4-bit */
                const __m512i w = codes_vnni(q[r], b, two, dt);
                const __m512i aw = dt == FT_Q8_0 ? _mm512_abs_epi8(w) : w;
                const __mmask64 neg = dt == FT_Q8_0 ? _mm512_movepi8_mask(w) : 0;
                for (int j = 0; j < nx; j++) {
                    const __m512i xs = dt == FT_Q8_0 ? _mm512_mask_sub_epi8(x[j], neg, zero, x[j]) : x[j];
                    const __m512i v = _mm512_dpbusd_epi32(zero, aw, xs);
                    acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_permutexvar_ps(idx, prod[r][j]), acc[r][j]);
                }
            }
            idx = _mm512_add_epi32(idx, _mm512_set1_epi32(2));
        }
    }
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < nx; j++)
            res[r * 4 + j] = _mm512_reduce_add_ps(acc[r][j]) - (float)BIAS(dt) * _mm512_reduce_add_ps(corr[r][j]);
}

/* Rows in pairs where the input group has at most 2 inputs (the pair's 2 x nx chains, products
 * and corrections stay in the 32 registers), else one at a time. */
ALWAYS_INLINE void qdot8_vnni(const void *const *ws, const void *const *ss, int nr, int K,
                              const uint8_t *const *xq, int nx, float *res, int pf, const int dt) {
    float tmp[8];
    const uint8_t *const *q = (const uint8_t *const *)ws;
    for (int r = 0; r < nr;) {
        const int two = r + 1 < nr;
        for (int j = 0; j < nx; j += 4) {
            const int n = nx - j < 4 ? nx - j : 4, p = j ? 0 : pf;
            if (two && n <= 2) {
                if (n == 2) q8vnni_core(q + r, ss + r, K, xq + j, tmp, p, 2, 2, dt);
                else q8vnni_core(q + r, ss + r, K, xq + j, tmp, p, 2, 1, dt);
                memcpy(res + (r + 1) * nx + j, tmp + 4, n * sizeof(float));
            } else {
                switch (n) {
                case 4: q8vnni_core(q + r, ss + r, K, xq + j, tmp, p, 1, 4, dt); break;
                case 3: q8vnni_core(q + r, ss + r, K, xq + j, tmp, p, 1, 3, dt); break;
                case 2: q8vnni_core(q + r, ss + r, K, xq + j, tmp, p, 1, 2, dt); break;
                default: q8vnni_core(q + r, ss + r, K, xq + j, tmp, p, 1, 1, dt); break;
                }
                if (two && n > 2) {  /* the second row of the pair alone */
                    switch (n) {
                    case 4: q8vnni_core(q + r + 1, ss + r + 1, K, xq + j, tmp + 4, p, 1, 4, dt); break;
                    default: q8vnni_core(q + r + 1, ss + r + 1, K, xq + j, tmp + 4, p, 1, 3, dt); break;
                    }
                    memcpy(res + (r + 1) * nx + j, tmp + 4, n * sizeof(float));
                }
            }
            memcpy(res + r * nx + j, tmp, n * sizeof(float));
        }
        r += two ? 2 : 1;
    }
}

KERNEL8(vnni, q8_0, FT_Q8_0)
KERNEL8(vnni, q4_0, FT_Q4_0)
KERNEL8(vnni, mxfp4, FT_MXFP4)

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif /* __x86_64__ */

int ft_qdot8_has_vnni(void) {
#if defined(__x86_64__)
    return ft_isa_supported(FT_ISA_AVX512) && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq");
#else
    return 0;
#endif
}

int ft_qdot8_isa(int isa) {
    if (isa >= FT_ISA_AVX512 && ft_qdot8_has_vnni()) return FT_ISA_AVX512;
    return isa >= FT_ISA_AVX2 && ft_isa_supported(FT_ISA_AVX2) ? FT_ISA_AVX2 : FT_ISA_GENERIC;
}

ft_qdot8_fn ft_qdot8_select(int isa, int dtype) {
    if (!ft_has_qdot8(dtype)) return 0;
    const int k = dtype - FT_Q8_0;  /* q8_0, q4_0, mxfp4 */
#if defined(__x86_64__)
    static const ft_qdot8_fn vnni[3] = {qdot8_vnni_q8_0, qdot8_vnni_q4_0, qdot8_vnni_mxfp4};
    static const ft_qdot8_fn avx2[3] = {qdot8_avx2_q8_0, qdot8_avx2_q4_0, qdot8_avx2_mxfp4};
    const int path = ft_qdot8_isa(isa);
    if (path == FT_ISA_AVX512) return vnni[k];
    if (path == FT_ISA_AVX2) return avx2[k];
#endif
    static const ft_qdot8_fn generic[3] = {qdot8_generic_q8_0, qdot8_generic_q4_0, qdot8_generic_mxfp4};
    return generic[k];
}
