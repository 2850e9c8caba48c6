/* Dot-product micro-kernels behind the CPU experts, one set per ISA path, chosen at run time.
 *
 * Every kernel computes res[j] = sum_k w[k] * xs[j][k] for one weight row w (bf16, fp16 or
 * fp32) and up to nx input vectors, in fp32. The row is loaded and widened once per group of
 * vectors, so several tokens routed to the same expert share one pass over its weights.
 * avx512bf16, avx2 and avx512 (bf16 weights) also have a several-row kernel (ft_dotn_fn: gate
 * and up rows in one pass, or 2-4 rows of one projection; each x load shared by the rows, each
 * row load by the inputs), with optional software prefetch; a (row, input) sum's arithmetic
 * does not depend on which rows and inputs share its pass, so the blocking changes speed, never
 * results. The avx2 and avx512 bf16 ones also cut K in chunks that keep the inputs in L1 for
 * all the pass's rows.
 *
 *   path         weights -> fp32                      multiply-add        built with
 *   generic      scalar C                             scalar              default flags
 *   avx2         bf16: << 16 and & 0xffff0000 (even   vfmadd (8 lanes)    target("avx2,fma,f16c")
 *                and odd weights, inputs in that order: FT_XS_F32_EO16); fp16: vcvtph2ps
 *   avx512       bf16: << 16 and & 0xffff0000 as      vfmadd (16 lanes)   target("avx512f")
 *                avx2 (FT_XS_F32_EO32); fp16: vcvtph2ps
 *   avx512bf16   none: bf16 pairs                     vdpbf16ps           target("avx512f,avx512bf16")
 *
 * NOTE: the avx512bf16 kernel takes its input vectors in bf16 (the caller rounds x and the
 * expert's hidden activations to bf16, round-to-nearest-even). With a bf16 compute dtype x is
 * already bf16, so only the hidden activations are rounded, as torch's bf16 experts do too; all
 * other paths keep inputs in fp32. Each path is compiled with a target pragma (GCC; clang's
 * attribute push, untested here), so the build
 * needs no -march flag and the module loads on any x86-64; ft_isa_supported() gates the calls.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ffn.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define NX_MAX 4
#define NR_MAX_AVX2 8

ALWAYS_INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}


ALWAYS_INLINE float load_w(const void *w, int k, int dt) {
    if (dt == FT_BF16) return bf16_to_f32(((const uint16_t *)w)[k]);
    if (dt == FT_FP16) return ft_f16_to_f32(((const uint16_t *)w)[k]);
    return ((const float *)w)[k];
}

float ft_load_f32(const void *v, int k, int dtype) { return load_w(v, k, dtype); }

/* Split nx vectors into groups of NX_MAX and call CORE with a compile-time group size. */
#define DEF_DOT(NAME, CORE, XT, DT)                                                         \
    static void NAME(const void *w, int K, const void *const *xs_, int nx, float *res) {   \
        const XT *const *xs = (const XT *const *)xs_;                                       \
        int j = 0;                                                                          \
        for (; j + NX_MAX <= nx; j += NX_MAX) CORE(w, K, xs + j, res + j, NX_MAX, DT);      \
        switch (nx - j) {                                                                   \
        case 3: CORE(w, K, xs + j, res + j, 3, DT); break;                                  \
        case 2: CORE(w, K, xs + j, res + j, 2, DT); break;                                  \
        case 1: CORE(w, K, xs + j, res + j, 1, DT); break;                                  \
        default: break;                                                                     \
        }                                                                                   \
    }

/* ---- generic ---------------------------------------------------------------------------- */
ALWAYS_INLINE void generic_core(const void *w, int K, const float *const *xs, float *res,
                                const int nx, const int dt) {
    float s[NX_MAX][4] = {{0}};
    int k = 0;
    for (; k + 4 <= K; k += 4) {
        float w0 = load_w(w, k, dt), w1 = load_w(w, k + 1, dt);
        float w2 = load_w(w, k + 2, dt), w3 = load_w(w, k + 3, dt);
        for (int j = 0; j < nx; j++) {
            s[j][0] += w0 * xs[j][k];
            s[j][1] += w1 * xs[j][k + 1];
            s[j][2] += w2 * xs[j][k + 2];
            s[j][3] += w3 * xs[j][k + 3];
        }
    }
    for (int j = 0; j < nx; j++) {
        float t = (s[j][0] + s[j][1]) + (s[j][2] + s[j][3]);
        for (int kk = k; kk < K; kk++) t += load_w(w, kk, dt) * xs[j][kk];
        res[j] = t;
    }
}
DEF_DOT(dot_generic_bf16, generic_core, float, FT_BF16)
DEF_DOT(dot_generic_fp16, generic_core, float, FT_FP16)
DEF_DOT(dot_generic_fp32, generic_core, float, FT_FP32)

static uint64_t read_sum_generic(const void *p, int64_t nbytes) {
    const uint64_t *q = (const uint64_t *)p;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int64_t n = nbytes / 8, i = 0;
    for (; i + 4 <= n; i += 4) { s0 += q[i]; s1 += q[i + 1]; s2 += q[i + 2]; s3 += q[i + 3]; }
    for (; i < n; i++) s0 += q[i];
    return s0 + s1 + s2 + s3;
}

#if defined(__x86_64__)
#include <immintrin.h>

/* Compile a region for an ISA: GCC's target pragma, or clang's attribute push. */
#if defined(__clang__)
#define TARGET_BEGIN(t) _Pragma(t)
#define TARGET_PRAGMA_AVX2 "clang attribute push(__attribute__((target(\"avx2,fma,f16c\"))), apply_to = function)"
#define TARGET_PRAGMA_AVX512 "clang attribute push(__attribute__((target(\"avx512f\"))), apply_to = function)"
#define TARGET_PRAGMA_AVX512BF16 "clang attribute push(__attribute__((target(\"avx512f,avx512bf16\"))), apply_to = function)"
#define TARGET_END _Pragma("clang attribute pop")
#else
#define TARGET_BEGIN(t) _Pragma("GCC push_options") _Pragma(t)
#define TARGET_PRAGMA_AVX2 "GCC target(\"avx2,fma,f16c\")"
#define TARGET_PRAGMA_AVX512 "GCC target(\"avx512f\")"
#define TARGET_PRAGMA_AVX512BF16 "GCC target(\"avx512f,avx512bf16\")"
#define TARGET_END _Pragma("GCC pop_options")
#endif

/* ---- bf16 even/odd several-row kernel: one definition, avx2 and avx512 instances -------- */
/* bf16 weights, inputs in the even/odd order of BLK-element blocks (ffn.h; avx2: BLK 16,
 * FT_XS_F32_EO16; avx512: BLK 32, FT_XS_F32_EO32): one vector load of a row (32 or 64 bytes)
 * holds BLK weights as BLK / 2 dwords; "<< 16" widens the even ones and "& 0xffff0000" the odd
 * ones, one integer op per BLK / 2 weights (vpmovzxwd + vpslld took two, on the ports the FMAs
 * use; at 512 bits that natural-order pair, one row at a time without prefetch, ran at 0.5-0.7x
 * STREAM where the avx2 kernel ran at 0.9). Per (row, input) two FMA chains, the even and the
 * odd halves of every block, in block order; the sum hsum(even + odd), then the K % BLK tail in
 * order: the same arithmetic for any blocking.
 *
 * DEF_EO_KERNEL(V, DOTN), inside the ISA's target region, defines eo_V_part, eo_V_tile and the
 * ft_dotn_fn DOTN for the vector width V (V256: avx2, V512: avx512) from V's macros:
 *   V_F, V_I       the float and integer vector types
 *   V_BLK          weights per row load: the block; its odd half's inputs are V_BLK / 2 floats
 *                  after its even half's
 *   V_LOADI, V_LOADF, V_FMADD, V_ADD, V_ZERO, V_SET1I, V_SLLI16, V_AND, V_CASTF: intrinsics
 *   V_HSUM         the horizontal sum of a float vector
 *   V_KEEP(v)      pins v in a register (asm constraint "+x" for ymm, "+v" for zmm 0-31) */
#define V256_F __m256
#define V256_I __m256i
#define V256_BLK 16
#define V256_LOADI(p) _mm256_loadu_si256((const __m256i *)(p))
#define V256_LOADF(p) _mm256_loadu_ps(p)
#define V256_FMADD(a, b, c) _mm256_fmadd_ps(a, b, c)
#define V256_ADD(a, b) _mm256_add_ps(a, b)
#define V256_ZERO() _mm256_setzero_ps()
#define V256_SET1I(i) _mm256_set1_epi32(i)
#define V256_SLLI16(v) _mm256_slli_epi32(v, 16)
#define V256_AND(a, b) _mm256_and_si256(a, b)
#define V256_CASTF(v) _mm256_castsi256_ps(v)
#define V256_HSUM(v) hsum8(v)
#define V256_KEEP(v) __asm__("" : "+x"(v))

#define V512_F __m512
#define V512_I __m512i
#define V512_BLK 32
#define V512_LOADI(p) _mm512_loadu_si512((const void *)(p))
#define V512_LOADF(p) _mm512_loadu_ps(p)
#define V512_FMADD(a, b, c) _mm512_fmadd_ps(a, b, c)
#define V512_ADD(a, b) _mm512_add_ps(a, b)
#define V512_ZERO() _mm512_setzero_ps()
#define V512_SET1I(i) _mm512_set1_epi32(i)
#define V512_SLLI16(v) _mm512_slli_epi32(v, 16)
#define V512_AND(a, b) _mm512_and_si512(a, b)
#define V512_CASTF(v) _mm512_castsi512_ps(v)
#define V512_HSUM(v) _mm512_reduce_add_ps(v)
#define V512_KEEP(v) __asm__("" : "+v"(v))

#define EO_STEP(V, KK)                                                                         \
    {                                                                                          \
        V##_I v[4];                                                                            \
        for (int r = 0; r < NR; r++) {                                                         \
            v[r] = V##_LOADI(w[r] + (KK));                                                     \
            V##_KEEP(v[r]);                                                                    \
        }                                                                                      \
        for (int j = 0; j < NX; j++) {                                                         \
            V##_F xe = V##_LOADF(x[j] + (KK));                                                 \
            if (NR > 1) V##_KEEP(xe);                                                          \
            for (int r = 0; r < NR; r++)                                                       \
                ae[r][j] = V##_FMADD(V##_CASTF(V##_SLLI16(v[r])), xe, ae[r][j]);               \
        }                                                                                      \
        for (int j = 0; j < NX; j++) {                                                         \
            V##_F xo = V##_LOADF(x[j] + (KK) + V##_BLK / 2);                                   \
            if (NR > 1) V##_KEEP(xo);                                                          \
            for (int r = 0; r < NR; r++)                                                       \
                ao[r][j] = V##_FMADD(V##_CASTF(V##_AND(v[r], hi)), xo, ao[r][j]);              \
        }                                                                                      \
    }
/* 32 weights (64 bytes) of every row per prefetch: one or two blocks */
#define EO_PREFETCH_STEPS(V, HINT)                                                             \
    for (; k + 32 <= k1; k += 32) {                                                            \
        for (int r = 0; r < NR; r++)                                                           \
            _mm_prefetch((const char *)(w[r] + k) + dist + (2 * k + dist >= 2 * K ? pf_skip : 0), HINT); \
        EO_STEP(V, k)                                                                          \
        if (V##_BLK < 32) EO_STEP(V, k + V##_BLK)                                              \
    }

/* Blocks k0..k1 (multiples of V_BLK) of NR rows and NX inputs into the accumulators
 * acc[(r * NX + j) * 2 + {0: even, 1: odd}], loaded and stored back (NR * NX <= 4: 8 live
 * accumulators). Each row and input load is kept in a register (KEEP) and shared by the NX
 * inputs / NR rows: GCC otherwise folds the x loads into the FMAs, once per row, and the step
 * turns load-bound (two 32-byte loads per cycle on Zen 4). pf: as bf16n_core's; a row's
 * prefetch that passes its end goes pf_skip bytes further (ft_dotn_fn). */
#define DEF_EO_PART(V)                                                                         \
    ALWAYS_INLINE void eo_##V##_part(const uint16_t *const *w, int k0, int k1, int K, const float *const *x, \
                                V##_F *acc, const int NR, const int NX, int pf, int64_t pf_skip) { \
        V##_F ae[4][4], ao[4][4];                                                              \
        const V##_I hi = V##_SET1I((int)0xffff0000u);                                          \
        for (int r = 0; r < NR; r++)                                                           \
            for (int j = 0; j < NX; j++) {                                                     \
                ae[r][j] = acc[(r * NX + j) * 2];                                              \
                ao[r][j] = acc[(r * NX + j) * 2 + 1];                                          \
            }                                                                                  \
        int k = k0;                                                                            \
        const int dist = pf & ~63;                                                             \
        if (pf > 0 && (pf & 3) == 1) {                                                         \
            EO_PREFETCH_STEPS(V, _MM_HINT_T1)                                                  \
        } else if (pf > 0) {                                                                   \
            EO_PREFETCH_STEPS(V, _MM_HINT_T0)                                                  \
        }                                                                                      \
        for (; k + V##_BLK <= k1; k += V##_BLK) EO_STEP(V, k)                                  \
        for (int r = 0; r < NR; r++)                                                           \
            for (int j = 0; j < NX; j++) {                                                     \
                acc[(r * NX + j) * 2] = ae[r][j];                                              \
                acc[(r * NX + j) * 2 + 1] = ao[r][j];                                          \
            }                                                                                  \
    }

/* The tile of rows r.. and inputs j.. of a group of g inputs whose accumulators are acc[(row * g
 * + input) * 2 + {even, odd}]: gathered, run over blocks k0..k1, stored back. */
#define DEF_EO_TILE(V)                                                                         \
    ALWAYS_INLINE void eo_##V##_tile(const uint16_t *const *ws, int r, int j, int g, int k0, int k1, int K, \
                                const float *const *x, V##_F *acc, const int NR, const int NX, int pf, \
                                int64_t pf_skip) {                                             \
        V##_F t[16];                                                                           \
        for (int q = 0; q < NR; q++)                                                           \
            for (int i = 0; i < NX; i++) {                                                     \
                t[(q * NX + i) * 2] = acc[((r + q) * g + j + i) * 2];                          \
                t[(q * NX + i) * 2 + 1] = acc[((r + q) * g + j + i) * 2 + 1];                  \
            }                                                                                  \
        eo_##V##_part(ws + r, k0, k1, K, x + j, t, NR, NX, pf, pf_skip);                       \
        for (int q = 0; q < NR; q++)                                                           \
            for (int i = 0; i < NX; i++) {                                                     \
                acc[((r + q) * g + j + i) * 2] = t[(q * NX + i) * 2];                          \
                acc[((r + q) * g + j + i) * 2 + 1] = t[(q * NX + i) * 2 + 1];                  \
            }                                                                                  \
    }

/* Inputs per group; a group's K-chunk of inputs and of one row pair fits EO_L1_BYTES. */
enum { EO_GROUP = 16, EO_L1_BYTES = 24 << 10 };

/* Rows in blocks of four: under each input pair the block's row pairs (2 x 2 tiles), then a
 * last odd input under all four rows (4 x 1; a 2 x 1 tile has four FMA chains and is
 * latency-bound), or, when it is the group's only input, under row pairs (2 x 1: one input
 * needs no more FMA rate, and two streams suit the hardware prefetcher better than four); an
 * odd row takes its inputs two at a time. Inputs go in groups of up to EO_GROUP and a group's K
 * in chunks: every row block of the call runs over one chunk before the next, so the chunk's
 * inputs stay in L1 for all rows (DeepSeek-V3's fp32 x is 28 KiB: reloaded from L2 once per row
 * pair it kept the loads waiting beside the weight stream); the accumulators wait in memory
 * between chunks, the arithmetic stays that of one pass. */
#define EO_TILE(V, R, J, NR_, NX_) eo_##V##_tile(ws, R, J, g, k0, k1, K, x, acc, NR_, NX_, pf, pf_skip)
#define DEF_EO_DOTN(V, DOTN)                                                                   \
    static void DOTN(const void *const *ws_, int nr, int K, const void *const *xs_, int nx,    \
                     float *res, int pf, int64_t pf_skip) {                                    \
        const uint16_t *const *ws = (const uint16_t *const *)ws_;                              \
        const float *const *xs = (const float *const *)xs_;                                    \
        V##_F acc[NR_MAX_AVX2 * EO_GROUP * 2];                                                 \
        const int kb = K & ~(V##_BLK - 1);                                                     \
        for (int g0 = 0; g0 < nx; g0 += EO_GROUP) {                                            \
            const int g = nx - g0 < EO_GROUP ? nx - g0 : EO_GROUP;                             \
            const float *const *x = xs + g0;                                                   \
            /* g inputs (fp32) and 2 rows (bf16) */                                            \
            int kc = (int)(EO_L1_BYTES / (4 * g + 4)) & ~(V##_BLK - 1);                        \
            if (kc < 256) kc = 256;                                                            \
            if (kc > kb) kc = kb;                                                              \
            for (int i = 0; i < nr * g * 2; i++) acc[i] = V##_ZERO();                          \
            for (int k0 = 0; k0 < kb; k0 += kc) {                                              \
                const int k1 = k0 + kc < kb ? k0 + kc : kb;                                    \
                for (int r = 0; r < nr; r += 4) {                                              \
                    const int nb = nr - r < 4 ? nr - r : 4;  /* rows in this block */          \
                    int j = 0;                                                                 \
                    for (; j + 2 <= g; j += 2) {                                               \
                        int q = 0;                                                             \
                        for (; q + 2 <= nb; q += 2) EO_TILE(V, r + q, j, 2, 2);                \
                        if (q < nb) EO_TILE(V, r + q, j, 1, 2);                                \
                    }                                                                          \
                    if (j < g) {                                                               \
                        int q = 0;                                                             \
                        if (nb == 4 && g > 1) {                                                \
                            EO_TILE(V, r, j, 4, 1);                                            \
                            q = 4;                                                             \
                        }                                                                      \
                        for (; q + 2 <= nb; q += 2) EO_TILE(V, r + q, j, 2, 1);                \
                        if (q < nb) EO_TILE(V, r + q, j, 1, 1);                                \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
            for (int r = 0; r < nr; r++)                                                       \
                for (int j = 0; j < g; j++) {                                                  \
                    float t = V##_HSUM(V##_ADD(acc[(r * g + j) * 2], acc[(r * g + j) * 2 + 1])); \
                    for (int kk = kb; kk < K; kk++) t += bf16_to_f32(ws[r][kk]) * x[j][kk];    \
                    res[r * nx + g0 + j] = t;                                                  \
                }                                                                              \
        }                                                                                      \
    }

#define DEF_EO_KERNEL(V, DOTN) DEF_EO_PART(V) DEF_EO_TILE(V) DEF_EO_DOTN(V, DOTN)

/* ---- avx2 + fma + f16c ------------------------------------------------------------------ */
TARGET_BEGIN(TARGET_PRAGMA_AVX2)

ALWAYS_INLINE __m256 ld8(const void *w, int k, const int dt) {
    if (dt == FT_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + k));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (dt == FT_FP16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + k)));
    return _mm256_loadu_ps((const float *)w + k);
}

ALWAYS_INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* fp16 and fp32 weights, several rows per pass (ft_dotn_fn; the one-row dot is its nr = 1
 * case): each x load shared by NR rows (gate row i and up row i). Per (row, input) four FMA
 * chains over 32-element blocks (elements k+8c .. k+8c+7 go to chain c; two chains left the
 * core latency-bound at one input), the last 8-element steps to chains 0, 1, 2: the same
 * arithmetic whatever the blocking. NR * NX <= 2 (8 accumulators). No software prefetch (pf
 * is ignored). */
#define AVX2N_CHAIN(C, A)                                                                      \
    {                                                                                          \
        __m256 wv[2];                                                                          \
        for (int r = 0; r < NR; r++) wv[r] = ld8(ws[r], k + 8 * (C), dt);                     \
        for (int j = 0; j < NX; j++) {                                                         \
            __m256 xv = _mm256_loadu_ps(xs[j] + k + 8 * (C));                                  \
            for (int r = 0; r < NR; r++) A[r][j] = _mm256_fmadd_ps(wv[r], xv, A[r][j]);        \
        }                                                                                      \
    }
ALWAYS_INLINE void avx2n_core(const void *const *ws, int K, const float *const *xs, float *res, int ld,
                              const int NR, const int NX, const int dt) {
    __m256 a0[2][2], a1[2][2], a2[2][2], a3[2][2];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < NX; j++)
            a0[r][j] = a1[r][j] = a2[r][j] = a3[r][j] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        AVX2N_CHAIN(0, a0)
        AVX2N_CHAIN(1, a1)
        AVX2N_CHAIN(2, a2)
        AVX2N_CHAIN(3, a3)
    }
    /* the last 8-element steps go to a0, a1, a2 in order */
    if (k + 8 <= K) { AVX2N_CHAIN(0, a0) k += 8; }
    if (k + 8 <= K) { AVX2N_CHAIN(0, a1) k += 8; }
    if (k + 8 <= K) { AVX2N_CHAIN(0, a2) k += 8; }
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < NX; j++) {
            float t = hsum8(_mm256_add_ps(_mm256_add_ps(a0[r][j], a1[r][j]), _mm256_add_ps(a2[r][j], a3[r][j])));
            for (int kk = k; kk < K; kk++) t += load_w(ws[r], kk, dt) * xs[j][kk];
            res[r * ld + j] = t;
        }
}
#undef AVX2N_CHAIN

/* Rows in pairs, inputs one at a time under a pair (two at a time under a lone row). Used for
 * fp16 and fp32 weights; bf16 weights take the even/odd kernel (DEF_EO_KERNEL). */
#define DEF_DOTN_AVX2(NAME, DT)                                                                \
    static void NAME(const void *const *ws, int nr, int K, const void *const *xs_, int nx,     \
                     float *res, int pf, int64_t pf_skip) {                                    \
        const float *const *xs = (const float *const *)xs_;                                    \
        (void)pf; (void)pf_skip;                                                               \
        int r = 0;                                                                             \
        for (; r + 2 <= nr; r += 2)                                                            \
            for (int j = 0; j < nx; j++) avx2n_core(ws + r, K, xs + j, res + r * nx + j, nx, 2, 1, DT); \
        if (r < nr) {                                                                          \
            int j = 0;                                                                         \
            for (; j + 2 <= nx; j += 2) avx2n_core(ws + r, K, xs + j, res + r * nx + j, nx, 1, 2, DT); \
            if (j < nx) avx2n_core(ws + r, K, xs + j, res + r * nx + j, nx, 1, 1, DT);     \
        }                                                                                      \
    }
DEF_DOTN_AVX2(dotn_avx2_fp16, FT_FP16)
DEF_DOTN_AVX2(dotn_avx2_fp32, FT_FP32)
#undef DEF_DOTN_AVX2

/* bf16 weights: the even/odd kernel (DEF_EO_KERNEL) at 256 bits, 16-element blocks. */
DEF_EO_KERNEL(V256, dotn_avx2_bf16)

static void dot_avx2_bf16(const void *w, int K, const void *const *xs, int nx, float *res) {
    dotn_avx2_bf16(&w, 1, K, xs, nx, res, 0, 0);
}
static void dot_avx2_fp16(const void *w, int K, const void *const *xs, int nx, float *res) {
    dotn_avx2_fp16(&w, 1, K, xs, nx, res, 0, 0);
}
static void dot_avx2_fp32(const void *w, int K, const void *const *xs, int nx, float *res) {
    dotn_avx2_fp32(&w, 1, K, xs, nx, res, 0, 0);
}

static uint64_t read_sum_avx2(const void *p, int64_t nbytes) {
    const uint8_t *b = (const uint8_t *)p;
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
    int64_t i = 0;
    for (; i + 128 <= nbytes; i += 128) {
        s0 = _mm256_add_epi64(s0, _mm256_loadu_si256((const __m256i *)(b + i)));
        s1 = _mm256_add_epi64(s1, _mm256_loadu_si256((const __m256i *)(b + i + 32)));
        s2 = _mm256_add_epi64(s2, _mm256_loadu_si256((const __m256i *)(b + i + 64)));
        s3 = _mm256_add_epi64(s3, _mm256_loadu_si256((const __m256i *)(b + i + 96)));
    }
    s0 = _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3));
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, s0);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3] + read_sum_generic(b + i, nbytes - i);
}
TARGET_END

/* ---- avx512f ----------------------------------------------------------------------------- */
TARGET_BEGIN(TARGET_PRAGMA_AVX512)

ALWAYS_INLINE __m512 ld16(const void *w, int k, const int dt) {
    if (dt == FT_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (dt == FT_FP16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k)));
    return _mm512_loadu_ps((const float *)w + k);
}

ALWAYS_INLINE void avx512_core(const void *w, int K, const float *const *xs, float *res,
                               const int nx, const int dt) {
    __m512 a0[NX_MAX], a1[NX_MAX];
    for (int j = 0; j < nx; j++) { a0[j] = _mm512_setzero_ps(); a1[j] = _mm512_setzero_ps(); }
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512 w0 = ld16(w, k, dt), w1 = ld16(w, k + 16, dt);
        for (int j = 0; j < nx; j++) {
            a0[j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xs[j] + k), a0[j]);
            a1[j] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xs[j] + k + 16), a1[j]);
        }
    }
    if (k + 16 <= K) {
        __m512 w0 = ld16(w, k, dt);
        for (int j = 0; j < nx; j++) a0[j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xs[j] + k), a0[j]);
        k += 16;
    }
    for (int j = 0; j < nx; j++) {
        float t = _mm512_reduce_add_ps(_mm512_add_ps(a0[j], a1[j]));
        for (int kk = k; kk < K; kk++) t += load_w(w, kk, dt) * xs[j][kk];
        res[j] = t;
    }
}

/* bf16 weights: the even/odd kernel (DEF_EO_KERNEL) at 512 bits, 32-element blocks. */
DEF_EO_KERNEL(V512, dotn_avx512_bf16)

static void dot_avx512_bf16(const void *w, int K, const void *const *xs, int nx, float *res) {
    dotn_avx512_bf16(&w, 1, K, xs, nx, res, 0, 0);
}
DEF_DOT(dot_avx512_fp16, avx512_core, float, FT_FP16)
DEF_DOT(dot_avx512_fp32, avx512_core, float, FT_FP32)

static uint64_t read_sum_avx512(const void *p, int64_t nbytes) {
    const uint8_t *b = (const uint8_t *)p;
    __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
    int64_t i = 0;
    for (; i + 256 <= nbytes; i += 256) {
        s0 = _mm512_add_epi64(s0, _mm512_loadu_si512((const void *)(b + i)));
        s1 = _mm512_add_epi64(s1, _mm512_loadu_si512((const void *)(b + i + 64)));
        s2 = _mm512_add_epi64(s2, _mm512_loadu_si512((const void *)(b + i + 128)));
        s3 = _mm512_add_epi64(s3, _mm512_loadu_si512((const void *)(b + i + 192)));
    }
    s0 = _mm512_add_epi64(_mm512_add_epi64(s0, s1), _mm512_add_epi64(s2, s3));
    return (uint64_t)_mm512_reduce_add_epi64(s0) + read_sum_generic(b + i, nbytes - i);
}
TARGET_END

/* ---- avx512bf16: bf16 x bf16 pairs into fp32 (vdpbf16ps) --------------------------------- */
TARGET_BEGIN(TARGET_PRAGMA_AVX512BF16)

#define BH(v) ((__m512bh)(v))
#define NR_MAX 8

/* Sums of 4 vectors at once: {sum a, sum b, sum c, sum d}. Each sum's order depends on its own
 * vector only, so a row's result is the same whichever rows share its call. */
ALWAYS_INLINE __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
#define HALF(v) _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)))
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(HALF(a), HALF(b)), _mm256_hadd_ps(HALF(c), HALF(d)));
#undef HALF
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* One step of 32 bf16 pairs into accumulator set A: NR row loads, NX input loads, NR * NX
 * vdpbf16ps. The empty asm pins each loaded vector in a register: GCC otherwise reloads x once
 * per row (from L2 when the inputs outgrow L1), which made the step load-bound. */
#define KEEP(v) __asm__("" : "+v"(v))
#define BF16N_STEP(KK, A)                                                                      \
    {                                                                                          \
        __m512i wv[NR_MAX];                                                                    \
        for (int r = 0; r < NR; r++) {                                                         \
            wv[r] = _mm512_loadu_si512((const void *)(w[r] + (KK)));                          \
            KEEP(wv[r]);                                                                       \
        }                                                                                      \
        for (int j = 0; j < NX; j++) {                                                         \
            __m512i xv = _mm512_loadu_si512((const void *)(x[j] + (KK)));                     \
            KEEP(xv);                                                                          \
            for (int r = 0; r < NR; r++) acc[A][r][j] = _mm512_dpbf16_ps(acc[A][r][j], BH(wv[r]), BH(xv)); \
        }                                                                                      \
    }
#define PREFETCH_ROWS(HINT)                                                                    \
    for (int r = 0; r < NR; r++) {                                                             \
        _mm_prefetch((const char *)(w[r] + k) + dist, HINT);                                   \
        _mm_prefetch((const char *)(w[r] + k) + dist + 64, HINT);                              \
    }

/* res[r * ld + j] = w[r] . x[j] for NR rows and NX inputs, two accumulators per pair (even
 * and odd 32-element chunks: two dependency chains each, NR * NX * 2 <= 16 registers).
 * pf: prefetch distance in bytes, low 2 bits the hint (0: T0, 1: T1); 0 or less: none. */
ALWAYS_INLINE void bf16n_core(const uint16_t *const *ws, int K, const uint16_t *const *xs, float *res, int ld,
                              const int NR, const int NX, int pf) {
    const uint16_t *w[NR_MAX], *x[NX_MAX];
    __m512 acc[2][NR_MAX][NX_MAX];
    for (int r = 0; r < NR; r++) w[r] = ws[r];
    for (int j = 0; j < NX; j++) x[j] = xs[j];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < NX; j++) acc[0][r][j] = acc[1][r][j] = _mm512_setzero_ps();
    int k = 0;
    const int dist = pf & ~63;
    if (pf > 0 && (pf & 3) == 1) {
        for (; k + 64 <= K; k += 64) {
            PREFETCH_ROWS(_MM_HINT_T1)
            BF16N_STEP(k, 0)
            BF16N_STEP(k + 32, 1)
        }
    } else if (pf > 0) {
        for (; k + 64 <= K; k += 64) {
            PREFETCH_ROWS(_MM_HINT_T0)
            BF16N_STEP(k, 0)
            BF16N_STEP(k + 32, 1)
        }
    } else {
        for (; k + 64 <= K; k += 64) {
            BF16N_STEP(k, 0)
            BF16N_STEP(k + 32, 1)
        }
    }
    if (k + 32 <= K) {
        BF16N_STEP(k, 0)
        k += 32;
    }
    const __m512 z = _mm512_setzero_ps();
    for (int j = 0; j < NX; j++) {
        for (int r0 = 0; r0 < NR; r0 += 4) {
            __m512 a[4];
            for (int q = 0; q < 4; q++) a[q] = r0 + q < NR ? _mm512_add_ps(acc[0][r0 + q][j], acc[1][r0 + q][j]) : z;
            float s4[4];
            _mm_storeu_ps(s4, hsum4(a[0], a[1], a[2], a[3]));
            for (int r = r0; r < NR && r < r0 + 4; r++) {
                float t = s4[r - r0];
                for (int kk = k; kk < K; kk++) t += bf16_to_f32(w[r][kk]) * bf16_to_f32(x[j][kk]);
                res[r * ld + j] = t;
            }
        }
    }
}
#undef BF16N_STEP
#undef PREFETCH_ROWS

static void dotn_avx512bf16_bf16(const void *const *ws_, int nr, int K, const void *const *xs_, int nx,
                                 float *res, int pf, int64_t pf_skip) {
    (void)pf_skip;
    const uint16_t *const *ws = (const uint16_t *const *)ws_;
    const uint16_t *const *xs = (const uint16_t *const *)xs_;
    const int gmax = nr <= 2 ? 4 : (nr <= 4 ? 2 : 1);  /* nr * inputs * 2 accumulators <= 16 */
    for (int j = 0; j < nx; j += gmax) {
        int g = nx - j < gmax ? nx - j : gmax;
        switch (nr * 8 + g) {
#define C(NR_, NX_) case NR_ * 8 + NX_: bf16n_core(ws, K, xs + j, res + j, nx, NR_, NX_, pf); break;
        C(1, 1) C(1, 2) C(1, 3) C(1, 4) C(2, 1) C(2, 2) C(2, 3) C(2, 4)
        C(3, 1) C(3, 2) C(4, 1) C(4, 2) C(5, 1) C(6, 1) C(7, 1) C(8, 1)
#undef C
        default: break;
        }
    }
}

static void dot_avx512bf16_bf16(const void *w, int K, const void *const *xs, int nx, float *res) {
    dotn_avx512bf16_bf16(&w, 1, K, xs, nx, res, 0, 0);
}
TARGET_END
#endif /* __x86_64__ */

int ft_isa_supported(int isa) {
    if (isa == FT_ISA_GENERIC) return 1;
#if defined(__x86_64__)
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    int avx512 = avx2 && __builtin_cpu_supports("avx512f");
    if (isa == FT_ISA_AVX2) return avx2;
    if (isa == FT_ISA_AVX512) return avx512;
    if (isa == FT_ISA_AVX512BF16) return avx512 && __builtin_cpu_supports("avx512bf16");
#endif
    return 0;
}

int ft_isa_best(void) {
    for (int isa = FT_ISA_AVX512BF16; isa > FT_ISA_GENERIC; isa--)
        if (ft_isa_supported(isa)) return isa;
    return FT_ISA_GENERIC;
}

ft_dot_fn ft_dot_select(int isa, int dtype, int *xs_form) {
    *xs_form = FT_XS_F32;
    if (dtype < FT_BF16 || dtype > FT_FP32) return 0;
#if defined(__x86_64__)
    static const ft_dot_fn avx2[3] = {dot_avx2_bf16, dot_avx2_fp16, dot_avx2_fp32};
    static const ft_dot_fn avx512[3] = {dot_avx512_bf16, dot_avx512_fp16, dot_avx512_fp32};
    if (isa == FT_ISA_AVX512BF16 && dtype == FT_BF16) {
        *xs_form = FT_XS_BF16;
        return dot_avx512bf16_bf16;
    }
    if (isa == FT_ISA_AVX512 && dtype == FT_BF16) *xs_form = FT_XS_F32_EO32;
    if (isa == FT_ISA_AVX512BF16 || isa == FT_ISA_AVX512) return avx512[dtype];  /* fp16/fp32 weights */
    if (isa == FT_ISA_AVX2) {
        if (dtype == FT_BF16) *xs_form = FT_XS_F32_EO16;
        return avx2[dtype];
    }
#endif
    static const ft_dot_fn generic[3] = {dot_generic_bf16, dot_generic_fp16, dot_generic_fp32};
    return generic[dtype];
}

ft_dotn_fn ft_dotn_select(int isa, int dtype) {
#if defined(__x86_64__)
    if (isa == FT_ISA_AVX512BF16 && dtype == FT_BF16) return dotn_avx512bf16_bf16;
    if (isa == FT_ISA_AVX512 && dtype == FT_BF16) return dotn_avx512_bf16;
    static const ft_dotn_fn avx2n[3] = {dotn_avx2_bf16, dotn_avx2_fp16, dotn_avx2_fp32};
    if (isa == FT_ISA_AVX2 && dtype >= FT_BF16 && dtype <= FT_FP32) return avx2n[dtype];
#endif
    (void)isa; (void)dtype;
    return 0;
}

uint64_t ft_read_sum(int isa, const void *p, int64_t nbytes) {
#if defined(__x86_64__)
    if (isa >= FT_ISA_AVX512) return read_sum_avx512(p, nbytes);
    if (isa == FT_ISA_AVX2) return read_sum_avx2(p, nbytes);
#endif
    return read_sum_generic(p, nbytes);
}
