/* One MoE layer's CPU routes on the worker pool: group by expert, then two phases.
 *
 *   prepare (caller's thread)  counting-sort the R routes by expert: U groups, each a contiguous
 *                              run of (token, weight); convert x to bf16 for the bf16-dot path
 *   phase 1 (all workers)      work item = (expert u, block of rows of I): for each row i,
 *                              g = gate[i].x_t, v = up[i].x_t for every token t of u, then
 *                              h[route, i] = act(g) * v
 *   barrier
 *   phase 2 (all workers)      work item = block of rows of D, over every expert u:
 *                              out[t, d] += w_route * down_u[d].h[route]
 *
 * Worked example: routes (t,e,w) = (0,5,.6) (1,5,.3) (0,2,.4) (1,9,.7)
 *   -> groups u0: e=2 {(t0,.4)}   u1: e=5 {(t0,.6),(t1,.3)}   u2: e=9 {(t1,.7)}
 *   phase 1 reads gate/up of e=5 once for both tokens; phase 2 item d in [0,64) reads rows
 *   0..63 of down for e=2, 5, 9 and is the only writer of out[:, 0:64] (no atomics needed).
 * Work items are taken from an atomic counter, so every worker streams weights at once and a
 * preempted worker delays only its current block.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "ffn.h"
#include "pool.h"

struct ft_ffn_job {
    void *pool;
    ft_dot_fn dot;
    int xs_bf16;  /* dot takes bf16 inputs: x and h are kept as bf16 copies */
    int isa;
    const uint8_t *bank;
    int64_t slot_stride, off_gate, off_up, off_down;
    int esize, D, I, T, R, U, act, max_group;
    const float *x;
    float *out;
    /* grouped routes: group u is sorted positions u_start[u] .. u_start[u+1]-1 */
    int *u_expert, *u_start, *r_token, *counts;
    float *r_weight;
    const void **r_x, **r_h;  /* input vector of each sorted route, for phase 1 and 2 */
    float *h;                 /* [R, I] fp32 hidden, or NULL on the bf16 path */
    uint16_t *hb, *xb;        /* [R, I], [T, D] bf16 copies on the bf16 path */
    float *tmp;               /* per worker: 2 * max_group floats */
    int rows1, items1_per_u, n_items1, rows2, n_items2;
    _Atomic int next1, next2;
    size_t cap[12];
};

enum { C_UEXP, C_USTART, C_RTOK, C_COUNTS, C_RW, C_RX, C_RH, C_H, C_HB, C_XB, C_TMP };

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

ft_ffn_job *ft_ffn_job_new(void) { return calloc(1, sizeof(ft_ffn_job)); }

void ft_ffn_job_free(ft_ffn_job *j) {
    if (!j) return;
    free(j->u_expert); free(j->u_start); free(j->r_token); free(j->counts); free(j->r_weight);
    free(j->r_x); free(j->r_h); free(j->h); free(j->hb); free(j->xb); free(j->tmp);
    free(j);
}

void ft_ffn_set_pool(ft_ffn_job *job, void *pool) { job->pool = pool; }

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
                   const float *w, int R, float *out, int act) {
    if (!ft_isa_supported(isa)) return FT_ERR_ISA;
    if (act < FT_ACT_SILU || act > FT_ACT_GELU_TANH) return FT_ERR_ARG;
    if (isa == FT_ISA_AVX512BF16 && bf16_x_only && !all_bf16_exact(x, (size_t)T * D)) isa = FT_ISA_AVX512;
    j->isa = isa;
    j->dot = ft_dot_select(isa, dtype, &j->xs_bf16);
    if (!j->dot || slot_stride <= 0 || nt < 1) return FT_ERR_ARG;
    int64_t E = bank_nbytes / slot_stride;
    j->bank = bank; j->slot_stride = slot_stride;
    j->off_gate = og; j->off_up = ou; j->off_down = od;
    j->esize = dtype == FT_FP32 ? 4 : 2;
    j->D = D; j->I = I; j->T = T; j->R = R; j->act = act; j->x = x; j->out = out;

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
    if (j->xs_bf16) {
        if (grow(&j->xb, &c[C_XB], (size_t)T * D * 2) || grow(&j->hb, &c[C_HB], hsz * 2)) return FT_ERR_NOMEM;
        for (size_t i = 0; i < (size_t)T * D; i++) j->xb[i] = ft_f32_to_bf16(x[i]);
    } else if (grow(&j->h, &c[C_H], hsz * sizeof(float))) {
        return FT_ERR_NOMEM;
    }
    for (int r = 0; r < R; r++) {
        int p = cnt[exp[r]]++;
        j->r_token[p] = tok[r];
        j->r_weight[p] = w[r];
        j->r_x[p] = j->xs_bf16 ? (const void *)(j->xb + (size_t)tok[r] * D) : (const void *)(x + (size_t)tok[r] * D);
        j->r_h[p] = j->xs_bf16 ? (const void *)(j->hb + (size_t)p * I) : (const void *)(j->h + (size_t)p * I);
    }
    if (grow(&j->tmp, &c[C_TMP], (size_t)nt * 2 * (max_group + 16) * sizeof(float))) return FT_ERR_NOMEM;

    /* About 8 work items per worker and phase, at least 4 rows each. */
    int r1 = ceil_div((int64_t)U * I, 8 * nt);
    j->rows1 = r1 < 4 ? 4 : (r1 > I ? I : r1);
    j->items1_per_u = ceil_div(I, j->rows1);
    j->n_items1 = U * j->items1_per_u;
    int r2 = ceil_div(D, 8 * nt);
    j->rows2 = r2 < 4 ? 4 : (r2 > D ? D : r2);
    j->n_items2 = ceil_div(D, j->rows2);
    atomic_store(&j->next1, 0);
    atomic_store(&j->next2, 0);
    return FT_OK;
}

static inline float act_fn(float g, int act) {
    switch (act) {
    case FT_ACT_GELU: return 0.5f * g * (1.0f + erff(g * 0.70710678118654752f));
    case FT_ACT_GELU_TANH: {
        float u = 0.79788456080286536f * (g + 0.044715f * g * g * g);
        return 0.5f * g * (1.0f + tanhf(u));
    }
    default: return g / (1.0f + expf(-g));
    }
}

static void phase1_item(ft_ffn_job *j, int item, float *g, float *v) {
    int u = item / j->items1_per_u, blk = item % j->items1_per_u;
    int s = j->u_start[u], n = j->u_start[u + 1] - s;
    int i0 = blk * j->rows1, i1 = i0 + j->rows1 < j->I ? i0 + j->rows1 : j->I;
    const uint8_t *slot = j->bank + (int64_t)j->u_expert[u] * j->slot_stride;
    size_t row_bytes = (size_t)j->D * j->esize;
    const void *const *xs = j->r_x + s;
    for (int i = i0; i < i1; i++) {
        j->dot(slot + j->off_gate + i * row_bytes, j->D, xs, n, g);
        j->dot(slot + j->off_up + i * row_bytes, j->D, xs, n, v);
        for (int t = 0; t < n; t++) {
            float hv = act_fn(g[t], j->act) * v[t];
            size_t at = (size_t)(s + t) * j->I + i;
            if (j->xs_bf16) j->hb[at] = ft_f32_to_bf16(hv);
            else j->h[at] = hv;
        }
    }
}

static void phase2_item(ft_ffn_job *j, int item, float *y) {
    int d0 = item * j->rows2, d1 = d0 + j->rows2 < j->D ? d0 + j->rows2 : j->D;
    size_t row_bytes = (size_t)j->I * j->esize;
    for (int u = 0; u < j->U; u++) {
        int s = j->u_start[u], n = j->u_start[u + 1] - s;
        const uint8_t *down = j->bank + (int64_t)j->u_expert[u] * j->slot_stride + j->off_down;
        for (int d = d0; d < d1; d++) {
            j->dot(down + d * row_bytes, j->I, j->r_h + s, n, y);
            for (int t = 0; t < n; t++) j->out[(size_t)j->r_token[s + t] * j->D + d] += j->r_weight[s + t] * y[t];
        }
    }
}

void ft_ffn_run(void *arg, int tid, int nt) {
    (void)nt;
    ft_ffn_job *j = (ft_ffn_job *)arg;
    float *g = j->tmp + (size_t)tid * 2 * (j->max_group + 16);
    float *v = g + j->max_group + 16;
    for (;;) {
        int it = atomic_fetch_add_explicit(&j->next1, 1, memory_order_relaxed);
        if (it >= j->n_items1) break;
        phase1_item(j, it, g, v);
    }
    ft_pool_barrier((ft_pool *)j->pool);
    for (;;) {
        int it = atomic_fetch_add_explicit(&j->next2, 1, memory_order_relaxed);
        if (it >= j->n_items2) break;
        phase2_item(j, it, g);
    }
}

void ft_read_run(void *arg, int tid, int nt) {
    /* Blocks of 256 KiB dealt round-robin: all workers stream through the same region at once,
     * as the expert kernel's workers do (rows of one expert), not through far-apart halves. */
    ft_read_job *j = (ft_read_job *)arg;
    const int64_t blk = 256 << 10;
    uint64_t s = 0;
    for (int64_t a = (int64_t)tid * blk; a < j->nbytes; a += (int64_t)nt * blk) {
        int64_t n = j->nbytes - a < blk ? j->nbytes - a : blk;
        s += ft_read_sum(j->isa, j->buf + a, n);
    }
    j->sums[tid] = s;
}
