/* ft_serve_step: see serve.h. */
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <immintrin.h>

#include "pool.h"
#include "serve.h"

enum { MAX_ROUTES = 64 };

static int64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* Spin until *flag is 1 (acquire: the mailbox written before it is visible after). */
static int wait_ready(int32_t *flag, int64_t timeout_us) {
    int64_t start = -1;
    for (unsigned spins = 0;; spins++) {
        if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) == 1) return 0;
        _mm_pause();
        if ((spins & 1023) == 1023) {
            int64_t t = now_us();
            if (start < 0) start = t;
            else if (t - start > timeout_us) return FT_SERVE_TIMEOUT;
        }
    }
}

static int run_layer(ft_pool *pool, ft_ffn_job *job, int nt, ft_serve_layer *L) {
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
    memset(L->partial, 0, (size_t)L->hidden * sizeof(float));
    if (R == 0) return FT_OK;
    int rc = ft_ffn_prepare(job, L->isa, L->bf16_x_only, nt, L->bank, L->bank_nbytes,
                            L->slot_stride, L->dtype, L->hidden, L->inter, L->off_gate, L->off_up,
                            L->off_down, L->x, 1, tok, exp, w, R, L->partial, L->act,
                            L->stage_max_bytes, &L->tune);
    if (rc != FT_OK) return rc;
    ft_pool_submit(pool, ft_ffn_run, (void *)job);
    ft_ffn_help(job);
    ft_pool_wait(pool);
    return FT_OK;
}

static int cu_failed(ft_serve_copier *cp, int rc) {
    if (rc != 0 && cp->last_error == 0) cp->last_error = rc;
    return rc != 0;
}

/* Queue copies of the experts in src[0..K) (-1: none) from the layer's bank into the cache
 * slots dst[..] on `stream`; returns how many were queued, -1 when a driver call failed. */
static int queue_copies(ft_serve_copier *cp, const ft_serve_layer *L, const int64_t *src,
                        const int64_t *dst, void *stream) {
    int queued = 0;
    for (int k = 0; k < L->K; k++) {
        if (src[k] < 0) continue;
        uint64_t to = cp->storage + (uint64_t)dst[k] * (uint64_t)cp->storage_stride;
        const uint8_t *from = L->bank + src[k] * L->slot_stride;
        if (cu_failed(cp, cp->copy(to, from, (size_t)L->slot_stride, stream))) return -1;
        queued++;
    }
    return queued;
}

/* The layer's fills, then its `filled` flag: written by the fill stream behind the copies (and
 * behind the layer's admissions of the previous step), or at once when there is nothing to wait
 * for. A failed call raises the flag at once (the error is returned; the slots are then wrong
 * and the caller must not go on with this cache). */
static int fill_layer(ft_serve_copier *cp, ft_serve_layer *L) {
    int queued = queue_copies(cp, L, L->lists, L->lists + L->K, cp->fill_stream);
    int ok = queued >= 0;
    if (ok && *L->admit_pending) {
        ok = !cu_failed(cp, cp->wait_event(cp->fill_stream, L->admit_event, 0));
        *L->admit_pending = 0;
        queued += ok;
    }
    if (ok && queued > 0)
        ok = !cu_failed(cp, cp->write(cp->fill_stream, (uint64_t)(uintptr_t)L->filled, 1, 0));
    else
        __atomic_store_n(L->filled, 1, __ATOMIC_RELEASE);
    return ok ? FT_OK : FT_SERVE_CUDA;
}

static int admit_layer(ft_serve_copier *cp, ft_serve_layer *L) {
    int queued = queue_copies(cp, L, L->lists + 2 * L->K, L->lists + 3 * L->K, cp->admit_stream);
    if (queued < 0) return FT_SERVE_CUDA;
    if (queued > 0 && L->admit_event != NULL) {
        if (cu_failed(cp, cp->record(L->admit_event, cp->admit_stream))) return FT_SERVE_CUDA;
        *L->admit_pending = 1;
    }
    return FT_OK;
}

static void raise_rest(ft_serve_layer *layers, int from, int n, int with_filled) {
    for (int j = from; j < n; j++) {
        if (with_filled) __atomic_store_n(layers[j].filled, 1, __ATOMIC_RELEASE);
        __atomic_store_n(layers[j].done, 1, __ATOMIC_RELEASE);
    }
}

int ft_serve_step(void *pool_arg, ft_ffn_job *job, int nt, ft_serve_layer *layers, int n,
                  int64_t timeout_us, int *served, ft_serve_copier *cp) {
    ft_pool *pool = (ft_pool *)pool_arg;
    int err = FT_OK;
    *served = 0;
    for (int i = 0; i < n; i++) {
        ft_serve_layer *L = &layers[i];
        if (wait_ready(L->ready, timeout_us) != 0) {
            raise_rest(layers, i, n, cp != NULL);
            return FT_SERVE_TIMEOUT;
        }
        __atomic_store_n(L->ready, 0, __ATOMIC_RELAXED);
        if (cp != NULL) {
            int rc = fill_layer(cp, L);
            if (rc != FT_OK && err == FT_OK) err = rc;
        }
        int rc = run_layer(pool, job, nt, L);
        if (rc != FT_OK) {
            memset(L->partial, 0, (size_t)L->hidden * sizeof(float));
            if (err == FT_OK) err = rc;
        }
        __atomic_store_n(L->done, 1, __ATOMIC_RELEASE);
        if (cp != NULL && err == FT_OK) err = admit_layer(cp, L);
        *served = i + 1;
    }
    return err;
}
