/* ft_serve_step: see serve.h. */
#include <string.h>
#include <immintrin.h>

#include "pool.h"
#include "serve.h"

enum { MAX_ROUTES = 64 };  /* routes of one step, T x K (device_plan.MAX_ROUTES) */

/* One spin of a wait: the pause instruction, and every 1024 spins a look at the clock (start:
 * the first look, -1 before it). Nonzero once timeout_us has passed. Spinning on plain loads
 * instead of pausing (in case the virtual machine stopped a pausing vCPU) was no faster
 * (docs/MEASUREMENTS.md#host-serving-thread). */
static int spun_out(unsigned spins, int64_t *start, int64_t timeout_us) {
    _mm_pause();
    if ((spins & 1023) != 1023) return 0;
    int64_t t = ft_now_ns() / 1000;
    if (*start < 0) *start = t;
    return t - *start > timeout_us;
}

/* Spin until *flag is 1 (acquire: the mailbox written before it is visible after); 0, or
 * FT_SERVE_TIMEOUT. */
static int wait_ready(int32_t *flag, int64_t timeout_us) {
    int64_t start = -1;
    for (unsigned spins = 0; __atomic_load_n(flag, __ATOMIC_ACQUIRE) != 1; spins++)
        if (spun_out(spins, &start, timeout_us)) return FT_SERVE_TIMEOUT;
    return 0;
}

/* Spin until the mailbox's number *seq is above seen (acquire, as above), which *now gets; 0,
 * or FT_SERVE_STALE. */
static int wait_seq(const int64_t *seq, int64_t seen, int64_t *now, int64_t timeout_us) {
    int64_t start = -1;
    for (unsigned spins = 0; (*now = __atomic_load_n(seq, __ATOMIC_ACQUIRE)) <= seen; spins++)
        if (spun_out(spins, &start, timeout_us)) return FT_SERVE_STALE;
    return 0;
}

/* A step given up at layer i (rc: FT_SERVE_TIMEOUT or FT_SERVE_STALE): every done from layer i
 * on raised, so the GPU ends the step; *failed gets the last served layer's route count. */
static int give_up(ft_serve_layer *layers, int i, int n, int *failed, int last_routes, int rc) {
    for (int j = i; j < n; j++) __atomic_store_n(layers[j].done, 1, __ATOMIC_RELEASE);
    *failed = last_routes;
    return rc;
}

enum { MAX_TRACED_THREADS = 1025 };

/* Add the last job (marked done) to L's tr_* sums, from its work items' trace (ffn.h); after
 * its done is raised, off the GPU's path. nt: the pool's threads (the helper is tid nt). */
static void add_trace(ft_serve_layer *L, const ft_ffn_job *job, int nt) {
    int64_t first[MAX_TRACED_THREADS], last[MAX_TRACED_THREADS];
    int64_t info[8];
    int n = ft_ffn_trace_info(job, info);
    const int nthreads = nt + 1 < MAX_TRACED_THREADS ? nt + 1 : MAX_TRACED_THREADS;
    const ft_trace_rec *r = ft_ffn_trace_records(job);
    int64_t sub = info[0], done = info[1], n_g = info[2];
    if (n <= 0 || !r || done <= sub) return;
    for (int t = 0; t < nthreads; t++) first[t] = last[t] = -1;
    int64_t dwait = 0, g_busy = 0, d_busy = 0, g_n = 0, d_n = 0;
    for (int i = 0; i < n; i++) {
        int t = r[i].tid;
        if (t < 0 || t >= nthreads) continue;
        if (first[t] < 0 || r[i].claim_ns < first[t]) first[t] = r[i].claim_ns;
        if (r[i].end_ns > last[t]) last[t] = r[i].end_ns;
        if (r[i].item < n_g) {
            g_busy += r[i].end_ns - r[i].ready_ns;
            g_n++;
        } else {
            dwait += r[i].ready_ns - r[i].claim_ns;
            d_busy += r[i].end_ns - r[i].ready_ns;
            d_n++;
        }
    }
    int64_t threads = 0, wake = 0, wake_max = 0, last_min = -1, last_max = -1;
    for (int t = 0; t < nthreads; t++) {
        if (first[t] < 0) continue;
        threads++;
        wake += first[t] - sub;
        if (first[t] - sub > wake_max) wake_max = first[t] - sub;
        if (last_min < 0 || last[t] < last_min) last_min = last[t];
        if (last[t] > last_max) last_max = last[t];
    }
    if (!threads) return;
    L->c.tr_jobs++;
    L->c.tr_job_ns += done - sub;
    L->c.tr_wake_ns += wake / threads;
    L->c.tr_wake_max_ns += wake_max;
    L->c.tr_dwait_ns += dwait / threads;
    L->c.tr_spread_ns += last_max - last_min;
    L->c.tr_signal_ns += done - last_max;
    L->c.tr_g_busy_ns += g_busy;
    L->c.tr_d_busy_ns += d_busy;
    L->c.tr_g_bytes += g_n * info[6];
    L->c.tr_d_bytes += d_n * info[7];
}

/* The step's tokens, as the layer's plan wrote them (after its seq: read after it). */
static int64_t step_tokens(const ft_serve_layer *L) {
    return L->tokens ? __atomic_load_n(L->tokens, __ATOMIC_RELAXED) : 1;
}

/* Run the layer's CPU routes; *routes gets their count (0: nothing run, partial untouched). */
static int run_layer(ft_pool *pool, ft_ffn_job *job, int nt, ft_serve_layer *L, int *routes,
                     int64_t t1, int flags) {
    int32_t tok[MAX_ROUTES], exp[MAX_ROUTES];
    float w[MAX_ROUTES];
    int R = 0;
    int64_t T = step_tokens(L);
    int n = (int)(T * L->K);
    if (T < 1 || n > L->max_routes || n > MAX_ROUTES) {
        *routes = 1;  /* done still raised (the GPU must not wait for ever), the step failed */
        return FT_ERR_TOKEN;
    }
    for (int k = 0; k < n; k++) {
        int64_t e = L->ids[k];
        if (e < 0) continue;
        tok[R] = k / L->K;
        exp[R] = (int32_t)e;
        w[R] = L->w[k];
        R++;
    }
    *routes = R;
    if (R == 0) return FT_OK;
    memset(L->partial, 0, (size_t)T * L->hidden * sizeof(float));
    if (flags & FT_SERVE_SKIP_JOBS) return FT_OK;
    int rc = ft_ffn_prepare(job, L->isa, L->bf16_x_only, nt, L->bank, L->bank_nbytes,
                            L->slot_stride, L->dtype, L->hidden, L->inter, L->off_gate, L->off_up,
                            L->off_down, L->x, (int)T, tok, exp, w, R, L->partial, L->act, &L->extra,
                            L->stage_max_bytes, &L->tune);
    if (rc != FT_OK) return rc;
    L->c.prep_ns += ft_now_ns() - t1;
    ft_pool_submit(pool, ft_ffn_run, (void *)job);
    ft_ffn_help(job);
    /* every worker back, not only every item ended: a late worker would only delay the next
     * job's prepare instead (docs/MEASUREMENTS.md#host-serving-thread) */
    ft_pool_wait(pool);
    if (flags & FT_SERVE_TRACED) ft_ffn_mark_done(job);
    return FT_OK;
}

int ft_serve_step(void *pool_arg, ft_ffn_job *job, int nt, ft_serve_layer *layers, int n,
                  int64_t timeout_us, int *served, int *failed, int flags) {
    ft_pool *pool = (ft_pool *)pool_arg;
    const int traced = (flags & FT_SERVE_TRACED) && !(flags & FT_SERVE_SKIP_JOBS);
    int err = FT_OK, last_routes = -1;
    *served = 0;
    *failed = -1;
    for (int i = 0; i < n; i++) {
        ft_serve_layer *L = &layers[i];
        int64_t t0 = ft_now_ns();
        if (wait_ready(L->ready, timeout_us) != 0)
            return give_up(layers, i, n, failed, last_routes, FT_SERVE_TIMEOUT);
        __atomic_store_n(L->ready, 0, __ATOMIC_RELAXED);
        if (L->seq) {
            /* a number not yet moved on: ready reached the host before the plan's stores did;
             * counted, and the mailbox read only once they are there */
            int64_t seq = __atomic_load_n(L->seq, __ATOMIC_ACQUIRE);
            if (seq <= L->seq_seen) {
                L->c.stale++;
                if (wait_seq(L->seq, L->seq_seen, &seq, timeout_us) != 0)
                    return give_up(layers, i, n, failed, last_routes, FT_SERVE_STALE);
            }
            L->seq_seen = seq;
        }
        int64_t t1 = ft_now_ns();
        L->c.wait_ns += t1 - t0;
        L->c.served++;
        int routes = 0;
        int rc = run_layer(pool, job, nt, L, &routes, t1, flags);
        last_routes = routes;
        if (rc != FT_OK) {
            int64_t T = step_tokens(L);
            T = T < 1 ? 1 : (T * L->K > L->max_routes ? L->max_routes / L->K : T);
            memset(L->partial, 0, (size_t)T * L->hidden * sizeof(float));
            if (err == FT_OK) {
                err = rc;
                *failed = i;
            }
        }
        if (routes > 0) {
            __atomic_store_n(L->done, 1, __ATOMIC_RELEASE);
            int64_t ns = ft_now_ns() - t1, b = ns / (FT_SERVE_BUCKET_US * 1000);
            L->c.job_ns += ns;
            L->c.jobs++;
            L->c.hist[b < FT_SERVE_BUCKETS ? b : FT_SERVE_BUCKETS - 1]++;
            if (traced && rc == FT_OK) add_trace(L, job, nt);
        }
        *served = i + 1;
    }
    return err;
}
