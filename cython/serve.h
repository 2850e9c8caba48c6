/* The CPU side of a decode step whose control runs on the GPU (freetoken/experts/captured/control.py).
 *
 * For each MoE layer of the step, in order, the GPU plans the layer, writes the CPU's share into
 * a host mailbox (pinned memory) and raises the layer's `ready` flag; ft_serve_step waits for the
 * flag, runs the listed routes of the step's T tokens on the pool (route r = t*K + k: token
 * r / K; the kernel groups the routes by expert, so a CPU expert several tokens route to runs
 * once over them), writes the T partial sums and raises `done`, which the GPU waits for before
 * it adds them. A layer with no CPU routes gets no
 * `done` and its partial is left alone: the GPU knows the count from its own plan and neither
 * waits nor reads. Flags are int32 words in pinned memory: ready is set by the GPU and cleared
 * here, done is set here and cleared by the GPU. The plan also numbers its mailbox (seq, its
 * last store before ready): a number that has not moved on since the layer was last served
 * means ready reached the host before the plan's stores did (counted: `stale`); the server
 * then waits for the number before it reads the mailbox.
 *
 * Shape legend: T tokens of the step (at most max_routes / K), K routes per token, D hidden.
 */
#ifndef FT_SERVE_H
#define FT_SERVE_H

#include <stdint.h>

#include "ffn.h"

enum { FT_SERVE_BUCKETS = 64, FT_SERVE_BUCKET_US = 10 };

/* What ft_serve_step adds up per layer (diagnostics; zeroed by the caller, as one struct) */
typedef struct {
    /* ns spent waiting for ready, ns from ready seen to done raised in layers with CPU routes,
     * their count, and the times the layer was served */
    int64_t wait_ns, job_ns, jobs, served;
    /* mailboxes read whose seq had not moved on (above) */
    int64_t stale;
    /* ns from ready seen to the job's submit (prepare), and the jobs' ready-to-done times in
     * FT_SERVE_BUCKET_US buckets (the last: longer) */
    int64_t prep_ns;
    int64_t hist[FT_SERVE_BUCKETS];
    /* with a trace buffer (ft_serve_step's `traced`), each job's work items broken down and
     * summed (ns): jobs traced; submit to done; the workers' first claims after the submit
     * (their mean, and the latest); the D items' waits for their G items (per worker); the
     * spread of the workers' last ends; the last end to done; the G and D items' busy time and
     * bytes */
    int64_t tr_jobs, tr_job_ns, tr_wake_ns, tr_wake_max_ns, tr_dwait_ns, tr_spread_ns,
        tr_signal_ns, tr_g_busy_ns, tr_d_busy_ns, tr_g_bytes, tr_d_bytes;
} ft_serve_counts;

typedef struct {
    /* the layer's bank and kernel, as ft_ffn_prepare takes them */
    int isa, bf16_x_only, dtype, hidden, inter, act;
    const uint8_t *bank;
    int64_t bank_nbytes, slot_stride, off_gate, off_up, off_down, stage_max_bytes;
    ft_tune tune;
    ft_ffn_extra extra;
    /* the mailbox */
    int32_t *ready, *done;   /* flags, see above */
    const int64_t *ids;      /* [T*K] expert of each route the CPU runs, -1: not the CPU's */
    const float *w;          /* [T*K] router weight of each route */
    const float *x;          /* [T, D] the tokens' inputs (fp32) */
    float *partial;          /* [T, D] the CPU's sums, written before done */
    const int64_t *seq;      /* the plan's number of the mailbox (NULL: not checked) */
    const int64_t *tokens;   /* T, written by the plan before seq (NULL: 1) */
    int64_t seq_seen;        /* the highest seen here (0 at first) */
    int K;                   /* routes per token */
    int max_routes;          /* the mailbox's routes (T*K above it are not read) */
    ft_serve_counts c;  /* (above) */
} ft_serve_layer;

/* a ready flag, or a mailbox's number after its ready, did not come within the timeout */
enum { FT_SERVE_TIMEOUT = -100, FT_SERVE_STALE = -101 };

/* ft_serve_step's flags. TRACED: the job has a trace buffer (ft_ffn_set_trace): add each job's
 * breakdown to its layer's tr_* fields. SKIP_JOBS (benchmarks only: the results are wrong): a
 * layer with CPU routes gets a zero partial and its done at once, no job run; the step's time
 * then shows what the CPU's compute costs it. */
enum { FT_SERVE_TRACED = 1, FT_SERVE_SKIP_JOBS = 2 };

/* Serve n layers in order. pool: the ft_pool the job runs on; job: its scratch; flags: above.
 * timeout_us:
 * give up when a ready flag stays down that long (every remaining done flag is then raised, so
 * the GPU does not wait forever; the step's flags are then stale: drop the step). Returns
 * FT_OK, the first kernel error (the layer's partial is then zero and its done still raised;
 * the later layers are still served), FT_SERVE_TIMEOUT, or FT_SERVE_STALE (layer *served's
 * ready came and its mailbox's number did not; the same release). *served counts layers done;
 * *failed is the layer of the first kernel error (-1: none); on FT_SERVE_TIMEOUT and
 * FT_SERVE_STALE instead the CPU route count the last served layer's mailbox showed (-1: none
 * served), for diagnosis. */
int ft_serve_step(void *pool, ft_ffn_job *job, int num_threads, ft_serve_layer *layers, int n,
                  int64_t timeout_us, int *served, int *failed, int flags);

#endif
