/* Persistent worker pool: one pthread per core, pinned, parked between jobs.
 *
 * A job is a function run once by every worker (tid 0..n-1); inside it workers split the work
 * themselves (atomic work counters) and may meet at ft_pool_barrier(). One job at a time:
 * ft_pool_submit() returns at once, ft_pool_wait() blocks until every worker finished it.
 * Workers spin for spin_us after a job (a decode step's next layer usually arrives within that),
 * then sleep on a futex, so an idle pool burns no core.
 */
#ifndef FT_POOL_H
#define FT_POOL_H

#include <stdint.h>

typedef void (*ft_job_fn)(void *arg, int tid, int num_threads);
typedef struct ft_pool ft_pool;

/* cpus: num_threads CPU ids to pin worker i to (-1: leave unpinned); NULL pins nothing.
 * Returns NULL when threads cannot be created. */
ft_pool *ft_pool_create(int num_threads, const int *cpus, int spin_us);
void ft_pool_destroy(ft_pool *p);                 /* waits for a running job, joins the workers */
int ft_pool_num_threads(const ft_pool *p);
int ft_pool_pinned_cpu(const ft_pool *p, int tid); /* the CPU worker tid runs on, -1 if unpinned */
void ft_pool_submit(ft_pool *p, ft_job_fn fn, void *arg);
void ft_pool_wait(ft_pool *p);
int ft_pool_is_busy(const ft_pool *p);
void ft_pool_barrier(ft_pool *p);                 /* workers only, inside a job */
int64_t ft_now_ns(void);                          /* CLOCK_MONOTONIC, ns (time.monotonic_ns) */
/* Spin us microseconds on the pause instruction, as the decode server spins while it waits for
 * a layer's ready (diagnostics: tools/bench_cpu_jobs.py --gap-wait spin). */
void ft_spin_pause_us(int64_t us);

#endif
