# cython: language_level=3, boundscheck=False, wraparound=False
"""Native CPU expert kernels and their worker pool (freetoken._expert_ffn).

Private: only freetoken/kernels.py imports this module; it checks dtypes, shapes and
contiguity before calling in (submit_ffn takes the arrays' data pointers unchecked: a per-call
cost of a few microseconds less than typed memoryviews). Everything here releases the GIL around native work.
"""
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memset
cimport numpy as cnp
import numpy as np

cnp.import_array()

TRACE_DTYPE = np.dtype([("claim_ns", np.int64), ("ready_ns", np.int64), ("end_ns", np.int64),
                        ("tid", np.int32), ("item", np.int32)])


cdef extern from "pool.h" nogil:
    ctypedef void (*ft_job_fn)(void *arg, int tid, int num_threads)
    ctypedef struct ft_pool:
        pass
    ft_pool *ft_pool_create(int num_threads, const int *cpus, int spin_us)
    void ft_pool_destroy(ft_pool *p)
    int ft_pool_num_threads(const ft_pool *p)
    int ft_pool_pinned_cpu(const ft_pool *p, int tid)
    void ft_pool_submit(ft_pool *p, ft_job_fn fn, void *arg)
    void ft_pool_wait(ft_pool *p)
    int ft_pool_is_busy(const ft_pool *p)
    void ft_spin_pause_us(int64_t us)


cdef extern from "ffn.h" nogil:
    int FT_BF16, FT_FP16, FT_FP32, FT_Q8_0, FT_Q4_0, FT_MXFP4, FT_NVFP4, FT_FP8_E4M3
    int FT_ACT_SILU, FT_ACT_GELU, FT_ACT_GELU_TANH, FT_ACT_CLAMPED_SWIGLU
    int FT_ISA_GENERIC, FT_ISA_AVX2, FT_ISA_AVX512, FT_ISA_AVX512BF16
    int FT_OK, FT_ERR_TOKEN, FT_ERR_EXPERT, FT_ERR_ISA, FT_ERR_NOMEM, FT_ERR_ARG
    int ft_isa_supported(int isa)
    int ft_isa_best()
    ctypedef struct ft_ffn_job:
        pass
    ctypedef struct ft_tune:
        int item_kb
        int rows
        int down_rows
        int prefetch
        int help
        int spread
        int qdot
    ctypedef struct ft_ffn_extra:
        float alpha, limit
        int64_t off_gate_bias, off_up_bias, off_down_bias
        int bias_dtype
    void ft_tune_defaults(int isa, int dtype, int num_threads, ft_tune *out)
    ft_ffn_job *ft_ffn_job_new()
    void ft_ffn_job_free(ft_ffn_job *job)
    void ft_ffn_set_pool(ft_ffn_job *job, void *pool)
    int ft_ffn_prepare(ft_ffn_job *job, int isa, int bf16_x_only, int num_threads,
                       const uint8_t *bank, int64_t bank_nbytes, int64_t slot_stride, int dtype,
                       int D, int I, int64_t off_gate, int64_t off_up, int64_t off_down,
                       const float *x, int T, const int32_t *token_ids, const int32_t *expert_ids,
                       const float *weights, int R, float *out, int act, const ft_ffn_extra *extra,
                       int64_t stage_max_bytes, const ft_tune *tune)
    void ft_ffn_run(void *job, int tid, int num_threads)
    void ft_ffn_help(ft_ffn_job *job)
    int ft_ffn_isa_used(const ft_ffn_job *job)
    ctypedef struct ft_trace_rec:
        int64_t claim_ns, ready_ns, end_ns
        int32_t tid, item
    void ft_ffn_set_trace(ft_ffn_job *job, ft_trace_rec *buf, int cap)
    void ft_ffn_mark_done(ft_ffn_job *job)
    int ft_ffn_trace_info(const ft_ffn_job *job, int64_t *out)
    ctypedef struct ft_read_job:
        int isa
        const uint8_t *buf
        int64_t nbytes
        int64_t next
        uint64_t sums[1025]
    void ft_read_run(void *job, int tid, int num_threads)


cdef extern from "qdot.h" nogil:
    int ft_qdot8_has_vnni()


cdef extern from "serve.h" nogil:
    ctypedef struct ft_serve_counts:
        int64_t wait_ns, job_ns, jobs, served, stale
        int64_t prep_ns
        int64_t hist[64]  # FT_SERVE_BUCKETS (serve.h; a cdef extern array needs the number)
        int64_t tr_jobs, tr_job_ns, tr_wake_ns, tr_wake_max_ns, tr_dwait_ns, tr_spread_ns
        int64_t tr_signal_ns, tr_g_busy_ns, tr_d_busy_ns, tr_g_bytes, tr_d_bytes
    ctypedef struct ft_serve_layer:
        int isa, bf16_x_only, dtype, hidden, inter, act
        const uint8_t *bank
        int64_t bank_nbytes, slot_stride, off_gate, off_up, off_down, stage_max_bytes
        ft_tune tune
        ft_ffn_extra extra
        int32_t *ready
        int32_t *done
        const int64_t *ids
        const float *w
        const float *x
        float *partial
        const int64_t *seq
        const int64_t *tokens
        int64_t seq_seen
        int K
        int max_routes
        ft_serve_counts c
    enum: FT_SERVE_BUCKETS
    enum: FT_SERVE_BUCKET_US
    int FT_SERVE_TIMEOUT
    int FT_SERVE_STALE
    enum: FT_SERVE_TRACED
    enum: FT_SERVE_SKIP_JOBS
    int ft_serve_step(void *pool, ft_ffn_job *job, int num_threads, ft_serve_layer *layers, int n,
                      int64_t timeout_us, int *served, int *failed, int flags)


ISA_CODES = {"generic": FT_ISA_GENERIC, "avx2": FT_ISA_AVX2, "avx512": FT_ISA_AVX512,
             "avx512bf16": FT_ISA_AVX512BF16}
DTYPE_CODES = {"bf16": FT_BF16, "fp16": FT_FP16, "fp32": FT_FP32, "q8_0": FT_Q8_0, "q4_0": FT_Q4_0,
               "mxfp4": FT_MXFP4, "nvfp4": FT_NVFP4, "fp8_e4m3": FT_FP8_E4M3}
ACT_CODES = {"silu": FT_ACT_SILU, "gelu": FT_ACT_GELU, "gelu_tanh": FT_ACT_GELU_TANH,
             "clamped_swiglu": FT_ACT_CLAMPED_SWIGLU}
SERVE_TIMEOUT = FT_SERVE_TIMEOUT
SERVE_STALE = FT_SERVE_STALE
ERRORS = {FT_ERR_TOKEN: "a token id is outside [0, T)",
          FT_ERR_EXPERT: "an expert id is outside the bank",
          FT_ERR_ISA: "this CPU does not support the requested ISA path",
          FT_ERR_NOMEM: "out of memory for the kernel's scratch buffers",
          FT_ERR_ARG: ("unknown dtype, activation or bias dtype code, or a quantized shape not "
                        "in 32-blocks")}


def isa_supported(str name):
    return bool(ft_isa_supported(ISA_CODES[name]))


def qdot8_has_vnni():
    """Whether the integer quantized kernels take their avx512-vnni form on this CPU (qdot.h)."""
    return bool(ft_qdot8_has_vnni())


def isa_best():
    cdef int code = ft_isa_best()
    return next(k for k, v in ISA_CODES.items() if v == code)


def tune_defaults(str isa, str dtype, int num_threads):
    """(item_kb, rows, down_rows, prefetch) the path takes for zero (auto) fields on a pool of
    num_threads; prefetch in bytes with the hint in its low 2 bits (1: into L2)."""
    cdef ft_tune t
    ft_tune_defaults(ISA_CODES[isa], DTYPE_CODES[dtype], num_threads, &t)
    return t.item_kb, t.rows, t.down_rows, t.prefetch


cdef class ServeTable:
    """The layers of a GPU-controlled decode step (serve.h), in the order they run: each entry
    the layer's bank and kernel arguments and its mailbox's host addresses. The caller keeps
    every array and buffer alive while the table is in use (kernels.CpuExpertPool.serve_table)."""
    cdef ft_serve_layer *layers
    cdef readonly int n

    def __cinit__(self, list entries):
        cdef int i
        cdef ft_serve_layer *L
        self.n = len(entries)
        self.layers = <ft_serve_layer *>calloc(max(1, self.n), sizeof(ft_serve_layer))
        if self.layers == NULL:
            raise MemoryError("no memory for the serve table")
        for i in range(self.n):
            (isa, bf16_x_only, dt, D, I, act, extra, bank, slot_stride, off_gate, off_up, off_down,
             stage_max, tune, ready, done, ids, w, x, partial, seq, tokens, K,
             max_routes) = entries[i]
            L = &self.layers[i]
            L.isa, L.bf16_x_only, L.dtype, L.hidden, L.inter, L.act = isa, bf16_x_only, dt, D, I, act
            L.bank = <const uint8_t *>cnp.PyArray_DATA(bank)
            L.bank_nbytes = cnp.PyArray_DIM(bank, 0)
            L.slot_stride, L.off_gate, L.off_up, L.off_down = slot_stride, off_gate, off_up, off_down
            L.stage_max_bytes = stage_max
            L.extra.alpha, L.extra.limit, L.extra.off_gate_bias, L.extra.off_up_bias, \
                L.extra.off_down_bias, L.extra.bias_dtype = extra
            L.tune.item_kb, L.tune.rows, L.tune.down_rows, L.tune.prefetch, L.tune.help, \
                L.tune.spread, L.tune.qdot = tune
            L.ready = <int32_t *><size_t>ready
            L.done = <int32_t *><size_t>done
            L.ids = <const int64_t *><size_t>ids
            L.w = <const float *><size_t>w
            L.x = <const float *><size_t>x
            L.partial = <float *><size_t>partial
            L.seq = <const int64_t *><size_t>seq  # 0: not checked
            L.tokens = <const int64_t *><size_t>tokens  # 0: one token
            L.K, L.max_routes = K, max_routes

    def stats(self, bint reset=False):
        """[(ns waiting for ready, ns from ready to done in layers with CPU routes, their
        count, times served)] per layer, summed over the steps served since the last reset."""
        cdef int i
        out = [(self.layers[i].c.wait_ns, self.layers[i].c.job_ns, self.layers[i].c.jobs,
                self.layers[i].c.served) for i in range(self.n)]
        if reset:
            for i in range(self.n):
                memset(&self.layers[i].c, 0, sizeof(ft_serve_counts))
        return out

    def stale_reads(self):
        """Ready flags seen before their plan's mailbox stores (serve.h seq; the server then
        waited for them), summed over the layers since the last stats(reset=True)."""
        cdef int i
        return sum(self.layers[i].c.stale for i in range(self.n))

    def trace_times(self):
        """The traced jobs' breakdowns (serve.h tr_*) summed over the layers since
        stats(reset=True): a dict of ns and bytes; jobs 0 when none was traced."""
        cdef int i
        cdef ft_serve_counts *L
        keys = ("jobs", "job_ns", "wake_ns", "wake_max_ns", "dwait_ns", "spread_ns", "signal_ns",
                "g_busy_ns", "d_busy_ns", "g_bytes", "d_bytes")
        sums = [0] * len(keys)
        for i in range(self.n):
            L = &self.layers[i].c
            for k, v in enumerate((L.tr_jobs, L.tr_job_ns, L.tr_wake_ns, L.tr_wake_max_ns,
                                   L.tr_dwait_ns, L.tr_spread_ns, L.tr_signal_ns, L.tr_g_busy_ns,
                                   L.tr_d_busy_ns, L.tr_g_bytes, L.tr_d_bytes)):
                sums[k] += v
        return dict(zip(keys, sums))

    def job_times(self):
        """(ns from ready seen to the jobs' submit, summed; the jobs' ready-to-done counts in
        buckets of `bucket_us` µs, the last bucket the longer ones, summed over the layers;
        bucket_us), over the steps since stats(reset=True)."""
        cdef int i, b
        hist = [0] * FT_SERVE_BUCKETS
        prep = 0
        for i in range(self.n):
            prep += self.layers[i].c.prep_ns
            for b in range(FT_SERVE_BUCKETS):
                hist[b] += self.layers[i].c.hist[b]
        return prep, hist, FT_SERVE_BUCKET_US

    def __dealloc__(self):
        free(self.layers)


cdef class NativePool:
    """A pinned pthread pool plus one reusable expert-job scratch. One job at a time."""
    cdef ft_pool *pool
    cdef ft_ffn_job *job
    cdef ft_read_job *read_job
    cdef readonly int num_threads
    cdef bint ffn_pending
    cdef object trace_buf  # numpy records the job's trace writes into (set_trace), or None
    cdef object serve_trace_buf  # the same for traced serves (serve's trace_cap), or None

    def __cinit__(self, int num_threads, cpus, int spin_us):
        cdef int[1024] cpu_arr
        cdef int i
        if num_threads < 1 or num_threads > 1024:
            raise ValueError(f"num_threads must be in [1, 1024], got {num_threads}")
        for i in range(num_threads):
            cpu_arr[i] = cpus[i] if cpus is not None else -1
        self.job = ft_ffn_job_new()
        self.read_job = <ft_read_job *>calloc(1, sizeof(ft_read_job))
        self.pool = ft_pool_create(num_threads, cpu_arr, spin_us)
        if self.pool == NULL or self.job == NULL or self.read_job == NULL:
            raise MemoryError("could not start the CPU expert worker threads")
        ft_ffn_set_pool(self.job, <void *>self.pool)
        self.num_threads = num_threads

    def __dealloc__(self):
        if self.pool != NULL:
            with nogil:
                ft_pool_destroy(self.pool)
            self.pool = NULL
        ft_ffn_job_free(self.job)
        free(self.read_job)

    def pinned_cpus(self):
        return [ft_pool_pinned_cpu(self.pool, i) for i in range(self.num_threads)]

    def is_busy(self):
        return bool(ft_pool_is_busy(self.pool))

    def submit_ffn(self, int isa_code, cnp.ndarray x, cnp.ndarray bank,
                   int64_t slot_stride, int dt, int D, int I,
                   int64_t off_gate, int64_t off_up, int64_t off_down,
                   cnp.ndarray token_ids, cnp.ndarray expert_ids,
                   cnp.ndarray weights, cnp.ndarray out, int act_code, tuple extra_args,
                   bint bf16_x_only, int64_t stage_max_bytes, int item_kb=0, int rows=0, int down_rows=0, int prefetch=0,
                   int help=0, int spread=0, int qdot=0):
        """Group the routes and start the job; returns at once (call wait()). Codes: ISA_CODES,
        DTYPE_CODES, ACT_CODES; extra_args: ft_ffn_extra's (alpha, limit, the three bias
        offsets, -1: none, the biases' DTYPE_CODES code). The caller has checked every array (kernels.CpuExpertPool).
        item_kb, rows, down_rows, prefetch, help, spread, qdot: ft_tune (ffn.h); 0 takes the path's
        default (qdot: the integer path)."""
        cdef int R = <int>cnp.PyArray_DIM(token_ids, 0), T = <int>cnp.PyArray_DIM(x, 0), rc
        cdef int64_t nbytes = cnp.PyArray_DIM(bank, 0)
        cdef const float *xp = <const float *>cnp.PyArray_DATA(x)
        cdef const uint8_t *bp = <const uint8_t *>cnp.PyArray_DATA(bank)
        cdef const int32_t *tp = <const int32_t *>cnp.PyArray_DATA(token_ids)
        cdef const int32_t *ep = <const int32_t *>cnp.PyArray_DATA(expert_ids)
        cdef const float *wp = <const float *>cnp.PyArray_DATA(weights)
        cdef float *op = <float *>cnp.PyArray_DATA(out)
        cdef ft_tune tune
        cdef ft_ffn_extra extra
        extra.alpha, extra.limit, extra.off_gate_bias, extra.off_up_bias, extra.off_down_bias, \
            extra.bias_dtype = extra_args
        tune.item_kb = item_kb
        tune.rows = rows
        tune.down_rows = down_rows
        tune.prefetch = prefetch
        tune.help = help
        tune.spread = spread
        tune.qdot = qdot
        with nogil:
            ft_pool_wait(self.pool)
            rc = ft_ffn_prepare(self.job, isa_code, bf16_x_only, self.num_threads, bp, nbytes, slot_stride,
                                dt, D, I, off_gate, off_up, off_down, xp, T, tp, ep, wp, R, op, act_code,
                                &extra, stage_max_bytes, &tune)
            if rc == FT_OK:
                ft_pool_submit(self.pool, ft_ffn_run, <void *>self.job)
        self.ffn_pending = rc == FT_OK
        if rc != FT_OK:
            raise ValueError(ERRORS.get(rc, f"kernel error {rc}"))

    def set_trace(self, int capacity):
        """Record the following jobs' work items (ffn.h ft_trace_rec), up to capacity per job;
        0: off."""
        cdef cnp.ndarray buf
        if capacity <= 0:
            ft_ffn_set_trace(self.job, NULL, 0)
            self.trace_buf = None
            return
        buf = np.zeros(capacity, dtype=TRACE_DTYPE)
        self.trace_buf = buf
        ft_ffn_set_trace(self.job, <ft_trace_rec *>cnp.PyArray_DATA(buf), capacity)

    def trace(self):
        """The last job's (info, records): info = (submit ns, done ns, G items, items, experts,
        staged, G item bytes, D item bytes); records a copy, CLOCK_MONOTONIC ns."""
        cdef int64_t info[8]
        cdef int n = ft_ffn_trace_info(self.job, info)
        recs = self.trace_buf[:n].copy() if self.trace_buf is not None else None
        return tuple(info[i] for i in range(8)), recs

    def last_isa(self):
        """The ISA path the last submitted job took."""
        cdef int code = ft_ffn_isa_used(self.job)
        return next(k for k, v in ISA_CODES.items() if v == code)

    def wait(self):
        """Wait for the submitted job; the calling thread runs its remaining items meanwhile
        (ft_ffn_help)."""
        cdef bint help = self.ffn_pending
        self.ffn_pending = False
        with nogil:
            if help:
                ft_ffn_help(self.job)
            ft_pool_wait(self.pool)
            ft_ffn_mark_done(self.job)

    def serve(self, ServeTable table, int64_t timeout_us, int trace_cap=0, bint skip_jobs=False):
        """Serve every layer of the table in order (serve.h: ft_serve_step), the GIL released.
        Returns 0, or the first kernel error code (FT_SERVE_TIMEOUT when a ready flag never
        came, FT_SERVE_STALE when a mailbox's number never did), the number of layers served and
        the layer of the first kernel error (-1: none; on those two: the CPU routes the host ran
        for the last layer it served).
        trace_cap > 0: trace the jobs' work items (up to
        that many per job, in a buffer of the serve's own) into the table's tr_* sums; the job's
        own trace setting (set_trace) is back afterwards. skip_jobs (benchmarks only, wrong
        results): zero partials instead of the jobs (serve.h FT_SERVE_SKIP_JOBS)."""
        cdef int rc, served = 0, failed = -1
        cdef int traced = trace_cap > 0 and not skip_jobs
        cdef int flags = ((FT_SERVE_TRACED if traced else 0)
                          | (FT_SERVE_SKIP_JOBS if skip_jobs else 0))
        cdef cnp.ndarray buf
        if traced:
            if self.serve_trace_buf is None or len(self.serve_trace_buf) < trace_cap:
                self.serve_trace_buf = np.zeros(trace_cap, dtype=TRACE_DTYPE)
            buf = self.serve_trace_buf
            ft_ffn_set_trace(self.job, <ft_trace_rec *>cnp.PyArray_DATA(buf), trace_cap)
        self.ffn_pending = False
        try:
            with nogil:
                ft_pool_wait(self.pool)
                rc = ft_serve_step(<void *>self.pool, self.job, self.num_threads, table.layers,
                                   table.n, timeout_us, &served, &failed, flags)
        finally:
            if traced and self.trace_buf is None:
                ft_ffn_set_trace(self.job, NULL, 0)
            elif traced:
                buf = self.trace_buf
                ft_ffn_set_trace(self.job, <ft_trace_rec *>cnp.PyArray_DATA(buf), len(buf))
        return rc, served, failed

    def read_sum(self, str isa, const uint8_t[::1] buf, bint help=True):
        """Every worker sums its share of buf (STREAM-like read); returns the 64-bit sum. With
        help the calling thread reads blocks too, as wait() runs expert items."""
        cdef int i
        cdef uint64_t total = 0
        self.read_job.isa = ISA_CODES[isa]
        self.read_job.buf = &buf[0]
        self.read_job.nbytes = buf.shape[0]
        self.read_job.next = 0
        self.read_job.sums[self.num_threads] = 0
        with nogil:
            ft_pool_submit(self.pool, ft_read_run, <void *>self.read_job)
            if help:
                ft_read_run(<void *>self.read_job, self.num_threads, self.num_threads)
            ft_pool_wait(self.pool)
        for i in range(self.num_threads + 1):
            total += self.read_job.sums[i]
        return total


def spin_pause_us(int64_t us):
    """Spin `us` microseconds on the pause instruction, the GIL released (pool.h
    ft_spin_pause_us: how the decode server waits for ready)."""
    with nogil:
        ft_spin_pause_us(us)
