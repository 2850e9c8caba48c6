"""MissSplit: how a decode layer step's cache misses are shared out, from a small time model of
the two paths. Of m missed experts (s bytes each), q are filled over PCIe into the device cache
and computed there, m - q run on the CPU kernel in place; b of those m - q are also copied into
the cache behind the step ("admitted"), so that later tokens hit them.

The layer's expert phase takes

    phase(m, q) = max(backlog + q * s / P_q,  (m - q) * s / C_q)

P_q, C_q: the fill and CPU-kernel bandwidths measured while both paths run when both do (the
paper's rule q* = m * P / (P + C) is this model's continuous minimum at backlog 0), alone when
only one does; backlog: PCIe time of earlier admission copies still queued ahead of this step's
fills (the CPU reads at the concurrent rate while they run). rule "qstar" (the default) takes
the paper's q* = round(m * P / (P + C)) with halves up; rule "least_time" the integer q of least
phase (ties: the larger q, which caches more); rule "ceil" q = ceil(m * P / (P + C)): every step
with a miss fills at least one, at most one fill more than q*, so a lone miss is cached (as
offload-only does) rather than run on the CPU and missed again. Neither beat q* on the H200
host: a fill is worth more than its share of this step, it is the cache's admission too
(docs/MEASUREMENTS.md#split-rule-q).

Fixed admissions (behind = N, optionally only in steps of at most behind_max_misses misses
or that fill nothing)
are hybrid's default on cuda (runtime.py: 1 in steps of <= 3 misses): the captured step copies
them by a background gather that yields the link to the fills (device_step.py). The window
model below decides admissions from this model's clock instead; it stays off.

Admission uses the PCIe link while it and the CPU would both idle: the admission copies are
queued when the step's CPU job has ended, so they run during the next layer's non-expert part
(attention, router, plan: `window`, about 200-300 µs per layer) and take no host bandwidth from
this step's CPU job. b is the largest count whose copies end within the window, so they do not
delay the next layer's fills or its experts (which wait for them). Off by default (window 0):
with zero-copy fills it gained nothing with locality and cost 13% in uniform routing
(docs/MEASUREMENTS.md#admission-window-model).

State: the backlog, advanced by this model's own clock after every step (advance), never by the
wall clock; and, when the captured decode step reports them (observe), the bandwidths both paths
really reached in this workload while running at once, folded into P and C (the profile's
synthetic P and C moved between grants of the H200 host, and decode jobs meet overheads its
steady state does not). Without observations (eager decode, the cpu device, the default) the
same routes give the same plans: eager and graph decode are compared plan for plan in the GPU
tests. Off by default (adapt_default).
"""
import math
from dataclasses import dataclass, replace

from ..config import POLICIES, env
from .policy import split as qstar_split

RULES = ("qstar", "least_time", "ceil")


@dataclass(frozen=True)
class MissBandwidths:
    """GB/s: P, C while both paths run (freetoken profile's concurrent pair); alone: each by
    itself (B_P of one slot, or of the zero-copy gather; B_H)."""
    P: float
    C: float
    P_alone: float
    C_alone: float


class MissSplit:
    def __init__(self, policy: str, bw: MissBandwidths, slot_bytes: int, window_us: float = 0.0,
                 behind: int = None, admit: bool = True, quantum_us: float = 10.0,
                 rule: str = "qstar", behind_idle: bool = False, behind_max_misses: int = None):
        """behind: None = admissions as the model allows them (when `admit`), N = exactly
        min(N, m - q) every step (--fill-behind N: a fixed count, no budget), or only in steps
        that fill nothing (behind_idle) / of at most behind_max_misses misses; admit False (the
        cpu device, whose fills are synchronous copies) = none unless `behind` asks; window 0
        = none either. rule: "qstar" or "least_time" (hybrid's q, module docstring)."""
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
        if rule not in RULES:
            raise ValueError(f"unknown split rule {rule!r}; expected one of {RULES}")
        self.rule = rule
        self.policy, self.bw, self.window = policy, bw, float(window_us)
        self.behind, self.admit, self.quantum = behind, admit, quantum_us
        self.behind_idle = behind_idle  # fixed admissions only in steps that fill nothing
        self.behind_max_misses = behind_max_misses  # ... only in steps with at most this many misses
        self.slot_bytes = slot_bytes
        self.backlog = 0.0  # µs of admission copies queued ahead of the next step's fills
        self._decided = {}  # (m, backlog bucket) -> (q, b)
        self._tables = {}  # (K, backlog bucket) -> (q_of_m, b_of_m)
        self._use(bw)
        self.profiled = bw  # the bandwidths it started from
        self.observed = None  # (P, C) GB/s: running means of what observe() was shown
        self.observations = 0

    def reset(self) -> None:
        self.backlog = 0.0

    def _use(self, bw: MissBandwidths) -> None:
        """Split by `bw` from now on: µs per slot by path and company; earlier decisions go."""
        self.bw = bw
        us = self.slot_bytes / 1e3
        self.fill_both, self.fill_alone = us / bw.P, us / bw.P_alone
        self.cpu_both, self.cpu_alone = us / bw.C, us / bw.C_alone
        self._decided.clear()
        self._tables.clear()

    # ---- the model ------------------------------------------------------------------------

    def phase(self, m: int, q: int, backlog: float) -> float:
        """µs of the expert phase for m misses with q filled, after `backlog` µs of copies."""
        if m == 0:
            return 0.0
        if q == 0:  # CPU only, at the concurrent rate while the backlog drains
            both = min(m * self.cpu_both, backlog)
            return both + (m * self.cpu_both - both) / self.cpu_both * self.cpu_alone
        if q == m:
            return backlog + m * self.fill_alone
        gpu = backlog + q * self.fill_both
        cpu = (m - q) * self.cpu_both
        if cpu > gpu:  # the CPU goes on alone once the fills end
            cpu = gpu + (cpu - gpu) / self.cpu_both * self.cpu_alone
        return max(gpu, cpu)

    def _fills_end(self, m: int, q: int, backlog: float) -> float:
        """µs until the step's q fills are in (after the backlog)."""
        return backlog + q * (self.fill_both if q < m else self.fill_alone)

    def decide(self, m: int, capacity_left: int = None) -> tuple:
        """(q, b) for m misses at the current backlog. capacity_left: slots the step may take
        (capacity minus its own hits); q and then b are clamped to it."""
        q, b = self._decide(m)
        if capacity_left is not None:
            q = min(q, max(0, capacity_left))
            b = min(b, max(0, capacity_left - q))
        return q, b

    def _decide(self, m: int) -> tuple:
        key = (m, round(self.backlog / self.quantum))
        d = self._decided.get(key)
        if d is None:
            d = self._decided[key] = self._solve(m, key[1] * self.quantum)
        return d

    def _solve(self, m, backlog):
        if self.policy == "offload":
            q = m
        elif self.policy == "cpu":
            q = 0
        elif self.rule == "qstar":
            q = qstar_split(m, self.bw.P, self.bw.C, "hybrid")
        elif self.rule == "ceil":
            P, C = self.bw.P, self.bw.C
            q = min(m, math.ceil(m * P / (P + C) - 1e-9)) if P + C > 0 else 0
        else:  # least phase, ties to the larger q
            q = min(range(m + 1), key=lambda x: (round(self.phase(m, x, backlog), 6), -x))
        if self.behind is not None:
            # the miss cap keeps admissions out of steps whose own fills keep the link busy; a
            # step that fills nothing leaves it idle (and without this a split that fills
            # nothing at m > cap, e.g. least_time where C_alone >> P, never warms a cold cache:
            # measured on the H200 host, hit rate 0% and CPU-only speed)
            gated = ((self.behind_idle and q > 0) or
                     (self.behind_max_misses is not None and m > self.behind_max_misses and q > 0))
            b = 0 if gated else min(self.behind, m - q)
        elif not self.admit or self.policy != "hybrid":
            b = 0
        else:  # as many as end within the window after the phase (and after earlier copies)
            room = self.window - max(0.0, self._fills_end(m, q, backlog) - self.phase(m, q, backlog))
            b = max(0, min(m - q, int(room / self.fill_alone + 1e-9)))
        return q, b

    def tables(self, K: int) -> tuple:
        """(q_of_m, b_of_m): decide(m) for m = 0..K at the current backlog, before the capacity
        clamp (the native decode planner applies it)."""
        key = (K, round(self.backlog / self.quantum))
        t = self._tables.get(key)
        if t is None:
            t = self._tables[key] = tuple(zip(*(self._decide(m) for m in range(K + 1))))
        return t

    def observe(self, gpu_bytes: float, gpu_us: float, cpu_bytes: float, cpu_us: float,
                weight: float = 0.1) -> None:
        """A step in which both paths ran: the GPU path moved gpu_bytes of fills in gpu_us (its
        fills and experts), the CPU job read cpu_bytes in cpu_us. Folds the rates into running
        means (weight per step) and splits by them from then on; the decisions are refreshed
        when P / (P + C) moves by 0.01 or more."""
        if min(gpu_bytes, gpu_us, cpu_bytes, cpu_us) <= 0:
            return
        p, c = gpu_bytes / gpu_us / 1e3, cpu_bytes / cpu_us / 1e3  # GB/s
        if self.observed is None:
            self.observed = (p, c)
        else:
            P0, C0 = self.observed
            self.observed = (P0 + weight * (p - P0), C0 + weight * (c - C0))
        self.observations += 1
        P, C = self.observed
        if abs(P / (P + C) - self.bw.P / (self.bw.P + self.bw.C)) >= 0.01:
            self._use(replace(self.bw, P=P, C=C))

    def advance(self, m: int, q: int, b: int) -> None:
        """After a step that filled q and admitted b of m misses: the backlog the next step
        meets, once this phase and the next non-expert window have drained the link."""
        backlog = self.backlog
        if not b and not backlog:  # the fills end within the phase: the link stays clear
            return
        ph = self.phase(m, q, backlog)
        end = max(ph, self._fills_end(m, q, backlog)) + b * self.fill_alone
        self.backlog = max(0.0, end - ph - self.window)

    def describe(self) -> str:
        bw = self.profiled
        rule = {"qstar": "q* = round(m P/(P+C))", "ceil": "q = ceil(m P/(P+C))"}.get(
            self.rule, "least-time split")
        text = (f"{self.policy}: {rule} with P={bw.P:g}/{bw.P_alone:g} GB/s, "
                f"C={bw.C:g}/{bw.C_alone:g} GB/s (concurrent/alone)")
        if self.policy != "hybrid":
            return text
        if self.behind is not None:
            if not self.behind:
                return f"{text}; admissions off"
            return (f"{text}; admissions fixed {self.behind}"
                    + (" in steps that fill nothing" if self.behind_idle else "")
                    + (f" in steps of <= {self.behind_max_misses} misses"
                       if self.behind_max_misses is not None else ""))
        if self.admit and self.window:
            return f"{text}; admissions in a {self.window:g} µs window"
        return f"{text}; admissions off"

    def observed_info(self) -> str:
        """What observe() has made of the workload, for the benches."""
        if self.observed is None:
            return "no observations"
        P, C = self.observed
        return (f"observed P={P:.1f} C={C:.1f} GB/s over {self.observations} steps "
                f"(q*/m {P / (P + C):.2f}; profile {self.profiled.P / (self.profiled.P + self.profiled.C):.2f})")


def adapt_default() -> bool:
    """Whether captured decode steps feed their path times to the split (observe): only with
    FREETOKEN_SPLIT_ADAPT=1: it lost (the observed C carries each job's overheads, so it moves
    q up; docs/MEASUREMENTS.md#split-adaptation)."""
    return env("FREETOKEN_SPLIT_ADAPT") == "1"
