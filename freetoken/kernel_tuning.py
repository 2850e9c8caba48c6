"""Run-time knobs of the CPU expert kernel whose best value differs between machines.

KernelTuning (work-item size, rows per pass, software prefetch, helping, spread), its
FREETOKEN_KERNEL_TUNE="key=value,..." parsing, and how "auto" fields take an ISA path's own
defaults, which the caller passes in (kernels.path_defaults asks the native module: this module
imports no compiled code and nothing of kernels.py). The env sets them per process, pool.tuning
per pool; tools/bench_cpu_experts.py --variants compares them side by side.
freetoken/kernels.py re-exports every public name here.
"""
from dataclasses import dataclass

from .config import env
from .cpu_topology import _allowed_cpus
from .errors import ConfigError

TUNE_ENV = "FREETOKEN_KERNEL_TUNE"
QDOT_PATHS = ("int8", "fp32")  # KernelTuning.qdot, in the order of ffn.h's FT_QDOT_* codes


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
    default for the pool's size (`kernels.path_defaults`): item_kb 192, rows 1, down_rows 1, prefetch
    2048, or 4096 on a pool of 8 threads or more; on the avx2 and avx512 paths with bf16 weights
    item_kb 1024, rows 4, down_rows 4, prefetch 4096; on the avx2 path with q4_0 or mxfp4 weights
    item_kb 1024, rows 4, down_rows 4 (cython/ffn_impl.c).
    Written as "item_kb=128,rows=4,prefetch=1024" in FREETOKEN_KERNEL_TUNE or `parse`.

    prefetch 2048 or 4096 by pool size: 4096 is best on the H200 host's 15 threads, 1024-2048 on
    2 cores (docs/MEASUREMENTS.md#kernel-defaults-per-isa-path).

    qdot: how quantized experts (q8_0, q4_0, mxfp4) multiply: "int8" quantizes each input per
    32-block to int8 and takes integer dot products (llama.cpp's way; the results differ from
    dequantize-then-fp32 by the inputs' rounding, cython/qdot.h), "fp32" widens the weights to
    fp32 (exact up to the order of additions: the oracle). nvfp4 and fp8_e4m3 always run "fp32".
    docs/MEASUREMENTS.md#quantized-experts-on-the-cpu compares them.
    """
    item_kb: int = -1
    rows: int = -1
    down_rows: int = -1
    prefetch: int = -1
    prefetch_hint: str = "t1"
    help: int = -1
    spread: int = 0
    qdot: str = "fp32"  # int8 once the H200 table shows it wins (docs/MEASUREMENTS.md)

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
        if self.qdot not in QDOT_PATHS:
            raise ConfigError(f"kernel tuning qdot={self.qdot!r} is not one of {', '.join(QDOT_PATHS)}")

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
                fields[key] = val if key in ("prefetch_hint", "qdot") else (-1 if val == "auto" else int(val))
            except ValueError:
                raise ConfigError(f"kernel tuning {part!r}: {key} takes an integer or auto") from None
        return cls(**fields)

    def __str__(self):
        return ",".join(f"{k}={'auto' if v == -1 else v}" for k, v in vars(self).items())

    def helps(self, num_threads: int) -> bool:
        """Whether the waiting thread runs items beside num_threads workers (help, or auto)."""
        return bool(self.help) if self.help >= 0 else num_threads < len(_allowed_cpus())

    def resolved(self, defaults: tuple) -> "KernelTuning":
        """This tuning with every auto field (but help) replaced by the path's default: defaults
        is (item_kb, rows, down_rows, prefetch) of that path on the pool's size, as
        kernels.path_defaults(isa, dtype, num_threads) gives them."""
        own = (self.item_kb, self.rows, self.down_rows, self.prefetch)
        return KernelTuning(*(d if v == -1 else v for v, d in zip(own, defaults)), self.prefetch_hint,
                            self.help, self.spread, self.qdot)

    def native_args(self, num_threads: int, defaults: tuple):
        """(item_kb, rows, down_rows, prefetch, help, spread, qdot) as the native submit takes them for
        a path whose defaults (kernels.path_defaults) are `defaults` (the prefetch hint in the
        distance's low bits; -1: off). Auto fields go as 0, which the native side resolves for
        the path it actually runs: avx512bf16 asked for falls back to avx512 per call when x is
        not bf16-exact, and the avx512 bf16 kernel wants its own defaults (avx512bf16's item_kb
        192, rows 1 made it 0.5x STREAM instead of 0.7x on the 2-core EPYC). A t0 hint with an
        auto distance sends the asked path's distance."""
        item_kb, rows, down_rows, pf = (0 if v == -1 else v
                                        for v in (self.item_kb, self.rows, self.down_rows, self.prefetch))
        if pf == 0 and self.prefetch == -1 and self.prefetch_hint == "t0":
            pf = defaults[3]
        elif self.prefetch == 0:
            pf = -1
        if pf > 0:
            pf |= self.prefetch_hint == "t1"
        return (item_kb, rows, down_rows, pf, 1 if self.helps(num_threads) else -1, self.spread,
                QDOT_PATHS.index(self.qdot))


def tuning_from_env() -> KernelTuning:
    return KernelTuning.parse(env(TUNE_ENV))
