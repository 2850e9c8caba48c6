/* ft_serve_step: see serve.h. */
#include <string.h>
#include <immintrin.h>

#include "pool.h"
#include "serve.h"

enum { MAX_ROUTES = 64 };

/* Spin until *flag is 1 (acquire: the mailbox written before it is visible after). */
static int wait_ready(int32_t *flag, int64_t timeout_us) {
    int64_t start = -1;
    for (unsigned spins = 0;; spins++) {
        if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) == 1) return 0;
        _mm_pause();
        if ((spins & 1023) == 1023) {
            int64_t t = ft_now_ns() / 1000;
            if (start < 0) start = t;
            else if (t - start > timeout_us) return FT_SERVE_TIMEOUT;
        }
    }
}

/* Run the layer's CPU routes; *routes gets their count (0: nothing run, partial untouched). */
static int run_layer(ft_pool *pool, ft_ffn_job *job, int nt, ft_serve_layer *L, int *routes,
                     int64_t t1) {
    int32_t tok[MAX_ROUTES], exp[MAX_ROUTES];
    float w[MAX_ROUTES];
    int R = 0;
    for (int k = 0; k < L->K && k < MAX_ROUTES; k++) {
        int64_t e = L->ids[k];
        if (e < 0) continue;
        tok[R] = 0;
        exp[R] = (int32_t)e;
        w[R] = L->w[k];
        R++;
    }
    *routes = R;
    if (R == 0) return FT_OK;
    memset(L->partial, 0, (size_t)L->hidden * sizeof(float));
    int rc = ft_ffn_prepare(job, L->isa, L->bf16_x_only, nt, L->bank, L->bank_nbytes,
                            L->slot_stride, L->dtype, L->hidden, L->inter, L->off_gate, L->off_up,
                            L->off_down, L->x, 1, tok, exp, w, R, L->partial, L->act,
                            L->stage_max_bytes, &L->tune);
    if (rc != FT_OK) return rc;
    L->prep_ns += ft_now_ns() - t1;
    ft_pool_submit(pool, ft_ffn_run, (void *)job);
    ft_ffn_help(job);
    ft_pool_wait(pool);
    return FT_OK;
}

int ft_serve_step(void *pool_arg, ft_ffn_job *job, int nt, ft_serve_layer *layers, int n,
                  int64_t timeout_us, int *served) {
    ft_pool *pool = (ft_pool *)pool_arg;
    int err = FT_OK;
    *served = 0;
    for (int i = 0; i < n; i++) {
        ft_serve_layer *L = &layers[i];
        int64_t t0 = ft_now_ns();
        if (wait_ready(L->ready, timeout_us) != 0) {
            for (int j = i; j < n; j++) __atomic_store_n(layers[j].done, 1, __ATOMIC_RELEASE);
            return FT_SERVE_TIMEOUT;
        }
        __atomic_store_n(L->ready, 0, __ATOMIC_RELAXED);
        int64_t t1 = ft_now_ns();
        L->wait_ns += t1 - t0;
        L->served++;
        int routes = 0;
        int rc = run_layer(pool, job, nt, L, &routes, t1);
        if (rc != FT_OK) {
            memset(L->partial, 0, (size_t)L->hidden * sizeof(float));
            if (err == FT_OK) err = rc;
        }
        if (routes > 0) {
            __atomic_store_n(L->done, 1, __ATOMIC_RELEASE);
            int64_t ns = ft_now_ns() - t1, b = ns / (FT_SERVE_BUCKET_US * 1000);
            L->job_ns += ns;
            L->jobs++;
            L->hist[b < FT_SERVE_BUCKETS ? b : FT_SERVE_BUCKETS - 1]++;
        }
        *served = i + 1;
    }
    return err;
}
