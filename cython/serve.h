/* The CPU side of a decode step whose control runs on the GPU (freetoken/experts/device_step.py).
 *
 * For each MoE layer of the step, in order, the GPU plans the layer, writes the CPU's share into
 * a host mailbox (pinned memory) and raises the layer's `ready` flag; ft_serve_step waits for the
 * flag, runs the listed routes on the pool (one token: T = 1), writes the partial sum and raises
 * `done`, which the GPU waits for before it adds the partial. Flags are int32 words in pinned
 * memory: ready is set by the GPU and cleared here, done is set here and cleared by the GPU.
 *
 * With a copier (ft_serve_copier, below) the host also moves the layer's planned fills: after
 * `ready` it queues one copy-engine copy per fill (host bank slot -> cache slot) on the fill
 * stream, then a stream write of the layer's `filled` flag, which the GPU waits for before its
 * experts run (and clears); after `done` it queues the layer's admissions (misses the CPU ran,
 * copied in for later steps) on the admission stream and records the layer's event there, which
 * the fill stream waits for before the same layer's `filled` of the next step (a hit of the next
 * step may be an admitted slot). The copy engines take less of the host's memory bandwidth than a
 * kernel reading mapped memory, and the copies need no SMs. CUDA driver calls come in as function
 * pointers (the library is found at run time, not linked).
 *
 * Shape legend: K routes of the token, D hidden.
 */
#ifndef FT_SERVE_H
#define FT_SERVE_H

#include <stdint.h>

#include "ffn.h"

typedef struct {
    /* the layer's bank and kernel, as ft_ffn_prepare takes them */
    int isa, bf16_x_only, dtype, hidden, inter, act;
    const uint8_t *bank;
    int64_t bank_nbytes, slot_stride, off_gate, off_up, off_down, stage_max_bytes;
    ft_tune tune;
    /* the mailbox */
    int32_t *ready, *done;   /* flags, see above */
    const int64_t *ids;      /* [K] expert of each route the CPU runs, -1: not the CPU's */
    const float *w;          /* [K] router weight of each route */
    const float *x;          /* [D] the token's input (fp32) */
    float *partial;          /* [D] the CPU's sum, written before done */
    int K;
    /* copies (a copier is given): lists [4, K] fill src, fill dst, admission src, admission dst
     * (src: expert, -1 none; dst: cache slot), filled the flag above, admit_event the layer's
     * event on the admission stream (NULL: admissions share the fill stream), *admit_pending
     * (a host word beside the flags, shared by every table of the layer) set here while the
     * event covers copies no later fill of the layer has waited for */
    const int64_t *lists;
    int32_t *filled;
    void *admit_event;
    int32_t *admit_pending;
} ft_serve_layer;

/* CUDA driver entry points, as the driver declares them (CUresult as int, CUdeviceptr as
 * uint64_t, CUstream / CUevent as void *) */
typedef int (*ft_cu_copy_fn)(uint64_t dst, const void *src, size_t nbytes, void *stream);
typedef int (*ft_cu_write_fn)(void *stream, uint64_t addr, uint32_t value, unsigned flags);
typedef int (*ft_cu_record_fn)(void *event, void *stream);
typedef int (*ft_cu_wait_event_fn)(void *stream, void *event, unsigned flags);

typedef struct {
    ft_cu_copy_fn copy;             /* cuMemcpyHtoDAsync_v2 */
    ft_cu_write_fn write;           /* cuStreamWriteValue32_v2 */
    ft_cu_record_fn record;         /* cuEventRecord */
    ft_cu_wait_event_fn wait_event; /* cuStreamWaitEvent */
    void *fill_stream, *admit_stream;
    uint64_t storage;               /* device address of cache slot 0 */
    int64_t storage_stride;         /* bytes from one cache slot to the next */
    int last_error;                 /* the driver's code of the first failed call, 0: none */
} ft_serve_copier;

enum { FT_SERVE_TIMEOUT = -100, FT_SERVE_CUDA = -101 };

/* Serve n layers in order. pool: the ft_pool the job runs on; job: its scratch. timeout_us:
 * give up when a ready flag stays down that long (every remaining done and filled flag is then
 * raised, so the GPU does not wait forever). copier: NULL when the GPU gathers its own fills.
 * Returns FT_OK, the first kernel error (the layer's partial is then zero and its done still
 * raised), FT_SERVE_CUDA (a driver call failed: copier->last_error; the flags are still raised)
 * or FT_SERVE_TIMEOUT. *served counts layers done. */
int ft_serve_step(void *pool, ft_ffn_job *job, int num_threads, ft_serve_layer *layers, int n,
                  int64_t timeout_us, int *served, ft_serve_copier *copier);

#endif
