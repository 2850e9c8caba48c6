/* CPU SwiGLU experts for one MoE layer, read straight from a host expert bank.
 *
 * Shape legend: T tokens, D hidden, I expert hidden, R routes (token, expert, weight),
 * U unique experts among the routes. Slot layout (docs/INTERFACES.md section 3): expert e's
 * slot starts at bank + e * slot_stride; gate [I, D], up [I, D], down [D, I] row-major at the
 * given in-slot byte offsets, all in the bank dtype.
 */
#ifndef FT_FFN_H
#define FT_FFN_H

#include <stdint.h>

/* weight dtypes; q8_0, q4_0, mxfp4, nvfp4 and fp8_e4m3 are quantized (qdot.h, ftw/SPEC.md §9),
 * computed in fp32 */
enum { FT_BF16 = 0, FT_FP16 = 1, FT_FP32 = 2, FT_Q8_0 = 3, FT_Q4_0 = 4, FT_MXFP4 = 5, FT_NVFP4 = 6,
       FT_FP8_E4M3 = 7 };
/* h = act(gate) * up, or FT_ACT_CLAMPED_SWIGLU (gpt_oss): g = min(gate, limit),
 * u = clamp(up, -limit, limit), h = g * sigmoid(alpha * g) * (u + 1) (ft_ffn_extra's alpha, limit) */
enum { FT_ACT_SILU = 0, FT_ACT_GELU = 1, FT_ACT_GELU_TANH = 2, FT_ACT_CLAMPED_SWIGLU = 3 };

/* What a layer's experts add to the plain gated FFN: the activation's parameters, and expert
 * biases at these in-slot byte offsets (gate_bias [I], up_bias [I], down_bias [D], elements of
 * bias_dtype: FT_BF16, FT_FP16 or FT_FP32, the bank's compute dtype, also beside quantized
 * weights; all three -1: none): gate = W_g x + b_g, up = W_u x + b_u, y = W_d h + b_d. */
typedef struct {
    float alpha, limit;
    int64_t off_gate_bias, off_up_bias, off_down_bias;
    int bias_dtype;
} ft_ffn_extra;
/* Element k of a vector of dtype (FT_BF16, FT_FP16, FT_FP32) as float. */
float ft_load_f32(const void *v, int k, int dtype);
enum { FT_ISA_GENERIC = 0, FT_ISA_AVX2 = 1, FT_ISA_AVX512 = 2, FT_ISA_AVX512BF16 = 3 };

enum {
    FT_OK = 0,
    FT_ERR_TOKEN = -1,   /* a token id outside [0, T) */
    FT_ERR_EXPERT = -2,  /* an expert id outside [0, E) */
    FT_ERR_ISA = -3,     /* the ISA path is not supported by this CPU (or this build) */
    FT_ERR_NOMEM = -4,
    FT_ERR_ARG = -5,     /* dtype/act/bias dtype code unknown, a quantized shape not in 32-blocks */
};

int ft_isa_supported(int isa);
int ft_isa_best(void);

/* How a kernel takes its input vectors (ft_dot_select says which):
 *   FT_XS_F32       float32 in natural order
 *   FT_XS_BF16      bf16 (the (FT_ISA_AVX512BF16, FT_BF16) kernel)
 *   FT_XS_F32_EO16  float32, each full 16-element block k..k+15 (k % 16 == 0, k + 16 <= K) stored
 *                   as its 8 even then its 8 odd elements; the K % 16 tail in natural order
 *                   (the (FT_ISA_AVX2, FT_BF16) kernel: see ft_eo16_index)
 *   FT_XS_F32_EO32  the same with 32-element blocks (16 even, 16 odd; the K % 32 tail in
 *                   natural order): the (FT_ISA_AVX512, FT_BF16) kernel, ft_eo32_index */
enum { FT_XS_F32 = 0, FT_XS_BF16 = 1, FT_XS_F32_EO16 = 2, FT_XS_F32_EO32 = 3 };
/* Where element i of a K-vector sits in the FT_XS_F32_EO16 order. */
static inline int ft_eo16_index(int i, int K) {
    return i >= (K & ~15) ? i : (i & ~15) | ((i & 1) << 3) | ((i & 15) >> 1);
}
/* Where element i of a K-vector sits in the FT_XS_F32_EO32 order. */
static inline int ft_eo32_index(int i, int K) {
    return i >= (K & ~31) ? i : (i & ~31) | ((i & 1) << 4) | ((i & 31) >> 1);
}

/* Dot products of one weight row with nx vectors: res[j] = sum_k w[k] * xs[j][k], the xs in
 * the kernel's *xs_form. */
typedef void (*ft_dot_fn)(const void *w, int K, const void *const *xs, int nx, float *res);
ft_dot_fn ft_dot_select(int isa, int dtype, int *xs_form);
/* Several rows in one pass: res[r * nx + j] = ws[r].xs[j] for r < nr (1..8), j < nx, the xs
 * as ft_dot_select's; each x load is shared by the nr rows and each row load by the nx inputs
 * (as far as the registers allow). pf_bytes > 0 prefetches every row pf_bytes ahead of its
 * loads (low 2 bits: the hint, 0 T0, 1 T1); where that passes the row's end, pf_skip bytes
 * further (where the row's stream goes on: the caller's next pass takes the rows that follow
 * this pass's, so a row's successor is (rows of its projection in the pass) rows on; the
 * avx2 bf16 kernel uses it, the others prefetch linearly or not at all). Per (row, input) the
 * arithmetic is the same whatever nr is (results do not depend on the blocking). NULL where the
 * path has none (the caller then makes one ft_dot_fn call per row). */
typedef void (*ft_dotn_fn)(const void *const *ws, int nr, int K, const void *const *xs, int nx,
                           float *res, int pf_bytes, int64_t pf_skip);
ft_dotn_fn ft_dotn_select(int isa, int dtype);

/* Sum of nbytes (multiple of 64) of 64-bit words at p, read with the ISA's widest loads. */
uint64_t ft_read_sum(int isa, const void *p, int64_t nbytes);
/* Round to nearest even; NaN stays a quiet NaN. Inline: the callers' loops vectorise it. */
static inline uint16_t ft_f32_to_bf16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* IEEE binary16 -> fp32, exact (subnormals, inf and NaN included). */
static inline float ft_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, ex = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (ex == 0) {
        float f = (float)man * (1.0f / 16777216.0f);  /* zero or subnormal: man * 2^-24 */
        __builtin_memcpy(&u, &f, 4);
        u |= sign;
    } else if (ex == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((ex + 112u) << 23) | (man << 13);
    }
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

typedef struct ft_ffn_job ft_ffn_job;
ft_ffn_job *ft_ffn_job_new(void);
void ft_ffn_job_free(ft_ffn_job *job);

/* Run-time tuning (measured per machine; freetoken/kernels.py KernelTuning). Zero fields take
 * the ISA path's default (ft_tune_defaults). */
typedef struct {
    int item_kb;      /* weight KiB per work item */
    int rows;         /* gate/up rows per pass and projection (1, 2 or 4; dotn paths only) */
    int down_rows;    /* down rows per pass (1, 2 or 4; dotn paths only) */
    int prefetch;     /* software prefetch distance in bytes, low 2 bits the hint (-1: off) */
    int help;         /* 1: the thread that waits runs items too (ft_ffn_help); -1: it only waits */
    int spread;       /* > 0: items grow past item_kb to leave about this many per worker (0: off) */
    int qdot;         /* quantized weights: FT_QDOT_INT8 (0) the integer path where the type has
                       * one (q8_0, q4_0, mxfp4; qdot.h), FT_QDOT_FP32 the fp32 one (qdot_impl.c) */
} ft_tune;
enum { FT_QDOT_INT8 = 0, FT_QDOT_FP32 = 1 };
/* The defaults of (isa, dtype)'s path on a pool of num_threads (help 1, spread 0): item_kb 192,
 * rows 1, down_rows 1, prefetch 2048 into L2 (4096 from 8 threads); the avx2 and avx512 bf16
 * paths item_kb 1024, rows 4, down_rows 4, prefetch 4096 into L2 (ffn_impl.c says why). */
void ft_tune_defaults(int isa, int dtype, int num_threads, ft_tune *out);

/* Group the routes by expert and size the scratch; the job then runs on a pool through
 * ft_ffn_run. Pointers must stay valid until the pool's wait returns. Returns FT_OK or FT_ERR_*.
 * extra: NULL for none (no biases; biases on a quantized bank: FT_ERR_ARG). bf16_x_only: take
 * the avx512bf16 path only when every x is exactly a bf16 value (a bf16 compute dtype), else the
 * fp32-input avx512 path. stage_max_bytes: largest [R, D] fp32 scratch for the staged down mode
 * (ffn_impl.c); larger calls use the direct mode. */
int ft_ffn_prepare(ft_ffn_job *job, int isa, int bf16_x_only, int num_threads,
                   const uint8_t *bank, int64_t bank_nbytes, int64_t slot_stride, int dtype,
                   int hidden, int expert_hidden, int64_t off_gate, int64_t off_up, int64_t off_down,
                   const float *x, int T, const int32_t *token_ids, const int32_t *expert_ids,
                   const float *weights, int R, float *out, int act, const ft_ffn_extra *extra,
                   int64_t stage_max_bytes, const ft_tune *tune);
void ft_ffn_run(void *job, int tid, int num_threads);  /* ft_job_fn */
/* The waiting thread takes items too (as an extra worker, scratch slot num_threads) until none
 * is left, unless the tuning said help=-1; then the caller waits for the pool as usual. */
void ft_ffn_help(ft_ffn_job *job);
int ft_ffn_isa_used(const ft_ffn_job *job);           /* the path the last prepare chose */

/* Diagnostics (tools/bench_cpu_jobs.py --trace): with a buffer set, every job records one entry
 * per work item: when its worker claimed it, when its wait for earlier items ended (a D item's
 * wait for its expert's G items; claim for G items) and when it ended (ft_now_ns, pool.h). */
typedef struct {
    int64_t claim_ns, ready_ns, end_ns;
    int32_t tid, item;
} ft_trace_rec;
void ft_ffn_set_trace(ft_ffn_job *job, ft_trace_rec *buf, int cap);  /* cap 0: off */
void ft_ffn_mark_done(ft_ffn_job *job);  /* the waiting thread saw the job end (traced jobs) */
/* out[8]: submit ns (end of prepare), done ns, G items, items, experts, staged, bytes of one
 * G item, of one D item (the last of each may be shorter); returns the records written. */
int ft_ffn_trace_info(const ft_ffn_job *job, int64_t *out);
const ft_trace_rec *ft_ffn_trace_records(const ft_ffn_job *job);  /* the buffer, NULL: off */
void ft_ffn_set_pool(ft_ffn_job *job, void *pool);

/* STREAM-like read: the workers sum a buffer in 256 KiB blocks taken from a shared counter
 * (next: 0 before each submit), as the expert kernel takes its items (ft_job_fn); the waiting
 * thread helps as in ft_ffn_help (tid num_threads) when the kernel's tuning has it help. */
typedef struct {
    int isa;
    const uint8_t *buf;
    int64_t nbytes;
    int64_t next;
    uint64_t sums[1025];
} ft_read_job;
void ft_read_run(void *job, int tid, int num_threads);

#endif
