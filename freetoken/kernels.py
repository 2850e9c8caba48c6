"""CPU expert kernels: the only importer of the compiled `freetoken._*` modules.

Owns the checks (dtype, shape, contiguity, slot layout) made before any native call, the
process-wide pinned worker pool, and the choice of ISA path. Does not decide which routes run
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
software prefetch, helping) are a KernelTuning: "auto" takes the ISA path's own defaults
(measured on the development machines; the avx2 bf16 kernel's differ), FREETOKEN_KERNEL_TUNE=
"key=value,..." overrides them per process, pool.tuning per pool; tools/bench_cpu_experts.py
--variants compares them side by side.

ISA paths (cython/ffn_dot_impl.c): avx512bf16 > avx512 > avx2 > generic, the best one this CPU
supports, or the one named by FREETOKEN_ISA / the `isa` argument. avx512bf16 feeds vdpbf16ps
bf16 inputs, rounding the experts' hidden activations to bf16 (as torch's bf16 experts do).
Chosen automatically it is only taken for calls whose x is exactly bf16 (a bf16 compute
dtype), so fp32 runs keep fp32 numerics; forced, it also rounds x. The other paths widen the
weights to fp32 and multiply-add in fp32.
"""
import os
from dataclasses import dataclass

import numpy as np

from . import _expert_ffn as _native
from .errors import ConfigError

ISAS = ("generic", "avx2", "avx512", "avx512bf16")
ACTS = ("silu", "gelu", "gelu_tanh")
DTYPE_SIZES = {"bf16": 2, "fp16": 2, "fp32": 4}
DEFAULT_SPIN_US = 100
# Largest [routes, D] fp32 scratch for the kernel's staged down mode (cython/ffn_impl.c): decode
# calls stay far below it; larger (prefill) calls use the direct mode.
STAGE_MAX_BYTES = 32 << 20
TUNE_ENV = "FREETOKEN_KERNEL_TUNE"
_F32, _I32, _U8 = np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.uint8)
_ISA_CODES, _DTYPE_CODES, _ACT_CODES = _native.ISA_CODES, _native.DTYPE_CODES, _native.ACT_CODES


class KernelArgumentError(ValueError):
    """A kernel was called with arrays of the wrong dtype, shape, layout or range (a bug)."""


class KernelError(RuntimeError):
    """A CPU expert job failed while it ran (a GPU-controlled step: serve)."""


def _check(cond: bool, msg: str):
    if not cond:
        raise KernelArgumentError(msg)


@dataclass(frozen=True)
class ExpertLayout:
    """Where one expert's projections sit inside a bank slot (byte offsets, row-major [out, in]).

    gate [I, D] at offset_gate, up [I, D] at offset_up, down [D, I] at offset_down; slot e of a
    bank starts at e * slot_stride.
    """
    slot_stride: int
    dtype: str
    D: int
    I: int
    offset_gate: int
    offset_up: int
    offset_down: int

    def __post_init__(self):
        _check(self.dtype in DTYPE_SIZES, f"unknown bank dtype {self.dtype!r}")
        _check(self.D > 0 and self.I > 0, f"bad expert shape D={self.D} I={self.I}")
        esize = DTYPE_SIZES[self.dtype]
        for off in (self.offset_gate, self.offset_up, self.offset_down):
            _check(off >= 0 and off % esize == 0, f"projection offset {off} not {esize}-byte aligned")
            _check(off + self.D * self.I * esize <= self.slot_stride,
                   f"projection at {off} runs past slot_stride {self.slot_stride}")

    @property
    def expert_nbytes(self) -> int:
        """Bytes of weights one expert call reads (gate + up + down)."""
        return 3 * self.D * self.I * DTYPE_SIZES[self.dtype]


def layout_from_bank_info(info) -> ExpertLayout:
    """ExpertLayout from an ftw BankInfo (slot_stride, dtype, projections of ProjInfo(name, shape,
    offset, nbytes)); checks that gate/up are [I, D] and down is [D, I]."""
    projs = {p.name: p for p in info.projections}
    _check(set(projs) >= {"gate", "up", "down"},
           f"bank {getattr(info, 'name', '?')} lacks gate/up/down projections: {sorted(projs)}")
    I, D = (int(s) for s in projs["gate"].shape)
    _check(tuple(projs["up"].shape) == (I, D) and tuple(projs["down"].shape) == (D, I),
           f"expert shapes disagree: gate {projs['gate'].shape} up {projs['up'].shape} "
           f"down {projs['down'].shape}")
    return ExpertLayout(int(info.slot_stride), str(info.dtype), D, I, int(projs["gate"].offset),
                        int(projs["up"].offset), int(projs["down"].offset))


@dataclass(frozen=True)
class KernelTuning:
    """Run-time knobs of the native kernel whose best value may differ between machines.

    item_kb: weight KiB per work item (smaller: shorter tail at the end of a call, more counter
    traffic). rows, down_rows: gate/up rows per pass and projection, down rows per pass, on the
    avx512bf16 and avx2 paths (1, 2 or 4: more rows share each x load, more streams at once).
    prefetch: software prefetch distance in bytes ahead of each row's loads (0: off),
    prefetch_hint "t0" or "t1" (into L1 or L2). help: 1 lets the thread that waits (and
    read_sum's caller) run the job's items too instead of only waiting (0); auto: only when the
    pool leaves a CPU of the allowed set free, since on a fully used machine the helper shares a
    worker's core and the items either of them holds finish late.
    spread: 0 (off), or a number of items per worker: a call with more weights than that many
    item_kb items per worker gets larger items, so large calls pay fewer item starts and claims
    while small ones keep their short tail.
    -1 ("auto", the default) in item_kb, rows, down_rows and prefetch takes the ISA path's own
    default (`path_defaults`): item_kb 192, rows 1, down_rows 1, prefetch 2048; on the avx2
    path with bf16 weights item_kb 1024, rows 4, down_rows 4, prefetch 4096 (cython/ffn_impl.c).
    Written as "item_kb=128,rows=4,prefetch=1024" in FREETOKEN_KERNEL_TUNE or `parse`.

    prefetch 2048 (tools/bench_cpu_experts.py --variants, Qwen3 shape, batch 1/4/16, x STREAM):
    16-core Xeon (H200 host, 15 threads) 1024: 0.81/0.82/0.80, 2048: 0.86/0.88/0.87, 4096:
    0.92/0.90/0.89, off: 0.73/0.77/0.73; 2-core EPYC here 1024: 0.98/0.95/0.94, 2048:
    0.97/0.96/0.94, 4096: 0.90/0.90/0.89. Beside PCIe copies it keeps its lead (H200 host, batch
    1, --beside-copies: 2048 110 GB/s beside 50 GB/s of copies, off 93).
    """
    item_kb: int = -1
    rows: int = -1
    down_rows: int = -1
    prefetch: int = -1
    prefetch_hint: str = "t1"
    help: int = -1
    spread: int = 0

    def __post_init__(self):
        if not (4 <= self.item_kb <= 65536 or self.item_kb == -1):
            raise ConfigError(f"kernel tuning item_kb={self.item_kb} is not in 4..65536 or auto")
        for key in ("rows", "down_rows"):
            if getattr(self, key) not in (-1, 1, 2, 4):
                raise ConfigError(f"kernel tuning {key}={getattr(self, key)} is not 1, 2, 4 or auto")
        if not (0 <= self.prefetch <= 1 << 16 and self.prefetch % 64 == 0 or self.prefetch == -1):
            raise ConfigError(f"kernel tuning prefetch={self.prefetch} is not a multiple of 64 in 0..65536 "
                              f"or auto")
        if self.help not in (-1, 0, 1):
            raise ConfigError(f"kernel tuning help={self.help} is not 0, 1 or auto")
        if self.prefetch_hint not in ("t0", "t1"):
            raise ConfigError(f"kernel tuning prefetch_hint={self.prefetch_hint!r} is not t0 or t1")
        if not 0 <= self.spread <= 4096:
            raise ConfigError(f"kernel tuning spread={self.spread} is not in 0..4096")

    @classmethod
    def parse(cls, text: str, base: "KernelTuning" = None) -> "KernelTuning":
        """'key=value,...' over `base` (the defaults); '' or 'default' gives base unchanged;
        'auto' is -1 (see the class docstring)."""
        fields = dict(vars(base or cls()))
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, eq, val = part.partition("=")
            key = key.strip()
            if part == "default":
                continue
            if not eq or key not in fields:
                raise ConfigError(f"kernel tuning {part!r}: expected key=value with key one of "
                                  f"{', '.join(fields)} (in {TUNE_ENV} or --variants)")
            try:
                val = val.strip()
                fields[key] = val if key == "prefetch_hint" else (-1 if val == "auto" else int(val))
            except ValueError:
                raise ConfigError(f"kernel tuning {part!r}: {key} takes an integer or auto") from None
        return cls(**fields)

    def __str__(self):
        return ",".join(f"{k}={'auto' if v == -1 else v}" for k, v in vars(self).items())

    def helps(self, num_threads: int) -> bool:
        """Whether the waiting thread runs items beside num_threads workers (help, or auto)."""
        return bool(self.help) if self.help >= 0 else num_threads < len(_allowed_cpus())

    def _path_values(self, isa: str, dtype: str) -> tuple:
        """(item_kb, rows, down_rows, prefetch) with every auto field the path's default."""
        own = (self.item_kb, self.rows, self.down_rows, self.prefetch)
        return tuple(d if v == -1 else v for v, d in zip(own, path_defaults(isa, dtype)))

    def resolved(self, isa: str, dtype: str = "bf16") -> "KernelTuning":
        """This tuning with every auto field (but help) replaced by the path's default."""
        return KernelTuning(*self._path_values(isa, dtype), self.prefetch_hint, self.help, self.spread)

    def native_args(self, num_threads: int, isa: str, dtype: str):
        """(item_kb, rows, down_rows, prefetch, help, spread) as the native submit takes them for
        that path (the prefetch hint in the distance's low bits; -1: off)."""
        item_kb, rows, down_rows, pf = self._path_values(isa, dtype)
        pf = (pf | (self.prefetch_hint == "t1")) if pf else -1
        return item_kb, rows, down_rows, pf, 1 if self.helps(num_threads) else -1, self.spread


_PATH_DEFAULTS = {}


def path_defaults(isa: str, dtype: str = "bf16"):
    """(item_kb, rows, down_rows, prefetch bytes) an ISA path takes for auto (cython/ffn_impl.c)."""
    key = (isa, dtype)
    if key not in _PATH_DEFAULTS:
        item_kb, rows, down_rows, pf = _native.tune_defaults(isa, dtype)
        _PATH_DEFAULTS[key] = (item_kb, rows, down_rows, pf & ~63)
    return _PATH_DEFAULTS[key]


def tuning_from_env() -> KernelTuning:
    return KernelTuning.parse(os.environ.get(TUNE_ENV, ""))


# ---- CPU topology -------------------------------------------------------------------------

def _read_int(path):
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _allowed_cpus() -> list:
    """Logical CPU ids this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        list(range(os.cpu_count() or 1))


def physical_cores() -> list:
    """One logical CPU id (the lowest) per physical core in this process's allowed CPU set."""
    first = {}
    for cpu in _allowed_cpus():
        topo = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        key = (_read_int(f"{topo}/physical_package_id"), _read_int(f"{topo}/die_id"),
               _read_int(f"{topo}/core_id"))
        first.setdefault(key if key[2] is not None else ("cpu", cpu), cpu)
    return sorted(first.values())


def default_num_threads(has_gpu: bool = True) -> int:
    """Physical cores minus one driver core with a GPU; all physical cores without (at least 1)."""
    n = len(physical_cores())
    return max(1, n - 1) if has_gpu else n


def _pin_plan(num_threads: int) -> list:
    """CPU per worker: physical cores after the first (left to the driver), then the first,
    then the remaining logical CPUs (SMT siblings); -1 (unpinned) past the allowed set."""
    cores = physical_cores()
    allowed = _allowed_cpus()
    order = cores[1:] + cores[:1] + [c for c in allowed if c not in cores]
    return [order[i] if i < len(order) else -1 for i in range(num_threads)]


def available_isas() -> list:
    """ISA paths this CPU can run, slowest first."""
    return [name for name in ISAS if _native.isa_supported(name)]


def _resolve_isa(isa):
    name = isa or os.environ.get("FREETOKEN_ISA") or _native.isa_best()
    if name not in ISAS:
        raise ConfigError(f"FREETOKEN_ISA={name!r} is not one of {', '.join(ISAS)}")
    if not _native.isa_supported(name):
        raise ConfigError(f"this CPU cannot run the {name} kernels; use one of "
                          f"{', '.join(available_isas())} (or unset FREETOKEN_ISA)")
    return name


# ---- the pool ---------------------------------------------------------------------------------

def _explain(lay, x, bank, tok, exp, w, out, act):
    """Raise KernelArgumentError naming the first thing wrong with submit's arguments."""
    _check(x.dtype == np.float32 and x.ndim == 2 and x.flags.c_contiguous,
           f"x must be C-contiguous float32 [T, D], got {x.dtype} {x.shape}")
    _check(x.shape[1] == lay.D, f"x has D={x.shape[1]}, the bank's experts D={lay.D}")
    _check(out.dtype == np.float32 and out.shape == x.shape and out.flags.c_contiguous
           and out.flags.writeable, f"out must be writable C-contiguous float32 {x.shape}")
    _check(bank.dtype == np.uint8 and bank.ndim == 1 and bank.flags.c_contiguous,
           "bank must be a contiguous 1-D uint8 array (HostBank.data)")
    _check(bank.nbytes >= lay.slot_stride, f"bank ({bank.nbytes} B) holds no full slot")
    R = tok.shape[0] if tok.ndim == 1 else -1
    for arr, name, dt in ((tok, "token_ids", np.int32), (exp, "expert_ids", np.int32),
                          (w, "weights", np.float32)):
        _check(arr.dtype == dt and arr.ndim == 1 and arr.flags.c_contiguous and arr.shape[0] == R,
               f"{name} must be contiguous {np.dtype(dt).name} [R] with R={R}, got "
               f"{arr.dtype} {arr.shape}")
    _check(act in ACTS, f"act must be one of {ACTS}, not {act!r}")


def _as_array(a, name):
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "numpy"):  # a CPU torch tensor: shares memory
        _check(getattr(a, "device", None) is None or a.device.type == "cpu", f"{name} must be on the CPU")
        return a.numpy()
    raise KernelArgumentError(f"{name} must be a numpy array or CPU tensor, got {type(a).__name__}")


class CpuExpertHandle:
    """A submitted layer job. wait() blocks (GIL released) and returns `out`; safe to call twice."""

    __slots__ = ("_pool", "_out", "_refs", "_done")

    def __init__(self, pool, out, refs, done):
        self._pool, self._out, self._refs, self._done = pool, out, refs, done

    def done(self) -> bool:
        return self._done

    def wait(self):
        if not self._done:
            self._pool._native.wait()
            self._done = True
            self._refs = None
            self._pool._pending = None
        return self._out


class CpuExpertPool:
    """Persistent pinned worker pool running CPU expert jobs, one at a time.

    Contract (docs/INTERFACES.md section 5): submit() returns at once; handle.wait() returns
    `out` after out[t] += w * down(act(gate(x[t])) * up(x[t])) for every route (t, e, w).
    Arrays passed to submit are kept alive by the handle until wait() returns.
    """

    def __init__(self, num_threads=None, isa=None, pin=True, spin_us=DEFAULT_SPIN_US):
        self.num_threads = int(num_threads) if num_threads else default_num_threads()
        if not 1 <= self.num_threads <= 1024:
            raise ConfigError(f"--cpu-threads must be between 1 and 1024, not {self.num_threads}")
        self.isa = _resolve_isa(isa)
        self._isa_forced = bool(isa or os.environ.get("FREETOKEN_ISA"))
        self._native = _native.NativePool(self.num_threads, _pin_plan(self.num_threads) if pin else None,
                                          int(spin_us))
        self._pending = None
        self.pid = os.getpid()
        self.spin_us = spin_us
        self.tuning = tuning_from_env()

    @property
    def last_isa(self) -> str:
        """The ISA path the last submitted job took (see the module docstring)."""
        return self._native.last_isa()

    @property
    def pinned_cpus(self) -> list:
        """The CPU each worker is pinned to (-1: not pinned)."""
        return self._native.pinned_cpus()

    def submit(self, x, bank, layout, token_ids, expert_ids, weights, out, act="silu", isa=None):
        """Start one layer's CPU routes; see the class docstring. Raises KernelArgumentError on
        a bad argument and if the previous job was not waited for."""
        _check(self._pending is None, "the previous CPU expert job was not waited for")
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
              and act in _ACT_CODES)
        if not ok:
            _explain(lay, x, bank, tok, exp, w, out, act)
        forced = bool(isa) or self._isa_forced
        isa = _resolve_isa(isa) if isa else self.isa
        _check(os.getpid() == self.pid, "a CpuExpertPool cannot be used after fork")
        if R == 0:
            return CpuExpertHandle(self, out_obj, None, True)
        try:
            self._native.submit_ffn(_ISA_CODES[isa], x, bank, lay.slot_stride, _DTYPE_CODES[lay.dtype],
                                    lay.D, lay.I, lay.offset_gate, lay.offset_up, lay.offset_down,
                                    tok, exp, w, out, _ACT_CODES[act], not forced, STAGE_MAX_BYTES,
                                    *self.tuning.native_args(self.num_threads, isa, lay.dtype))
        except ValueError as e:
            raise KernelArgumentError(str(e)) from None
        handle = CpuExpertHandle(self, out_obj, (x, bank, tok, exp, w, out), False)
        self._pending = handle
        return handle

    def serve_table(self, layers) -> "ServeTable":
        """The table of a GPU-controlled decode step (cython/serve.h; experts/device_step.py):
        layers, in the order the step runs them: (bank, layout, act, mailbox) with mailbox the
        layer's device_step.Mailbox (pinned host tensors, one token)."""
        isa, forced = self.isa, self._isa_forced
        entries, refs = [], []
        for bank, layout, act, box in layers:
            lay = layout if isinstance(layout, ExpertLayout) else ExpertLayout(*layout)
            bank = _as_array(bank, "bank")
            _check(bank.dtype == _U8 and bank.ndim == 1 and bank.flags.c_contiguous,
                   "bank must be a contiguous 1-D uint8 array")
            _check(act in _ACT_CODES, f"unknown activation {act!r}")
            _check(box.D == lay.D and 0 < box.K <= 64, "the mailbox does not fit the layer")
            entries.append((_ISA_CODES[isa], not forced, _DTYPE_CODES[lay.dtype], lay.D, lay.I,
                            _ACT_CODES[act], bank, lay.slot_stride, lay.offset_gate,
                            lay.offset_up, lay.offset_down, STAGE_MAX_BYTES,
                            tuple(self.tuning.native_args(self.num_threads, isa, lay.dtype)),
                            box.ready_addr, box.done_addr, box.ids.data_ptr(), box.w.data_ptr(),
                            box.x.data_ptr(), box.partial.data_ptr(), box.K))
            refs.append((bank, box))
        table = _native.ServeTable(entries)
        return ServeTable(table, refs)

    def serve(self, table: "ServeTable", timeout_s: float = 60.0) -> None:
        """Serve one step of the table's layers (blocks, the GIL released, until the last layer's
        partial is written). Raises KernelError when a layer's job failed or a ready flag did not
        come within timeout_s (the remaining layers' done flags are raised, so the GPU ends)."""
        _check(self._pending is None, "the previous CPU expert job was not waited for")
        _check(os.getpid() == self.pid, "a CpuExpertPool cannot be used after fork")
        rc, served = self._native.serve(table.native, int(timeout_s * 1e6))
        if rc == _native.SERVE_TIMEOUT:
            raise KernelError(f"the GPU did not hand over layer {served} of the decode step within "
                              f"{timeout_s:g} s (its plan or an earlier kernel failed); rerun with "
                              f"FREETOKEN_DEVICE_CONTROL=0 to plan on the host")
        if rc != 0:
            raise KernelError(f"CPU expert job of layer {served - 1} failed: "
                              f"{_native.ERRORS.get(rc, rc)}")

    def run(self, *args, **kwargs):
        """submit(...).wait(): the synchronous form."""
        return self.submit(*args, **kwargs).wait()

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

    __slots__ = ("native", "refs")

    def __init__(self, native, refs):
        self.native, self.refs = native, refs


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
