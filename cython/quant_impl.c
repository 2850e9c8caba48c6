/* ftw/quant.py's quantizers in C, byte for byte (quant.h). Each step below names the numpy
 * line it reproduces and why the result is the same bits:
 *
 *   - fp32 steps (x * inv, d = amax / 127, x / denom, ...) are single IEEE-754 operations in
 *     fp32 here as there, so they round alike. This file must not fuse a multiply and an add
 *     (q4_0's x * inv + 8.5 rounds twice in numpy): the multiply and the add are separate
 *     statements, clang's FP_CONTRACT is off, GCC is told fp-contract=off, and setup.py builds
 *     for baseline x86-64 (no FMA instructions to fuse into).
 *   - float64 steps (q8_0's rounding, mxfp4's frexp) are the same float64 operations on the
 *     same values.
 *   - The largest magnitude of a block is taken over the bits of |x| as unsigned integers: for
 *     non-negative floats the integer order is the float order (and every NaN / inf sits above
 *     0x7f800000, which is how a non-finite x is found in the same pass).
 *   - e2m1's nearest code (numpy: a search of the 8 magnitudes in float64, ties to the even
 *     code) is seven comparisons against the midpoints, each tie resolved as the search does;
 *     e4m3's (a search of the 127 magnitudes) is fp32 -> e4m3 rounding to nearest even on the
 *     bits, as fp16's is. e2m1_code and e4m3_code say why those are the same codes; all three
 *     encoders were also checked against ftw/quant.py on every fp32 input (4.3e9; e4m3: the
 *     non-negative ones, its only inputs), and tests/test_quant_native.py keeps the ties.
 *
 * Blocks whose reference bytes come from numpy casting inf or NaN to an integer (q8_0 / q4_0
 * with 1 / d overflowing to inf) and nvfp4 tensors with g rounding to 0 are answered
 * FTQ_ASK_REFERENCE: numpy's cast of a non-finite float is platform-defined, so those tensors
 * go to ftw/quant.py whole.
 */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "quant.h"

/* The exported loops are built twice, for baseline x86-64 and for AVX2 (no FMA: see above), and
 * the loader picks one by the CPU (GCC's ifunc); the results are the same bits, the AVX2 build
 * takes 8 lanes instead of 4. Elsewhere (or with -DFTQ_NO_CLONES) one portable build. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(FTQ_NO_CLONES)
#define FTQ_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define FTQ_CLONES
#endif

#define ABS_BITS(f) (float_bits(f) & 0x7fffffffu)
#define NONFINITE 0x7f800000u /* |x| bits at or above this: inf or NaN */

static inline uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The bits of max |x[0..n)| (as np.abs(x).max() for finite x); >= NONFINITE if any is not. */
static inline uint32_t max_abs_bits(const float *x, int64_t n) {
    uint32_t m = 0;
    for (int64_t j = 0; j < n; j++) {
        uint32_t a = ABS_BITS(x[j]);
        m = a > m ? a : m;
    }
    return m;
}

/* fp32 -> fp16 bits, round to nearest even, overflow to inf: numpy's astype("<f2") (finite f). */
static inline uint16_t f16_bits(float f) {
    uint32_t u = float_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a >= 0x477ff000u)        /* >= 65520 (or inf): rounds past 65504 */
        return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x38800000u) {      /* >= 2^-14: a normal half; drop 13 mantissa bits, ties to even */
        uint32_t h = ((a >> 13) - (112u << 10)), rest = a & 0x1fffu;
        h += rest > 0x1000u || (rest == 0x1000u && (h & 1));  /* a carry moves into the exponent */
        return (uint16_t)(sign | h);
    }
    if (a < 0x33000000u)         /* below 2^-25, half the smallest half: rounds to zero */
        return (uint16_t)sign;
    /* a subnormal half: units of 2^-24; the value is m * 2^(e - 150), so m >> (126 - e) units */
    uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u, shift = 126 - e;  /* 14..24 */
    uint32_t h = m >> shift, rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    h += rest > half || (rest == half && (h & 1));
    return (uint16_t)(sign | h);
}

static inline void put_f16(uint8_t *p, float f) {
    uint16_t h = f16_bits(f);
    p[0] = (uint8_t)h;
    p[1] = (uint8_t)(h >> 8);
}

/* q8_0 (ftw/quant.py _quantize_q8_0), one block of 32 */
static inline int q8_0_block(const float *x, int8_t *q, uint8_t *scale) {
    uint32_t m = max_abs_bits(x, 32);
    if (m >= NONFINITE)
        return FTQ_ASK_REFERENCE;
    float d = bits_float(m) / 127.0f;              /* np.abs(xb).max(-1) / np.float32(127) */
    float inv = d > 0.0f ? 1.0f / d : 0.0f;        /* np.where(d > 0, 1 / d, 0), fp32 */
    if (inv > FLT_MAX)
        return FTQ_ASK_REFERENCE;                  /* x * inf: numpy casts NaN to int8 */
    for (int j = 0; j < 32; j++) {
        float v = x[j] * inv;                      /* (xb * inv).astype(float64) */
        double a = fabs((double)v) + 0.5;          /* np.floor(np.abs(v) + 0.5): a >= 0.5, so */
        int n = (int)a;                            /* truncation is the floor */
        n = n < 127 ? n : 127;                     /* clip(sign * n, -127, 127) */
        q[j] = (int8_t)(v < 0.0f ? -n : n);        /* sign(v): v = +-0 gives 0 either way */
    }
    put_f16(scale, d);                             /* d.astype("<f2") */
    return FTQ_OK;
}

FTQ_CLONES int ftq_quantize_q8_0(const float *x, int64_t nblocks, uint8_t *qs, uint8_t *scales) {
    for (int64_t b = 0; b < nblocks; b++)
        if (q8_0_block(x + 32 * b, (int8_t *)qs + 32 * b, scales + 2 * b) != FTQ_OK)
            return FTQ_ASK_REFERENCE;
    return FTQ_OK;
}

/* q4_0 (_quantize_q4_0), one block of 32: 16 bytes, element j low nibble, j + 16 high */
static inline int q4_0_block(const float *x, uint8_t *qs, uint8_t *scale) {
    uint32_t m = max_abs_bits(x, 32);
    if (m >= NONFINITE)
        return FTQ_ASK_REFERENCE;
    uint32_t at = 31;                              /* np.abs(xb).argmax(-1): the first of equal */
    for (uint32_t j = 0; j < 32; j++) {            /* (a min over indices: it vectorizes) */
        uint32_t k = ABS_BITS(x[j]) == m ? j : 31;
        at = k < at ? k : at;
    }
    float d = x[at] / -8.0f;                       /* keeps x[at]'s sign, also of a zero */
    float inv = d != 0.0f ? 1.0f / d : 0.0f;
    if (fabsf(inv) > FLT_MAX)
        return FTQ_ASK_REFERENCE;                  /* x * inf: numpy casts -inf / NaN to uint8 */
    uint32_t ok = 1;
    for (int j = 0; j < 16; j++) {                 /* element j in the low nibble, j + 16 high */
        float lo = x[j] * inv, hi = x[j + 16] * inv;   /* (xb * inv).astype(float32) */
        lo = lo + 8.5f;                            /* + np.float32(8.5): a second rounding */
        hi = hi + 8.5f;
        ok &= (lo >= 0.0f) & (hi >= 0.0f);         /* so the floor below is a truncation */
        uint32_t nl = (uint32_t)(int)lo, nh = (uint32_t)(int)hi;   /* np.floor(v) */
        nl = nl < 15 ? nl : 15;                    /* np.minimum(15, .) */
        nh = nh < 15 ? nh : 15;
        qs[j] = (uint8_t)(nl | nh << 4);
    }
    if (!ok)
        return FTQ_ASK_REFERENCE;                  /* not seen for finite 1 / d: |x * inv| <~ 8 */
    put_f16(scale, d);
    return FTQ_OK;
}

FTQ_CLONES int ftq_quantize_q4_0(const float *x, int64_t nblocks, uint8_t *qs, uint8_t *scales) {
    for (int64_t b = 0; b < nblocks; b++)
        if (q4_0_block(x + 32 * b, qs + 16 * b, scales + 2 * b) != FTQ_OK)
            return FTQ_ASK_REFERENCE;
    return FTQ_OK;
}

/* e2m1's code of v (ftw/quant.py e2m1_encode = _nearest over 0, .5, 1, 1.5, 2, 3, 4, 6).
 * _nearest takes a = min(|v|, 6) in float64, searches the grid, and picks the nearer of the two
 * neighbours, a tie going to the even code. The differences it compares are exact (a is an fp32
 * value: for a >= 0.5 both a - lo and hi - a fit in 27 bits; below 0.5 a - 0 is a itself, and
 * 0.5 - a is exact for a >= 2^-29 while smaller a is nowhere near the tie at 0.25), so its code
 * is the number of midpoints below a, a midpoint counting when a equals it and the code above
 * it is even: 0.75 (-> 2), 1.75 (-> 4), 3.5 (-> 6), not 0.25 (-> 0), 1.25 (-> 2), 2.5 (-> 4),
 * 5 (-> 6). The comparisons are the same in fp32, where a already is. The sign bit is set for
 * v < 0 unless the code is 0 (a negative zero, or a value that rounds to zero, stays code 0). */
static inline uint8_t e2m1_code(float v) {
    /* on the bits of |v| as unsigned integers (the float order for non-negative floats, and it
     * vectorizes): 0x3e800000 = 0.25f, 0x3f400000 = 0.75f, ... 0x40a00000 = 5.0f. |v| > 6 needs
     * no clamp: it passes all seven, code 7, as min(|v|, 6) = 6 does. */
    uint32_t u = float_bits(v), a = u & 0x7fffffffu;
    uint32_t code = (a > 0x3e800000u) + (a >= 0x3f400000u) + (a > 0x3fa00000u) +
                    (a >= 0x3fe00000u) + (a > 0x40200000u) + (a >= 0x40600000u) + (a > 0x40a00000u);
    return (uint8_t)(code | ((u >> 31) & (code != 0)) << 3);
}

/* mxfp4 (_quantize_mxfp4), one block of 32: 16 bytes, element 2k low nibble, 2k + 1 high */
static inline int mxfp4_block(const float *x, uint8_t *qs, uint8_t *scale) {
    uint32_t m = max_abs_bits(x, 32);
    if (m >= NONFINITE)
        return FTQ_ASK_REFERENCE;
    int exp;
    double mant = frexp((double)bits_float(m), &exp);   /* np.frexp(amax.astype(float64)) */
    int e = mant <= 0.75 ? exp - 3 : exp - 2;            /* smallest e with 6 * 2^e >= amax */
    int stored = e + 127;
    stored = mant == 0.0 ? 0 : (stored < 0 ? 0 : (stored > 254 ? 254 : stored));
    /* xb / e8m0_decode(stored): the scale is 2^(stored - 127), in fp32 from 2^-127 (subnormal)
     * to 2^127, and so is its reciprocal; x / 2^k and x * 2^-k are the same real number, so
     * they round to the same fp32 */
    float inv = (float)ldexp(1.0, 127 - stored);
    for (int k = 0; k < 16; k++)                   /* element 2k in the low nibble */
        qs[k] = (uint8_t)(e2m1_code(x[2 * k] * inv) | e2m1_code(x[2 * k + 1] * inv) << 4);
    *scale = (uint8_t)stored;
    return FTQ_OK;
}

FTQ_CLONES int ftq_quantize_mxfp4(const float *x, int64_t nblocks, uint8_t *qs, uint8_t *scales) {
    for (int64_t b = 0; b < nblocks; b++)
        if (mxfp4_block(x + 32 * b, qs + 16 * b, scales + b) != FTQ_OK)
            return FTQ_ASK_REFERENCE;
    return FTQ_OK;
}

/* e4m3's code of t >= 0, finite (e4m3_encode = _nearest over the 127 finite magnitudes, in
 * float64, ties to the even code). Those magnitudes are every e4m3 value, ascending with the
 * code, and an even code is an even last mantissa bit, so the nearest code is t rounded to e4m3
 * to nearest even, after the clamp to 448 (code 126). The differences the search compares are
 * exact, as in e2m1_code (t's lowest bit is 2^-32 or above where a tie is near), so it is the
 * rounding below, on t's bits: normal e4m3 (t >= 2^-6) keep 3 of the 23 mantissa bits, the
 * subnormal ones count units of 2^-9. */
static inline uint8_t e4m3_code(float t) {
    uint32_t a = float_bits(t);
    a = a < 0x43e00000u ? a : 0x43e00000u;             /* np.minimum(., 448) */
    if (a >= 0x3c800000u) {                             /* >= 2^-6: exponent e = E - 120 */
        uint32_t code = ((a >> 20) - (120u << 3)), rest = a & 0xfffffu;
        return (uint8_t)(code + (rest > 0x80000u || (rest == 0x80000u && (code & 1))));
    }
    if (a < 0x3a800000u)                                /* below 2^-10: half a unit, or less */
        return 0;
    uint32_t m = (a & 0x7fffffu) | 0x800000u, shift = 141 - (a >> 23);  /* 21..24 */
    uint32_t code = m >> shift, rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    return (uint8_t)(code + (rest > half || (rest == half && (code & 1))));
}

/* nvfp4 (_quantize_nvfp4): blocks of 16 (8 bytes, element 2k low nibble), e4m3 block scales,
 * the fp32 tensor scale g */
FTQ_CLONES int ftq_quantize_nvfp4(const float *x, int64_t nblocks, uint8_t *qs, uint8_t *scales,
                                  uint8_t *g_out) {
    uint32_t tm = max_abs_bits(x, 16 * nblocks);    /* tamax = np.abs(x).max() */
    if (tm >= NONFINITE)
        return FTQ_ASK_REFERENCE;
    float tamax = bits_float(tm);
    float g = tamax > 0.0f ? tamax / 2688.0f : 1.0f; /* tamax / np.float32(6 * 448) */
    if (g == 0.0f)
        return FTQ_ASK_REFERENCE;                    /* every block's amax / 0: inf or NaN codes */
    float six_g = 6.0f * g;                          /* np.float32(6) * g */
    float grid[127];                                 /* e4m3_decode of codes 0..126 */
    for (int c = 0; c < 127; c++)
        grid[c] = (float)(c < 8 ? ldexp(c, -9) : ldexp(8 + (c & 7), (c >> 3) - 10));
    for (int64_t b = 0; b < nblocks; b++) {
        const float *xb = x + 16 * b;
        float t = bits_float(max_abs_bits(xb, 16)) / six_g;
        uint8_t s = e4m3_code(t);                    /* t >= 0: no sign bit */
        float denom = grid[s] * g;                   /* (e4m3_decode(s) * g).astype(float32) */
        uint8_t q[16];
        if (denom > 0.0f) {
            for (int j = 0; j < 16; j++)
                q[j] = e2m1_code(xb[j] / denom);     /* a true division: denom is no power of 2 */
        } else {
            memset(q, 0, sizeof q);                  /* np.where(denom > 0, ., 0) */
        }
        for (int k = 0; k < 8; k++)
            qs[8 * b + k] = (uint8_t)(q[2 * k] | (q[2 * k + 1] << 4));
        scales[b] = s;
    }
    memcpy(g_out, &g, 4);                            /* np.array([g], "<f4"): x86 / arm64 LE */
    return FTQ_OK;
}
