/* Persistent pinned worker pool (see pool.h). Linux futexes for parking; elsewhere workers
 * fall back to sched_yield polling (correct, just less frugal).
 *
 * Futex words (each on its own cache line):
 *   gen       bumped by submit; workers wait for it to change   (start signal)
 *   done_gen  set to gen by the last worker to finish            (completion signal)
 *   bar_gen   bumped by the last worker to reach a barrier       (phase signal)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pool.h"

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() __asm__ __volatile__("" ::: "memory")
#endif

#define CACHE_LINE 64

struct ft_pool {
    int num_threads;
    int spin_ns;
    pthread_t *threads;
    int *cpus;      /* requested CPU per worker */
    int *pinned;    /* CPU actually pinned to, -1 when refused or not asked */
    ft_job_fn fn;
    void *arg;
    int stop;
    _Alignas(CACHE_LINE) _Atomic uint32_t gen;
    _Alignas(CACHE_LINE) _Atomic uint32_t done_gen;
    _Alignas(CACHE_LINE) _Atomic int pending;
    _Alignas(CACHE_LINE) _Atomic int sleepers;
    _Alignas(CACHE_LINE) _Atomic int done_sleepers;  /* threads asleep in ft_pool_wait */
    _Alignas(CACHE_LINE) _Atomic uint32_t bar_count;
    _Alignas(CACHE_LINE) _Atomic uint32_t bar_gen;
};

typedef struct {
    ft_pool *pool;
    int tid;
} worker_arg;

int64_t ft_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

void ft_spin_pause_us(int64_t us) {
    const int64_t end = ft_now_ns() + us * 1000;
    for (unsigned i = 1;; i++) {
        cpu_relax();
        if (!(i & 1023) && ft_now_ns() >= end) return;
    }
}

static void futex_wait(_Atomic uint32_t *addr, uint32_t expected) {
#ifdef __linux__
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
#else
    (void)addr; (void)expected;
    sched_yield();
#endif
}

static void futex_wake_all(_Atomic uint32_t *addr) {
#ifdef __linux__
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#else
    (void)addr;
#endif
}

/* Wait until *addr != old: spin for spin_ns (checking the clock and yielding the core every 64
 * pauses, so a thread that shares this core, the driver or a worker, is not starved by the
 * spin), then sleep. */
static uint32_t wait_change(_Atomic uint32_t *addr, uint32_t old, int64_t spin_ns, _Atomic int *sleepers) {
    uint32_t v;
    int64_t deadline = -1;
    for (unsigned i = 0;; i++) {
        v = atomic_load_explicit(addr, memory_order_acquire);
        if (v != old) return v;
        if ((i & 63) == 63) {
            sched_yield();
            int64_t t = ft_now_ns();
            if (deadline < 0) deadline = t + spin_ns;
            else if (t >= deadline) break;
        }
        cpu_relax();
    }
    for (;;) {
        if (sleepers) atomic_fetch_add(sleepers, 1);
        v = atomic_load(addr);
        if (v == old) futex_wait(addr, old);
        if (sleepers) atomic_fetch_sub(sleepers, 1);
        v = atomic_load_explicit(addr, memory_order_acquire);
        if (v != old) return v;
    }
}

static void *worker_main(void *varg);

/* Start worker tid, pinned to cpus[tid] from its first instruction when the set allows it
 * (pthread_attr_setaffinity_np); started unpinned when the kernel refuses that CPU. */
static int start_worker(ft_pool *p, int tid, worker_arg *wa) {
    p->pinned[tid] = -1;
#ifdef __linux__
    int cpu = p->cpus ? p->cpus[tid] : -1;
    if (cpu >= 0 && cpu < CPU_SETSIZE) {
        pthread_attr_t attr;
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
        pthread_attr_init(&attr);
        int ok = pthread_attr_setaffinity_np(&attr, sizeof(set), &set) == 0 &&
                 pthread_create(&p->threads[tid], &attr, worker_main, wa) == 0;
        pthread_attr_destroy(&attr);
        if (ok) {
            p->pinned[tid] = cpu;
            return 0;
        }
    }
#endif
    return pthread_create(&p->threads[tid], NULL, worker_main, wa);
}

static void *worker_main(void *varg) {
    worker_arg wa = *(worker_arg *)varg;
    free(varg);
    ft_pool *p = wa.pool;
    uint32_t seen = 0;
    for (;;) {
        seen = wait_change(&p->gen, seen, p->spin_ns, &p->sleepers);
        if (p->stop) break;
        p->fn(p->arg, wa.tid, p->num_threads);
        if (atomic_fetch_sub_explicit(&p->pending, 1, memory_order_acq_rel) == 1) {
            atomic_store(&p->done_gen, seen);  /* seq_cst: pairs with done_sleepers++ */
            if (atomic_load(&p->done_sleepers) > 0) futex_wake_all(&p->done_gen);
        }
    }
    return NULL;
}

ft_pool *ft_pool_create(int num_threads, const int *cpus, int spin_us) {
    if (num_threads < 1) return NULL;
    ft_pool *p = aligned_alloc(CACHE_LINE, (sizeof(ft_pool) + CACHE_LINE - 1) / CACHE_LINE * CACHE_LINE);
    if (!p) return NULL;
    memset(p, 0, sizeof(*p));
    p->num_threads = num_threads;
    p->spin_ns = spin_us < 0 ? 0 : spin_us * 1000;
    p->threads = calloc(num_threads, sizeof(pthread_t));
    p->pinned = calloc(num_threads, sizeof(int));
    if (cpus) {
        p->cpus = malloc(num_threads * sizeof(int));
        if (p->cpus) memcpy(p->cpus, cpus, num_threads * sizeof(int));
    }
    if (!p->threads || !p->pinned || (cpus && !p->cpus)) goto fail;
    for (int i = 0; i < num_threads; i++) {
        worker_arg *wa = malloc(sizeof(worker_arg));
        if (!wa) goto fail_threads;
        wa->pool = p;
        wa->tid = i;
        if (start_worker(p, i, wa) != 0) {
            free(wa);
            p->num_threads = i;
            goto fail_threads;
        }
    }
    return p;
fail_threads:
    ft_pool_destroy(p);
    return NULL;
fail:
    free(p->threads); free(p->pinned); free(p->cpus); free(p);
    return NULL;
}

void ft_pool_destroy(ft_pool *p) {
    if (!p) return;
    ft_pool_wait(p);
    p->stop = 1;
    atomic_fetch_add(&p->gen, 1);
    futex_wake_all(&p->gen);
    for (int i = 0; i < p->num_threads; i++) pthread_join(p->threads[i], NULL);
    free(p->threads); free(p->pinned); free(p->cpus); free(p);
}

int ft_pool_num_threads(const ft_pool *p) { return p->num_threads; }

int ft_pool_pinned_cpu(const ft_pool *p, int tid) {
    return (tid >= 0 && tid < p->num_threads) ? p->pinned[tid] : -1;
}

int ft_pool_is_busy(const ft_pool *p) {
    return atomic_load(&p->done_gen) != atomic_load(&p->gen);
}

void ft_pool_submit(ft_pool *p, ft_job_fn fn, void *arg) {
    ft_pool_wait(p);  /* one job at a time */
    p->fn = fn;
    p->arg = arg;
    atomic_store(&p->pending, p->num_threads);
    atomic_store(&p->bar_count, 0);
    atomic_fetch_add(&p->gen, 1);  /* seq_cst: pairs with the sleepers++ in wait_change */
    if (atomic_load(&p->sleepers) > 0) futex_wake_all(&p->gen);
}

void ft_pool_wait(ft_pool *p) {
    uint32_t target = atomic_load(&p->gen);
    uint32_t d = atomic_load_explicit(&p->done_gen, memory_order_acquire);
    while (d != target) d = wait_change(&p->done_gen, d, p->spin_ns, &p->done_sleepers);
}

void ft_pool_barrier(ft_pool *p) {
    uint32_t g = atomic_load_explicit(&p->bar_gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&p->bar_count, 1, memory_order_acq_rel) + 1 == (uint32_t)p->num_threads) {
        atomic_store(&p->bar_count, 0);
        atomic_fetch_add(&p->bar_gen, 1);
        futex_wake_all(&p->bar_gen);
        return;
    }
    wait_change(&p->bar_gen, g, p->spin_ns, NULL);
}
