"""CPU expert kernels: the importer of the compiled `freetoken._*` kernel modules (ftw/quant.py
imports the quantizer, freetoken._quant, itself).

Owns every native call, each made after the checks (dtype, shape, contiguity, slot layout)
of freetoken/kernel_args.py, the process-wide pinned worker pool, and the choice of ISA path. Does not decide which routes run
on the CPU (that is the MoE plan's job).

Threads. The pool has one pthread per physical core, pinned, parked on a futex after a short
spin. By default it leaves the first physical core of the process's allowed CPU set to the
driver thread (Python, CUDA launches, the GPU branch that runs while the pool works):
`default_num_threads(has_gpu=True)` = physical cores - 1. torch's intra-op OpenMP team must not
fight the pool: the engine's rule (freetoken/experts/executor.py) is torch single-threaded
while the pool is in use, and a pool that never spins (`spin_us=0`) on CPU-only runs, where
its workers cover every core. The pool uses pthreads, not OpenMP: no second OpenMP runtime.
A spinning thread (a worker between jobs, the driver in wait) yields its core every 64 pauses,
so a thread sharing that core is not starved. wait() runs the job's remaining items on the
calling thread when the pool leaves a CPU free (KernelTuning.help).

Tuning. Knobs whose best value differs between machines (work-item size, rows per pass,
software prefetch, helping) are a KernelTuning (freetoken/kernel_tuning.py): "auto" takes the ISA
path's own defaults (path_defaults here, from the native module, passed into KernelTuning),
FREETOKEN_KERNEL_TUNE="key=value,..." overrides them per process, pool.tuning per pool. The
argument checks and ExpertLayout live in freetoken/kernel_args.py, the CPU topology (physical
cores, pin plan) in freetoken/cpu_topology.py, the serve tables' summaries in
freetoken/serve_stats.py; this module re-exports their public names, so
`freetoken.kernels` stays the one import for callers.

ISA paths (cython/ffn_dot_impl.c): avx512bf16 > avx512 > avx2 > generic, the best one this CPU
supports, or the one named by FREETOKEN_ISA / the `isa` argument. avx512bf16 feeds vdpbf16ps
bf16 inputs, rounding the experts' hidden activations to bf16 (as torch's bf16 experts do).
Chosen automatically it is only taken for calls whose x is exactly bf16 (a bf16 compute
dtype), so fp32 runs keep fp32 numerics; forced, it also rounds x. The other paths widen the
weights to fp32 and multiply-add in fp32. Quantized experts widen their weights to fp32 by
default (cython/qdot_impl.c); q8_0, q4_0 and mxfp4 can take integer dot products of
int8-quantized inputs instead (KernelTuning.qdot="int8", until the H200 table decides;
cython/qdot.h), on avx512 in their avx512-vnni form where the CPU has VNNI (qdot8_has_vnni),
else their avx2 one.
"""
import os
import threading
import warnings

import numpy as np

from . import _expert_ffn as _native
from . import _plan as _native_plan
from .config import env
from .cpu_topology import _pin_plan, default_num_threads, physical_cores
from .errors import ConfigError
from .kernel_args import (ACTS, DTYPE_SIZES, KERNEL_QUANTS, SILU, ExpertAct, ExpertLayout,
                          KernelArgumentError, _as_array, _check, _explain, layout_from_bank_info)
from .kernel_tuning import TUNE_ENV, KernelTuning, tuning_from_env
from .serve_stats import job_summary, trace_summary

# The public surface, re-exports from the split-out modules included.
__all__ = ["ACTS", "DEFAULT_SPIN_US", "DTYPE_SIZES", "ISAS", "KERNEL_QUANTS", "STAGE_MAX_BYTES",
           "TUNE_ENV", "CpuExpertHandle", "CpuExpertPool", "ExpertAct", "ExpertLayout",
           "KernelArgumentError", "KernelError", "KernelTuning", "ServeTable", "available_isas",
           "default_num_threads", "get_pool", "job_summary", "trace_summary",
           "layout_from_bank_info", "path_defaults", "physical_cores", "qdot8_has_vnni", "spin_pause_us",
           "tuning_from_env"]

ISAS = ("generic", "avx2", "avx512", "avx512bf16")


def _as_act(act) -> ExpertAct:
    """An ExpertAct from one or from its name (with the default alpha and limit)."""
    return act if isinstance(act, ExpertAct) else ExpertAct(act)

DEFAULT_SPIN_US = 100
# Largest [routes, D] fp32 scratch for the kernel's staged down mode (cython/ffn_impl.c): decode
# calls stay far below it; larger (prefill) calls use the direct mode. Read at call time, so a
# test may monkeypatch kernels.STAGE_MAX_BYTES.
STAGE_MAX_BYTES = 32 << 20
_F32, _I32, _U8 = np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.uint8)
_ISA_CODES, _DTYPE_CODES, _ACT_CODES = _native.ISA_CODES, _native.DTYPE_CODES, _native.ACT_CODES


class KernelError(RuntimeError):
    """A CPU expert job failed while it ran (a GPU-controlled step: serve)."""


# ---- ISA paths -------------------------------------------------------------------------------

_PATH_DEFAULTS = {}


def path_defaults(isa: str, dtype: str = "bf16", num_threads: int = 1) -> tuple:
    """(item_kb, rows, down_rows, prefetch bytes) an ISA path takes for a KernelTuning's auto
    fields on a pool of num_threads (cython/ffn_impl.c); what KernelTuning.resolved and
    native_args take."""
    key = (isa, dtype, num_threads)
    if key not in _PATH_DEFAULTS:
        item_kb, rows, down_rows, pf = _native.tune_defaults(isa, dtype, num_threads)
        _PATH_DEFAULTS[key] = (item_kb, rows, down_rows, pf & ~63)
    return _PATH_DEFAULTS[key]


def qdot8_has_vnni() -> bool:
    """Whether the int8 quantized kernels run their avx512-vnni form here (cython/qdot8_impl.c):
    the avx512 paths then report avx512 for them, else avx2."""
    return _native.qdot8_has_vnni()


def available_isas() -> list:
    """ISA paths this CPU can run, slowest first."""
    return [name for name in ISAS if _native.isa_supported(name)]


def _resolve_isa(isa):
    name = isa or env("FREETOKEN_ISA") or _native.isa_best()
    if name not in ISAS:
        source = "the ISA path asked for" if isa else "FREETOKEN_ISA"
        raise ConfigError(f"{source} {name!r} is not one of {', '.join(ISAS)}")
    if not _native.isa_supported(name):
        raise ConfigError(f"this CPU cannot run the {name} kernels; use one of "
                          f"{', '.join(available_isas())} (or unset FREETOKEN_ISA)")
    return name


# ---- the pool ---------------------------------------------------------------------------------

class CpuExpertHandle:
    """A submitted layer job. wait() blocks (GIL released) and returns `out`; safe to call twice."""

    __slots__ = ("_pool", "_out", "_refs", "_done")

    def __init__(self, pool, out, refs, done):
        self._pool, self._out, self._refs, self._done = pool, out, refs, done

    def done(self) -> bool:
        return self._done

    def wait(self):
        if not self._done:
            try:
                self._pool._native.wait()
            finally:
                self._done = True
                self._refs = None
                self._pool._pending = None
                self._pool._give()
        return self._out


class CpuExpertPool:
    """Persistent pinned worker pool running CPU expert jobs, one at a time.

    Contract (docs/INTERFACES.md section 5): submit() returns at once; handle.wait() returns
    `out` after out[t] += w * down(act(gate(x[t])) * up(x[t])) for every route (t, e, w).
    Arrays passed to submit are kept alive by the handle until wait() returns.
    Threads: a job holds the pool from submit() to its wait() (serve() for its call), so a
    second thread's submit blocks until then (the scheduler's decode thread beside a prefill
    forward: scheduler.py); the same thread submitting twice without a wait raises.
    """

    def __init__(self, num_threads=None, isa=None, pin=True, spin_us=DEFAULT_SPIN_US):
        self.num_threads = int(num_threads) if num_threads else default_num_threads()
        if not 1 <= self.num_threads <= 1024:
            raise ConfigError(f"--cpu-threads must be between 1 and 1024, not {self.num_threads}")
        self.isa = _resolve_isa(isa)
        self._isa_forced = bool(isa or env("FREETOKEN_ISA"))
        self._native = _native.NativePool(self.num_threads, _pin_plan(self.num_threads) if pin else None,
                                          int(spin_us))
        self._pending = None
        self._lock = threading.Lock()  # held by a job from submit to wait (class docstring)
        self._owner = None  # the thread ident holding it
        self.pid = os.getpid()
        self.spin_us = spin_us
        self.tuning = tuning_from_env()

    def _take(self) -> None:
        me = threading.get_ident()
        _check(self._owner != me, "the previous CPU expert job was not waited for")
        self._lock.acquire()
        self._owner = me

    def _give(self) -> None:
        self._owner = None
        self._lock.release()

    def abandon(self) -> None:
        """When the calling thread holds the pool (a job submitted and never waited for: an
        error came between), waits for that job and lets the pool go; else nothing. A thread
        that ends on an error calls it so that the other threads' jobs do not wait forever."""
        if self._owner == threading.get_ident():
            if self._pending is not None:
                self._pending.wait()
            else:
                self._give()

    @property
    def last_isa(self) -> str:
        """The ISA path the last submitted job took (see the module docstring)."""
        return self._native.last_isa()

    @property
    def pinned_cpus(self) -> list:
        """The CPU each worker is pinned to (-1: not pinned)."""
        return self._native.pinned_cpus()

    def submit(self, x, bank, layout, token_ids, expert_ids, weights, out, act=SILU, isa=None):
        """Start one layer's CPU routes; see the class docstring. act: an ExpertAct (or the
        name of one with its defaults). Raises KernelArgumentError on a bad argument and if
        the previous job was not waited for."""
        _check(self._pending is None or self._owner != threading.get_ident(),
               "the previous CPU expert job was not waited for")
        act = _as_act(act)
        lay = layout if isinstance(layout, ExpertLayout) else ExpertLayout(*layout)
        out_obj = out
        arrays = [a if type(a) is np.ndarray else _as_array(a, name) for a, name in
                  ((x, "x"), (bank, "bank"), (token_ids, "token_ids"), (expert_ids, "expert_ids"),
                   (weights, "weights"), (out, "out"))]
        x, bank, tok, exp, w, out = arrays
        # One cheap test per call; the messages are only built when it fails (_explain).
        R = tok.shape[0] if tok.ndim == 1 else -1
        ok = (x.dtype == _F32 and x.ndim == 2 and x.flags.c_contiguous and x.shape[1] == lay.D
              and out.dtype == _F32 and out.shape == x.shape and out.flags.c_contiguous
              and out.flags.writeable and bank.dtype == _U8 and bank.ndim == 1
              and bank.flags.c_contiguous and bank.nbytes >= lay.slot_stride
              and tok.dtype == _I32 and exp.dtype == _I32 and w.dtype == _F32
              and exp.ndim == 1 and w.ndim == 1 and exp.shape[0] == R and w.shape[0] == R
              and tok.flags.c_contiguous and exp.flags.c_contiguous and w.flags.c_contiguous
              and act.name in _ACT_CODES)
        if not ok:
            _explain(lay, x, bank, tok, exp, w, out, act)
        forced = bool(isa) or self._isa_forced
        isa = _resolve_isa(isa) if isa else self.isa
        _check(os.getpid() == self.pid, "a CpuExpertPool cannot be used after fork")
        if R == 0:
            return CpuExpertHandle(self, out_obj, None, True)
        tune = self.tuning.native_args(self.num_threads, path_defaults(isa, lay.kernel_dtype, self.num_threads))
        self._take()  # until the handle's wait (the class docstring)
        try:
            self._native.submit_ffn(_ISA_CODES[isa], x, bank, lay.slot_stride, _DTYPE_CODES[lay.kernel_dtype],
                                    lay.D, lay.I, lay.offset_gate, lay.offset_up, lay.offset_down,
                                    tok, exp, w, out, _ACT_CODES[act.name], lay.native_extra(act, _DTYPE_CODES),
                                    not forced, STAGE_MAX_BYTES,
                                    *tune)
        except BaseException as e:
            self._give()
            if isinstance(e, ValueError):
                raise KernelArgumentError(str(e)) from None
            raise
        handle = CpuExpertHandle(self, out_obj, (x, bank, tok, exp, w, out), False)
        self._pending = handle
        return handle

    def serve_table(self, layers, trace: bool = False, skip_jobs: bool = False) -> "ServeTable":
        """The table of a GPU-controlled decode step (cython/serve.h; experts/captured/control.py):
        layers, in the order the step runs them: (bank, layout, act, mailbox) with mailbox the
        layer's device_plan.Mailbox (pinned host tensors, up to box.max_tokens tokens). trace: its serves trace
        the jobs' work items; skip_jobs: its jobs are skipped (zero partials: WRONG results, a
        step's time without the CPU's compute; benchmarks only)."""
        isa, forced = self.isa, self._isa_forced
        entries, refs = [], []
        for bank, layout, act, box in layers:
            lay = layout if isinstance(layout, ExpertLayout) else ExpertLayout(*layout)
            bank = _as_array(bank, "bank")
            _check(bank.dtype == _U8 and bank.ndim == 1 and bank.flags.c_contiguous,
                   "bank must be a contiguous 1-D uint8 array")
            act = _as_act(act)
            _check(box.D == lay.D and 0 < box.K <= box.max_routes <= 64,  # serve_impl.c MAX_ROUTES
                   "the mailbox does not fit the layer")
            tune = self.tuning.native_args(self.num_threads, path_defaults(isa, lay.kernel_dtype, self.num_threads))
            entries.append((_ISA_CODES[isa], not forced, _DTYPE_CODES[lay.kernel_dtype], lay.D, lay.I,
                            _ACT_CODES[act.name], lay.native_extra(act, _DTYPE_CODES), bank, lay.slot_stride,
                            lay.offset_gate,
                            lay.offset_up, lay.offset_down, STAGE_MAX_BYTES, tuple(tune),
                            box.ready_addr, box.done_addr, box.ids.data_ptr(), box.w.data_ptr(),
                            box.x.data_ptr(), box.partial.data_ptr(), box.seq.data_ptr(),
                            box.tokens.data_ptr(), box.K, box.max_routes))
            refs.append((bank, box))
        table = _native.ServeTable(entries)
        if skip_jobs:
            warnings.warn("serve_skip_jobs: the CPU expert jobs are skipped and their partial "
                          "sums are zero, so the outputs are wrong (benchmarks only)",
                          RuntimeWarning, stacklevel=2)
        return ServeTable(table, refs, trace, skip_jobs)

    def serve(self, table: "ServeTable", timeout_s: float = 60.0) -> None:
        """Serve one step of the table's layers (blocks, the GIL released, until the last layer's
        partial is written). Raises KernelError when a layer's job failed, or when a ready flag,
        or after it the mailbox's number, did not come within timeout_s (the remaining layers'
        done flags are raised, so the GPU ends)."""
        _check(self._owner != threading.get_ident(), "the previous CPU expert job was not waited for")
        _check(os.getpid() == self.pid, "a CpuExpertPool cannot be used after fork")
        self._take()
        try:
            rc, served, failed = self._native.serve(table.native, int(timeout_s * 1e6),
                                                    SERVE_TRACE_CAP if table.trace else 0,
                                                    table.skip_jobs)
        finally:
            self._give()
        if rc in (_native.SERVE_TIMEOUT, _native.SERVE_STALE):
            what = ("did not hand over layer" if rc == _native.SERVE_TIMEOUT else
                    "raised ready but never wrote the mailbox of layer")
            err = KernelError(f"the GPU {what} {served} of the decode step within "
                              f"{timeout_s:g} s (its plan or an earlier kernel failed); rerun with "
                              f"--no-cuda-graphs to plan every step on the host")
            err.waited_for = served  # the table's index of the layer whose ready never came
            err.host_routes = failed  # the CPU routes the host ran for the layer before it
            raise err
        if rc != 0:
            raise KernelError(f"CPU expert job of layer {failed} failed: "
                              f"{_native.ERRORS.get(rc, rc)}")

    def run(self, *args, **kwargs):
        """submit(...).wait(): the synchronous form."""
        return self.submit(*args, **kwargs).wait()

    def set_trace(self, capacity: int) -> None:
        """Diagnostics (tools/bench_cpu_jobs.py --trace): record every work item of the following
        jobs, up to `capacity` per job; 0 turns it off. Costs two or three clock reads per item."""
        _check(self._pending is None, "the previous CPU expert job was not waited for")
        self._native.set_trace(int(capacity))

    def last_trace(self) -> dict:
        """The last traced job: submit_ns (its prepare ended), done_ns (wait() saw it end),
        g_items, items, experts, staged, g_item_bytes, d_item_bytes, and records (numpy:
        claim_ns, ready_ns, end_ns, tid, item per work item; item < g_items: a gate/up item,
        ready_ns: when its wait for earlier items ended). CLOCK_MONOTONIC ns, as time.monotonic_ns."""
        info, records = self._native.trace()
        keys = ("submit_ns", "done_ns", "g_items", "items", "experts", "staged", "g_item_bytes",
                "d_item_bytes")
        return dict(zip(keys, info), records=records)

    def read_sum(self, buf, isa=None) -> int:
        """STREAM-like read: all workers sum their share of `buf` (uint8, contiguous) as 64-bit
        words with the widest loads this CPU has (or `isa`'s); returns the sum so the reads cannot be optimised
        away. Synchronous."""
        _check(self._pending is None, "the previous CPU expert job was not waited for")
        buf = _as_array(buf, "buf")
        _check(buf.dtype == np.uint8 and buf.ndim == 1 and buf.flags.c_contiguous and buf.nbytes > 0,
               "buf must be a non-empty contiguous 1-D uint8 array")
        return self._native.read_sum(_resolve_isa(isa) if isa else _native.isa_best(), buf,
                                     self.tuning.helps(self.num_threads))


class ServeTable:
    """A native serve table (cython/expert_ffn.pyx ServeTable) and what its pointers point into."""

    __slots__ = ("native", "refs", "trace", "skip_jobs")

    def __init__(self, native, refs, trace: bool = False, skip_jobs: bool = False):
        self.native, self.refs = native, refs
        self.trace = trace  # its serves trace the jobs' work items (Tuning.serve_trace)
        # benchmarks only, wrong results: zero partials instead of the CPU jobs
        # (Tuning.serve_skip_jobs), so a step's time shows what the CPU's compute costs it
        self.skip_jobs = skip_jobs

    def stats(self, reset: bool = False) -> list:
        """Per layer (ns waiting for ready, ns from ready to done in steps with CPU routes,
        the number of those, times served), summed over the steps served since the last
        reset."""
        return self.native.stats(reset)

    def job_times(self) -> tuple:
        """(ns from ready seen to the jobs' submit, summed; the jobs' ready-to-done counts in
        buckets of bucket_us µs, the last one the longer jobs; bucket_us) since the last
        stats(reset=True): for job_summary."""
        return self.native.job_times()

    def stale_reads(self) -> int:
        """Ready flags that reached the host before their plan's mailbox stores (the server
        then waited for them), since the last stats(reset=True) (cython/serve.h seq)."""
        return self.native.stale_reads()

    def trace_times(self) -> dict:
        """The traced jobs' breakdowns summed since the last stats(reset=True) (cython/serve.h
        tr_*): for trace_summary."""
        return self.native.trace_times()


SERVE_TRACE_CAP = 1 << 14  # work items recorded per traced job (a decode job has ~100 per expert)


def spin_pause_us(us: float) -> None:
    """Spin `us` microseconds on the pause instruction in native code, as the decode server does
    while it waits for a layer (diagnostics: tools/bench_cpu_jobs.py --gap-wait spin)."""
    _native.spin_pause_us(int(us))


_shared = None


def get_pool(num_threads=None, spin_us=DEFAULT_SPIN_US) -> CpuExpertPool:
    """The process-wide pool, created on first use (re-created after fork, or for a new thread
    count or spin time)."""
    global _shared
    want = int(num_threads) if num_threads else None
    if (_shared is None or _shared.pid != os.getpid() or spin_us != _shared.spin_us
            or (want is not None and want != _shared.num_threads)):
        _shared = CpuExpertPool(want, spin_us=spin_us)
    return _shared


def native_decode_plan(res, own, stamps, expert_ids, layer, policy, P, C, capacity, behind,
                       tables=None):
    """One token's decode plan in native code (cython/plan.pyx: experts/plan.make_decode_plan's
    fast path, equal to its Python body); None where it hands the step back to that body."""
    return _native_plan.decode_plan(res, own, stamps, expert_ids, layer, policy, P, C, capacity,
                                    behind, tables)
