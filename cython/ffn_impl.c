/* One MoE layer's CPU routes on the worker pool: group by expert, then one stream of work items.
 *
 *   prepare (caller's thread)  counting-sort the R routes by expert: U groups, each a contiguous
 *                              run of (token, weight); convert x to bf16 for the bf16-dot path
 *   G items (u, block of I)    for each row i: g = gate[i].x_t, v = up[i].x_t for every token t
 *                              of expert u (+ the gate/up biases), then h[route, i] = act(g) * v
 *                              (or the clamped SwiGLU of g and v: ffn.h)
 *   D items                    down rows of one expert u (staged mode) or of every expert
 *                              (direct mode); see below
 *
 * Items are taken in order from one atomic counter: every G item, then every D item, so all
 * workers stream weights at once and a preempted worker delays only its current item. There is
 * no barrier: a D item of expert u waits (spinning) only for u's G items (a per-expert counter),
 * and those finished long before except for the last expert, whose G tail the D items of the
 * earlier experts overlap.
 *
 *   staged (R * D floats fit stage_max_bytes; every decode call)  D item (u, block of D rows)
 *       writes y[route, d] = down_u[d].h[route]; the worker that completes the last expert of a
 *       row block adds out[t, d] += w * y[route, d] over the routes in sorted order.
 *   direct (large prefill batches)  D item = block of D rows over every expert in order, waiting
 *       for all G items; it is the only writer of out[:, block] and adds w * down_u[d].h directly.
 * Both modes add each route's term to out in the same (sorted-route) order, so results do not
 * depend on the thread count or on timing.
 *
 * Worked example: routes (t,e,w) = (0,5,.6) (1,5,.3) (0,2,.4) (1,9,.7)
 *   -> groups u0: e=2 {(t0,.4)}   u1: e=5 {(t0,.6),(t1,.3)}   u2: e=9 {(t1,.7)}
 *   G items read gate/up of e=5 once for both tokens; staged D item (u1, rows 0..63) reads
 *   rows 0..63 of e=5's down once for both tokens and writes y[1..2, 0:64].
 */
#include <math.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "ffn.h"
#include "pool.h"
#include "qdot.h"

struct ft_ffn_job {
    void *pool;
    ft_dot_fn dot;
    ft_dotn_fn dotn;          /* several rows per pass (gate and up rows together), or NULL */
    int xs_form;  /* how dot takes its inputs (FT_XS_*): x and h are kept in that form */
    ft_qdot_fn qdot;          /* quantized weights (qdot.h): used instead of dot / dotn, or NULL */
    ft_qdot8_fn qdot8;        /* the integer path (qdot.h): used instead of qdot, or NULL */
    uint8_t *xq, *hq;         /* qdot8: [T] x and [R] h quantized (ft_quantize_x8), xq1 / xq2 apart */
    int64_t xq1, xq2;
    int64_t row1, row2;       /* bytes of one gate/up row, of one down row (quantized: the qs) */
    int64_t sc1, sc2;         /* quantized: the scales' offset inside gate/up, inside down */
    int64_t tg1, tg2;         /* nvfp4: g's offset inside gate/up, inside down; else -1 */
    int isa;
    const uint8_t *bank;
    int64_t slot_stride, off_gate, off_up, off_down;
    int esize, D, I, T, R, U, act, max_group, dtype;
    float alpha, limit;       /* FT_ACT_CLAMPED_SWIGLU's (ft_ffn_extra) */
    int64_t off_gb, off_ub, off_db;  /* expert biases in the slot, -1: none */
    int bias_dtype;           /* their elements' dtype (ft_ffn_extra) */
    const float *x;
    float *out;
    /* grouped routes: group u is sorted positions u_start[u] .. u_start[u+1]-1 */
    int *u_expert, *u_start, *r_token, *counts;
    float *r_weight;
    const void **r_x, **r_h;  /* input vector of each sorted route, for phase 1 and 2 */
    float *h;                 /* [R, I] fp32 hidden (FT_XS_F32, FT_XS_F32_EO16/32: in that order) */
    uint16_t *hb, *xb;        /* [R, I], [T, D] bf16 copies (FT_XS_BF16) */
    float *xe;                /* [T, D] x in the even/odd order (FT_XS_F32_EO16/32) */
    float *tmp;               /* per worker: tmp_stride floats (dot results), 64-byte aligned */
    size_t tmp_stride;
    int pass_rows, pass_rows2, pf;  /* gate/up rows and down rows per pass; prefetch (ft_tune) */
    int nt, help;             /* pool threads; the waiting thread helps (slot nt of tmp) */
    float *y;                 /* staged mode: [R, D] down outputs before the weighted sum */
    int staged;
    int rows1, nb1, n_g, rows2, nb2, n_items;
    _Atomic int *g_done;      /* per expert: finished G items (stride CTR_STRIDE ints) */
    _Atomic int *d_done;      /* staged, per row block of D: experts finished */
    void *g_raw, *d_raw;      /* their allocations (the counters start on a 64-byte line) */
    size_t cap[17];
    ft_trace_rec *trace;      /* per-item timeline (ft_ffn_set_trace), NULL: off */
    int trace_cap;
    int64_t t_submit, t_done;
    /* Written by every worker: each on its own line, away from the read-mostly fields above
     * (a shared line made every item claim invalidate them in all the other cores). */
    _Alignas(64) _Atomic int g_total;  /* direct: all finished G items */
    _Alignas(64) _Atomic int next;
    _Alignas(64) _Atomic int trace_n;
    char pad_[64 - sizeof(int)];
};

enum { C_UEXP, C_USTART, C_RTOK, C_COUNTS, C_RW, C_RX, C_RH, C_H, C_HB, C_XB, C_TMP, C_Y, C_GD, C_DD, C_XE,
       C_XQ, C_HQ };
enum { CTR_STRIDE = 16 };                     /* one 64-byte line per counter */
/* ft_tune defaults per path (kernels.KernelTuning's "auto"); prefetch into L2 (hint bit 1).
 * The avx2 and avx512 bf16 paths run one kernel (at two widths) that wants larger items, more
 * rows per pass and a longer prefetch than the others (0.74 x STREAM against 0.61 with the
 * others' item_kb on DeepSeek-V3). The other paths prefetch further with a large pool
 * (MANY_THREADS or more): the more threads stream at once, the longer a load waits in the
 * memory system, and the more bytes each thread must have in flight. The runs:
 * docs/MEASUREMENTS.md#kernel-defaults-per-isa-path */
enum { DEF_ITEM_KB = 192, DEF_ROWS = 1, DEF_DOWN_ROWS = 1, DEF_PREFETCH = 2048 | 1, DEF_HELP = 1 };
enum { MANY_THREADS = 8, MANY_PREFETCH = 4096 | 1 };
enum { AVX2_ITEM_KB = 1024, AVX2_ROWS = 4, AVX2_DOWN_ROWS = 4, AVX2_PREFETCH = 4096 | 1 };

void ft_tune_defaults(int isa, int dtype, int num_threads, ft_tune *t) {
    const int avx2 = (isa == FT_ISA_AVX2 || isa == FT_ISA_AVX512) && dtype == FT_BF16;
    /* the 4-bit types on the avx2 path: rows in fours share each input block and a row's fixed
     * cost (the down rows are short), +23-25% at batch 1 on a 2-core AVX2 VM
     * (docs/MEASUREMENTS.md#quantized-experts-on-the-cpu); q8_0 gained nothing there */
    const int wide = avx2 || (isa == FT_ISA_AVX2 && (dtype == FT_Q4_0 || dtype == FT_MXFP4));
    t->item_kb = wide ? AVX2_ITEM_KB : DEF_ITEM_KB;
    t->rows = wide ? AVX2_ROWS : DEF_ROWS;
    t->down_rows = wide ? AVX2_DOWN_ROWS : DEF_DOWN_ROWS;
    t->prefetch = avx2 ? AVX2_PREFETCH : num_threads >= MANY_THREADS ? MANY_PREFETCH : DEF_PREFETCH;
    t->help = DEF_HELP;
    t->spread = 0;
    t->qdot = FT_QDOT_INT8;
}

/* Grow-only scratch: keeps its buffers across calls on the same pool. */
static int grow(void *pp, size_t *cap, size_t need) {
    void **p = (void **)pp;
    if (need <= *cap && *p) return 0;
    size_t n = need > 2 * *cap ? need : 2 * *cap;
    if (n < 64) n = 64;
    void *q = realloc(*p, n);
    if (!q) return -1;
    *p = q;
    *cap = n;
    return 0;
}

ft_ffn_job *ft_ffn_job_new(void) {
    ft_ffn_job *j = aligned_alloc(64, sizeof(ft_ffn_job));  /* sizeof is a multiple of 64 */
    if (j) memset(j, 0, sizeof(*j));
    return j;
}

static _Atomic int *line_aligned(void *p) { return (_Atomic int *)(((uintptr_t)p + 63) & ~(uintptr_t)63); }

void ft_ffn_job_free(ft_ffn_job *j) {
    if (!j) return;
    free(j->u_expert); free(j->u_start); free(j->r_token); free(j->counts); free(j->r_weight);
    free(j->r_x); free(j->r_h); free(j->h); free(j->hb); free(j->xb); free(j->xe); free(j->tmp);
    free(j->y); free(j->g_raw); free(j->d_raw); free(j->xq); free(j->hq);
    free(j);
}

void ft_ffn_set_pool(ft_ffn_job *job, void *pool) { job->pool = pool; }

void ft_ffn_set_trace(ft_ffn_job *j, ft_trace_rec *buf, int cap) {
    j->trace = cap > 0 ? buf : NULL;
    j->trace_cap = cap > 0 ? cap : 0;
    atomic_store(&j->trace_n, 0);
}

void ft_ffn_mark_done(ft_ffn_job *j) {
    if (j->trace) j->t_done = ft_now_ns();
}

int ft_ffn_trace_info(const ft_ffn_job *j, int64_t *out) {
    out[0] = j->t_submit; out[1] = j->t_done; out[2] = j->n_g; out[3] = j->n_items;
    out[4] = j->U; out[5] = j->staged; out[6] = (int64_t)j->rows1 * 2 * j->row1;
    out[7] = (int64_t)j->rows2 * j->row2 * (j->staged ? 1 : j->U);
    int n = atomic_load(&j->trace_n);
    return n < j->trace_cap ? n : j->trace_cap;
}

const ft_trace_rec *ft_ffn_trace_records(const ft_ffn_job *j) { return j->trace; }

static int ceil_div(int64_t a, int64_t b) { return (int)((a + b - 1) / b); }

static int all_bf16_exact(const float *x, size_t n) {
    uint32_t any = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], 4);
        any |= u & 0xffffu;
    }
    return any == 0;
}

int ft_ffn_isa_used(const ft_ffn_job *j) { return j->isa; }

int ft_ffn_prepare(ft_ffn_job *j, int isa, int bf16_x_only, int nt, const uint8_t *bank, int64_t bank_nbytes,
                   int64_t slot_stride, int dtype, int D, int I, int64_t og, int64_t ou, int64_t od,
                   const float *x, int T, const int32_t *tok, const int32_t *exp,
                   const float *w, int R, float *out, int act, const ft_ffn_extra *extra,
                   int64_t stage_max, const ft_tune *tune) {
    if (!ft_isa_supported(isa)) return FT_ERR_ISA;
    if (act < FT_ACT_SILU || act > FT_ACT_CLAMPED_SWIGLU) return FT_ERR_ARG;
    j->alpha = extra ? extra->alpha : 0.0f;
    j->limit = extra ? extra->limit : 0.0f;
    j->off_gb = extra ? extra->off_gate_bias : -1;
    j->off_ub = extra ? extra->off_up_bias : -1;
    j->off_db = extra ? extra->off_down_bias : -1;
    j->bias_dtype = extra ? extra->bias_dtype : FT_FP32;
    if (j->off_gb >= 0 && (j->bias_dtype < FT_BF16 || j->bias_dtype > FT_FP32)) return FT_ERR_ARG;
    if ((j->off_gb < 0) != (j->off_ub < 0) || (j->off_gb < 0) != (j->off_db < 0)) return FT_ERR_ARG;
    if (j->off_gb >= slot_stride || j->off_ub >= slot_stride || j->off_db >= slot_stride) return FT_ERR_ARG;
    if (isa == FT_ISA_AVX512BF16 && bf16_x_only && !all_bf16_exact(x, (size_t)T * D)) isa = FT_ISA_AVX512;
    j->qdot8 = NULL;
    if (ft_is_quant(dtype)) {  /* the integer path unless the tuning asks for fp32 (or nvfp4) */
        if (!(tune && tune->qdot == FT_QDOT_FP32)) j->qdot8 = ft_qdot8_select(isa, dtype);
        isa = j->qdot8 ? ft_qdot8_isa(isa) : ft_qdot_isa(isa);
    }
    j->isa = isa;
    j->dot = ft_dot_select(isa, dtype, &j->xs_form);
    j->qdot = ft_qdot_select(isa, dtype);
    if ((!j->dot && !j->qdot) || slot_stride <= 0 || nt < 1) return FT_ERR_ARG;
    if (j->qdot && (D % ft_qk_multiple(dtype) || I % ft_qk_multiple(dtype))) return FT_ERR_ARG;
    j->dotn = ft_dotn_select(isa, dtype);
    ft_tune def;
    ft_tune_defaults(isa, dtype, nt, &def);
    int64_t item_bytes = (int64_t)(tune && tune->item_kb > 0 ? tune->item_kb : def.item_kb) << 10;
    int rows = tune && tune->rows > 0 ? tune->rows : def.rows;
    j->pass_rows = rows >= 4 ? 4 : (rows >= 2 ? 2 : 1);
    rows = tune && tune->down_rows > 0 ? tune->down_rows : def.down_rows;
    j->pass_rows2 = rows >= 4 ? 4 : (rows >= 2 ? 2 : 1);
    j->help = tune && tune->help ? tune->help > 0 : def.help;
    j->nt = nt;
    j->pf = tune && tune->prefetch ? (tune->prefetch < 0 ? 0 : tune->prefetch) : def.prefetch;
    int64_t E = bank_nbytes / slot_stride;
    j->bank = bank; j->slot_stride = slot_stride;
    j->off_gate = og; j->off_up = ou; j->off_down = od;
    j->esize = dtype == FT_FP32 ? 4 : 2;
    j->row1 = j->qdot ? ft_qrow_bytes(dtype, D) : (int64_t)D * j->esize;
    j->row2 = j->qdot ? ft_qrow_bytes(dtype, I) : (int64_t)I * j->esize;
    j->sc1 = j->qdot ? ft_qscales_offset(dtype, I, D) : 0;
    j->sc2 = j->qdot ? ft_qscales_offset(dtype, D, I) : 0;
    j->tg1 = ft_qtensor_scale_offset(dtype, I, D);
    j->tg2 = ft_qtensor_scale_offset(dtype, D, I);
    j->D = D; j->I = I; j->T = T; j->R = R; j->act = act; j->x = x; j->out = out; j->dtype = dtype;

    size_t *c = j->cap;
    if (grow(&j->counts, &c[C_COUNTS], (E + 1) * sizeof(int)) || grow(&j->r_token, &c[C_RTOK], R * sizeof(int)) ||
        grow(&j->r_weight, &c[C_RW], R * sizeof(float)) || grow(&j->r_x, &c[C_RX], R * sizeof(void *)) ||
        grow(&j->r_h, &c[C_RH], R * sizeof(void *)))
        return FT_ERR_NOMEM;
    int *cnt = j->counts;
    memset(cnt, 0, (E + 1) * sizeof(int));
    for (int r = 0; r < R; r++) {
        if (tok[r] < 0 || tok[r] >= T) return FT_ERR_TOKEN;
        if (exp[r] < 0 || exp[r] >= E) return FT_ERR_EXPERT;
        cnt[exp[r]]++;
    }
    int U = 0;
    for (int64_t e = 0; e < E; e++) U += cnt[e] > 0;
    if (grow(&j->u_expert, &c[C_UEXP], (U + 1) * sizeof(int)) || grow(&j->u_start, &c[C_USTART], (U + 1) * sizeof(int)))
        return FT_ERR_NOMEM;
    /* counts[e] becomes the next free sorted position of expert e (stable counting sort) */
    int u = 0, pos = 0, max_group = 0;
    for (int64_t e = 0; e < E; e++) {
        int n = cnt[e];
        if (!n) continue;
        j->u_expert[u] = (int)e;
        j->u_start[u++] = pos;
        cnt[e] = pos;
        pos += n;
        if (n > max_group) max_group = n;
    }
    j->u_start[U] = R;
    j->U = U;
    j->max_group = max_group;

    size_t hsz = (size_t)R * I;
    const int xs_bf16 = j->xs_form == FT_XS_BF16;
    const void *xin = x;
    if (xs_bf16) {
        if (grow(&j->xb, &c[C_XB], (size_t)T * D * 2) || grow(&j->hb, &c[C_HB], hsz * 2)) return FT_ERR_NOMEM;
        for (size_t i = 0; i < (size_t)T * D; i++) j->xb[i] = ft_f32_to_bf16(x[i]);
        xin = j->xb;
    } else if (grow(&j->h, &c[C_H], hsz * sizeof(float))) {
        return FT_ERR_NOMEM;
    }
    if (j->xs_form == FT_XS_F32_EO16 || j->xs_form == FT_XS_F32_EO32) {
        const int eo32 = j->xs_form == FT_XS_F32_EO32;
        if (grow(&j->xe, &c[C_XE], (size_t)T * D * sizeof(float))) return FT_ERR_NOMEM;
        for (int t = 0; t < T; t++) {
            const float *src = x + (size_t)t * D;
            float *dst = j->xe + (size_t)t * D;
            if (eo32)
                for (int i = 0; i < D; i++) dst[ft_eo32_index(i, D)] = src[i];
            else
                for (int i = 0; i < D; i++) dst[ft_eo16_index(i, D)] = src[i];
        }
        xin = j->xe;
    }
    if (j->qdot8) {  /* x quantized once per token, h per route by the G items (phase1_item) */
        j->xq1 = ft_xq_stride(D);
        j->xq2 = ft_xq_stride(I);
        if (grow(&j->xq, &c[C_XQ], (size_t)T * j->xq1) || grow(&j->hq, &c[C_HQ], (size_t)R * j->xq2))
            return FT_ERR_NOMEM;
        for (int t = 0; t < T; t++) ft_quantize_x8(x + (size_t)t * D, D, 0, D / FT_QBLOCK, dtype, j->xq + t * j->xq1);
    }
    for (int r = 0; r < R; r++) {
        int p = cnt[exp[r]]++;
        j->r_token[p] = tok[r];
        j->r_weight[p] = w[r];
        j->r_x[p] = (const uint8_t *)xin + (size_t)tok[r] * D * (xs_bf16 ? 2 : 4);
        j->r_h[p] = xs_bf16 ? (const void *)(j->hb + (size_t)p * I) : (const void *)(j->h + (size_t)p * I);
        if (j->qdot8) {
            j->r_x[p] = j->xq + tok[r] * j->xq1;
            j->r_h[p] = j->hq + p * j->xq2;
        }
    }

    /* Items of about item_bytes of weights (rows in multiples of 4 / 16), so the tail after
     * the last item is short at any batch; with tune->spread, larger where the call has more
     * than spread items of that size per worker (fewer item starts and claims in large calls,
     * the same tail in small ones). Tried and removed: item counts made multiples of the
     * workers, and a `tail` of small items at each phase's end; neither moved decode
     * (docs/MEASUREMENTS.md#work-items-of-a-cpu-job). */
    int64_t per_row1 = 2 * j->row1, per_row2 = j->row2;
    if (tune && tune->spread > 0) {
        int64_t per_worker = (int64_t)U * 3 * I * j->row1 / ((int64_t)(nt + j->help) * tune->spread);
        if (per_worker > item_bytes) item_bytes = per_worker < ((int64_t)64 << 20) ? per_worker : (int64_t)64 << 20;
    }
    int r1 = (int)(item_bytes / per_row1), r2 = (int)(item_bytes / per_row2);
    j->rows1 = r1 < 4 ? 4 : (r1 > I ? I : r1 / 4 * 4);
    if (j->qdot8)  /* whole 32-blocks of h per item: the item quantizes them (I % 32 == 0) */
        j->rows1 = r1 < FT_QBLOCK ? FT_QBLOCK : (r1 > I ? I : r1 / FT_QBLOCK * FT_QBLOCK);
    j->nb1 = ceil_div(I, j->rows1);
    /* per worker (and the helping thread): one pass's dot results, up to 2 * 4 rows of
     * max_group inputs, on the worker's own cache lines */
    j->tmp_stride = ((size_t)8 * max_group + 15) / 16 * 16 + 16;
    if (grow(&j->tmp, &c[C_TMP], ((size_t)(nt + 1) * j->tmp_stride + 16) * sizeof(float))) return FT_ERR_NOMEM;
    j->n_g = U * j->nb1;
    j->staged = (int64_t)R * D * (int64_t)sizeof(float) <= stage_max;
    j->rows2 = r2 < 16 ? 16 : (r2 > D ? D : r2 / 16 * 16);  /* y rows stay 64-byte apart */
    if (!j->staged) {
        int r = ceil_div(D, 4 * nt);
        j->rows2 = r < 4 ? 4 : (r > D ? D : r);
    }
    j->nb2 = ceil_div(D, j->rows2);
    j->n_items = j->n_g + (j->staged ? U * j->nb2 : j->nb2);
    if (grow(&j->g_raw, &c[C_GD], (size_t)(U + 2) * CTR_STRIDE * sizeof(int)) ||
        grow(&j->d_raw, &c[C_DD], (size_t)(j->nb2 + 2) * CTR_STRIDE * sizeof(int)) ||
        (j->staged && grow(&j->y, &c[C_Y], (size_t)R * D * sizeof(float))))
        return FT_ERR_NOMEM;
    j->g_done = line_aligned(j->g_raw);
    j->d_done = line_aligned(j->d_raw);
    for (int k = 0; k < U; k++) atomic_init(&j->g_done[k * CTR_STRIDE], 0);
    for (int k = 0; k < j->nb2; k++) atomic_init(&j->d_done[k * CTR_STRIDE], 0);
    atomic_init(&j->g_total, 0);
    atomic_init(&j->next, 0);
    if (j->trace) {
        atomic_store(&j->trace_n, 0);
        j->t_submit = ft_now_ns();
        j->t_done = 0;
    }
    return FT_OK;
}

static inline float act_gate(float g, int act) {
    switch (act) {
    case FT_ACT_GELU: return 0.5f * g * (1.0f + erff(g * 0.70710678118654752f));
    case FT_ACT_GELU_TANH: {
        float u = 0.79788456080286536f * (g + 0.044715f * g * g * g);
        return 0.5f * g * (1.0f + tanhf(u));
    }
    default: return g / (1.0f + expf(-g));
    }
}

/* h of one row from its gate and up values (biases added): act(g) * v, or the clamped SwiGLU */
static inline float act_fn(float g, float v, const ft_ffn_job *j) {
    if (j->act == FT_ACT_CLAMPED_SWIGLU) {
        float l = j->limit;
        g = g < l ? g : l;
        v = v < -l ? -l : (v > l ? l : v);
        return g / (1.0f + expf(-j->alpha * g)) * (v + 1.0f);
    }
    return act_gate(g, j->act) * v;
}

/* res[r * n + t] = row r . input t for the rows ws[0..nr-1]: one dotn pass, or a dot per row;
 * quantized rows, their scales ss[0..nr-1] and tensor scales gs[0..nr-1]: one qdot call. */
static inline void rows_dot(const ft_ffn_job *j, const void **ws, const void **ss, const float *gs,
                            int nr, int K, const void *const *xs, int n, float *res, int64_t pf_skip) {
    if (j->qdot8) {
        j->qdot8(ws, ss, nr, K, (const uint8_t *const *)xs, n, res, j->pf);
        return;
    }
    if (j->qdot) {
        j->qdot(ws, ss, gs, nr, K, (const float *const *)xs, n, res, j->pf);
        return;
    }
    if (j->dotn) {
        j->dotn(ws, nr, K, xs, n, res, j->pf, pf_skip);
        return;
    }
    for (int r = 0; r < nr; r++) j->dot(ws[r], K, xs, n, res + (size_t)r * n);
}

/* Quantized: the block scales of row `row` of a projection with K-element rows, its scales at
 * `scales` (qdot.h). */
static inline const void *qscales(const ft_ffn_job *j, const uint8_t *scales, int row, int K) {
    return ft_qrow_scales(j->dtype, scales, row, K);
}

/* nvfp4: the tensor scale g of the projection at `proj`, g at in-projection offset tg; 1 for
 * the other types (unread). */
static inline float qtensor_scale(const uint8_t *proj, int64_t tg) {
    float g = 1.0f;
    if (tg >= 0) memcpy(&g, proj + tg, 4);
    return g;
}

static void phase1_item(ft_ffn_job *j, int item, float *res) {
    int u = item / j->nb1, blk = item % j->nb1;
    int s = j->u_start[u], n = j->u_start[u + 1] - s;
    int i0 = blk * j->rows1, i1 = i0 + j->rows1 < j->I ? i0 + j->rows1 : j->I;
    const uint8_t *slot = j->bank + (int64_t)j->u_expert[u] * j->slot_stride;
    size_t row_bytes = (size_t)j->row1;
    const void *const *xs = j->r_x + s;
    const void *ws[8], *ss[8];
    float gs[8];
    const float g_gate = qtensor_scale(slot + j->off_gate, j->tg1), g_up = qtensor_scale(slot + j->off_up, j->tg1);
    for (int i = i0; i < i1; i += j->pass_rows) {
        int p = i1 - i < j->pass_rows ? i1 - i : j->pass_rows;
        /* gate rows i.. then up rows i.. (ws[q], ws[p + q]); on the avx2 bf16 path gate and up
         * alternate (ws[2q], ws[2q + 1]), as on the int8 path: their kernels pair neighbouring rows, and a gate row
         * beside an up row makes two streams that each go on where the last pass left them (two
         * neighbouring rows of one projection made the hardware prefetcher lose them) */
        const int il = j->xs_form == FT_XS_F32_EO16 || j->xs_form == FT_XS_F32_EO32 || j->qdot8;
        const int gi = il ? 2 : 1, ui = il ? 1 : p, us = il ? 2 : 1;  /* gate q at gi * q, up q at ui + us * q */
        for (int q = 0; q < p; q++) {
            ws[gi * q] = slot + j->off_gate + (i + q) * row_bytes;
            ws[ui + us * q] = slot + j->off_up + (i + q) * row_bytes;
            if (j->qdot) {
                ss[gi * q] = qscales(j, slot + j->off_gate + j->sc1, i + q, j->D);
                ss[ui + us * q] = qscales(j, slot + j->off_up + j->sc1, i + q, j->D);
                gs[gi * q] = g_gate;
                gs[ui + us * q] = g_up;
            }
        }
        rows_dot(j, ws, ss, gs, 2 * p, j->D, xs, n, res, (int64_t)(p - 1) * row_bytes);
        float gb[4] = {0}, ub[4] = {0};
        if (j->off_gb >= 0)
            for (int q = 0; q < p; q++) {
                gb[q] = ft_load_f32(slot + j->off_gb, i + q, j->bias_dtype);
                ub[q] = ft_load_f32(slot + j->off_ub, i + q, j->bias_dtype);
            }
        for (int t = 0; t < n; t++) {
            size_t at = (size_t)(s + t) * j->I;
            for (int q = 0; q < p; q++) {
                float hv = act_fn(res[gi * q * n + t] + gb[q], res[(ui + us * q) * n + t] + ub[q], j);
                if (j->xs_form == FT_XS_BF16) j->hb[at + i + q] = ft_f32_to_bf16(hv);
                else if (j->xs_form == FT_XS_F32_EO16) j->h[at + ft_eo16_index(i + q, j->I)] = hv;
                else if (j->xs_form == FT_XS_F32_EO32) j->h[at + ft_eo32_index(i + q, j->I)] = hv;
                else j->h[at + i + q] = hv;
            }
        }
    }
    if (j->qdot8)  /* this item's whole blocks of h, for the down items (after g_done) */
        for (int t = 0; t < n; t++)
            ft_quantize_x8(j->h + (size_t)(s + t) * j->I, j->I, i0 / FT_QBLOCK, i1 / FT_QBLOCK, j->dtype,
                           j->hq + (s + t) * j->xq2);
}

/* Spin until *ctr >= want, yielding the core now and then: the item we wait for may belong to
 * a thread that shares this core (the waiting thread helping, or more threads than cores). */
static inline void spin_until(_Atomic int *ctr, int want) {
    for (unsigned i = 1; atomic_load_explicit(ctr, memory_order_acquire) < want; i++) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
        if (!(i & 63)) sched_yield();
    }
}

/* Direct mode: rows d0..d1 of out, every expert in order (needs every G item done). */
static void direct_item(ft_ffn_job *j, int blk, float *res, int64_t *ready) {
    int d0 = blk * j->rows2, d1 = d0 + j->rows2 < j->D ? d0 + j->rows2 : j->D;
    size_t row_bytes = (size_t)j->row2;
    const void *ws[4], *ss[4];
    float gs[4];
    spin_until(&j->g_total, j->n_g);
    if (j->trace) *ready = ft_now_ns();
    for (int u = 0; u < j->U; u++) {
        int s = j->u_start[u], n = j->u_start[u + 1] - s;
        const uint8_t *down = j->bank + (int64_t)j->u_expert[u] * j->slot_stride + j->off_down;
        for (int d = d0; d < d1; d += j->pass_rows2) {
            int p = d1 - d < j->pass_rows2 ? d1 - d : j->pass_rows2;
            for (int q = 0; q < p; q++) ws[q] = down + (d + q) * row_bytes;
            if (j->qdot)
                for (int q = 0; q < p; q++) {
                    ss[q] = qscales(j, down + j->sc2, d + q, j->I);
                    gs[q] = qtensor_scale(down, j->tg2);
                }
            rows_dot(j, ws, ss, gs, p, j->I, j->r_h + s, n, res, (int64_t)(p - 1) * row_bytes);
            float db[4] = {0};
            if (j->off_db >= 0)
                for (int q = 0; q < p; q++) db[q] = ft_load_f32(down - j->off_down + j->off_db, d + q, j->bias_dtype);
            for (int t = 0; t < n; t++) {
                float w = j->r_weight[s + t], *o = j->out + (size_t)j->r_token[s + t] * j->D + d;
                for (int q = 0; q < p; q++) o[q] += w * (res[q * n + t] + db[q]);
            }
        }
    }
}

/* Staged mode: y[route, d0..d1] for the routes of expert u; the last expert of the block adds
 * the block into out. */
static void staged_item(ft_ffn_job *j, int item, float *res, int64_t *ready) {
    int u = item / j->nb2, blk = item % j->nb2;
    int d0 = blk * j->rows2, d1 = d0 + j->rows2 < j->D ? d0 + j->rows2 : j->D;
    int s = j->u_start[u], n = j->u_start[u + 1] - s;
    size_t row_bytes = (size_t)j->row2;
    const uint8_t *down = j->bank + (int64_t)j->u_expert[u] * j->slot_stride + j->off_down;
    const void *ws[4], *ss[4];
    float gs[4];
    spin_until(&j->g_done[u * CTR_STRIDE], j->nb1);
    if (j->trace) *ready = ft_now_ns();
    for (int d = d0; d < d1; d += j->pass_rows2) {
        int p = d1 - d < j->pass_rows2 ? d1 - d : j->pass_rows2;
        for (int q = 0; q < p; q++) ws[q] = down + (d + q) * row_bytes;
        if (j->qdot)
            for (int q = 0; q < p; q++) {
                ss[q] = qscales(j, down + j->sc2, d + q, j->I);
                gs[q] = qtensor_scale(down, j->tg2);
            }
        rows_dot(j, ws, ss, gs, p, j->I, j->r_h + s, n, res, (int64_t)(p - 1) * row_bytes);
        float db[4] = {0};
        if (j->off_db >= 0)
            for (int q = 0; q < p; q++) db[q] = ft_load_f32(down - j->off_down + j->off_db, d + q, j->bias_dtype);
        for (int t = 0; t < n; t++)
            for (int q = 0; q < p; q++) j->y[(size_t)(s + t) * j->D + d + q] = res[q * n + t] + db[q];
    }
    if (atomic_fetch_add_explicit(&j->d_done[blk * CTR_STRIDE], 1, memory_order_acq_rel) != j->U - 1) return;
    for (int p = 0; p < j->R; p++) {
        float w = j->r_weight[p], *o = j->out + (size_t)j->r_token[p] * j->D;
        const float *yp = j->y + (size_t)p * j->D;
        for (int d = d0; d < d1; d++) o[d] += w * yp[d];
    }
}

void ft_ffn_run(void *arg, int tid, int nt) {
    (void)nt;
    ft_ffn_job *j = (ft_ffn_job *)arg;
    float *res = (float *)(((uintptr_t)j->tmp + 63) & ~(uintptr_t)63) + (size_t)tid * j->tmp_stride;
    for (;;) {
        int it = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (it >= j->n_items) break;
        int64_t claim = j->trace ? ft_now_ns() : 0, ready = claim;
        if (it < j->n_g) {
            phase1_item(j, it, res);
            atomic_fetch_add_explicit(&j->g_done[it / j->nb1 * CTR_STRIDE], 1, memory_order_release);
            if (!j->staged) atomic_fetch_add_explicit(&j->g_total, 1, memory_order_release);
        } else if (j->staged) {
            staged_item(j, it - j->n_g, res, &ready);
        } else {
            direct_item(j, it - j->n_g, res, &ready);
        }
        if (j->trace) {
            int k = atomic_fetch_add_explicit(&j->trace_n, 1, memory_order_relaxed);
            if (k < j->trace_cap) j->trace[k] = (ft_trace_rec){claim, ready, ft_now_ns(), tid, it};
        }
    }
}

void ft_ffn_help(ft_ffn_job *j) {
    if (j->help) ft_ffn_run(j, j->nt, j->nt);
}

void ft_read_run(void *arg, int tid, int nt) {
    /* 256 KiB blocks from a shared counter: all workers stream through the same region at once
     * and a preempted worker delays only its current block, as in the expert kernel; so the
     * read is an upper bound for the kernel under the same conditions, not a weaker baseline. */
    (void)nt;
    ft_read_job *j = (ft_read_job *)arg;
    const int64_t blk = 256 << 10;
    uint64_t s = 0;
    for (;;) {
        int64_t a = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED) * blk;
        if (a >= j->nbytes) break;
        int64_t n = j->nbytes - a < blk ? j->nbytes - a : blk;
        s += ft_read_sum(j->isa, j->buf + a, n);
    }
    j->sums[tid] = s;
}
