"""How a decode layer step's cache misses are shared out. Of m missed experts, q are filled over
PCIe into the device cache and computed there, m - q run on the CPU kernel in place; b of those
m - q are also copied into the cache behind the step ("admitted"), so that later tokens hit them.

hybrid: the paper's q* = round(m * P / (P + C)) (halves up), P and C the fill and CPU-kernel
bandwidths measured while both paths run: both paths then end together. offload: q = m.
cpu: q = 0. Admissions are fixed: --fill-behind N (hybrid's default on cuda: 1 in steps of at
most 3 misses, runtime.py), gated off in steps of more misses that fill something, where the
link is busy with the step's own fills. Other rules lost on the H200 host and were removed
(docs/MEASUREMENTS.md#split-rule-q, #split-adaptation, #admission-window-model).

The bandwidths come from the engine (freetoken profile's stored measurements); this module reads
no profile.
"""
import math
from dataclasses import dataclass
from typing import Optional

from ..config import POLICIES

# Fill (P) and CPU-expert (C) bandwidths in GB/s, used until `freetoken profile` has measured
# this machine. cuda: a PCIe 4.0 x16 link (~25 GB/s) against a desktop CPU reading experts at
# ~50 GB/s while the copies run, so q* = m/3. cpu device tier: both paths read the same host
# memory, so P = C and q* = m/2 (the tier exists to exercise fills and CPU runs together).
DEFAULT_BANDWIDTHS = {"cuda": (25.0, 50.0), "cpu": (1.0, 1.0)}


@dataclass(frozen=True)
class MissBandwidths:
    """GB/s: P, C while both paths run (freetoken profile's concurrent pair); alone: each by
    itself (B_P of one slot, or of the zero-copy gather; B_H)."""
    P: float
    C: float
    P_alone: float
    C_alone: float


@dataclass(frozen=True)
class ExpertRates:
    """What the engine hands the expert runtime from the stored profile (freetoken/profile.py:
    expert_rates): the split's bandwidths (`measured` False: DEFAULT_BANDWIDTHS) and the prefill
    choice's whole-layer copy rate B_P and CPU arithmetic F (None where not measured). note: ""
    or what stands in for a missing measurement (a quantized bank on bf16's profile)."""
    miss: MissBandwidths
    measured: bool = False
    stream_gbps: Optional[float] = None
    cpu_gflops: Optional[float] = None
    source: str = ""
    note: str = ""

    def origin(self) -> str:
        """Where the split's P and C come from, for the engine's split line."""
        return ("profile" if self.measured else "defaults") + (f"; {self.note}" if self.note else "")


def default_rates(device_type: str) -> ExpertRates:
    """The rates used where nothing was measured (tests, the cpu device, no profile yet)."""
    P, C = DEFAULT_BANDWIDTHS["cuda" if device_type == "cuda" else "cpu"]
    return ExpertRates(MissBandwidths(P, C, P, C))


def qstar(m: int, P: float, C: float, policy: str, free_slots: int = None) -> int:
    """q: how many of m missed experts to fill into the device cache; the other m - q run on
    the CPU. hybrid: q* = round(m * P / (P + C)), rounding halves up (both paths then finish
    together); offload: m; cpu: 0. Clamped to [0, m] and to `free_slots` (the slots this step
    may take: capacity minus its own hits), so a cache of zero slots always gives q = 0."""
    if policy == "hybrid":
        q = math.floor(m * P / (P + C) + 0.5) if P + C > 0 else 0
    elif policy == "offload":
        q = m
    elif policy == "cpu":
        q = 0
    else:
        raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
    q = max(0, min(q, m))
    if free_slots is not None:
        q = min(q, max(0, free_slots))
    return q


class MissSplit:
    """(q, b) per miss count for one runtime: q by qstar, b = min(behind, m - q) admissions,
    none in steps of more than behind_max_misses misses that fill something. Stateless: the
    same routes give the same plans, eager or captured."""

    def __init__(self, policy: str, bw: MissBandwidths, behind: int = None,
                 behind_max_misses: int = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
        self.policy, self.bw = policy, bw
        self.behind = behind or 0  # None and 0: no admissions
        self.behind_max_misses = behind_max_misses

    def decide(self, m: int, capacity_left: int = None) -> tuple:
        """(q, b) for m misses. capacity_left: slots the step may take (capacity minus its own
        hits); q and then b are clamped to it."""
        q, b = self._decide(m)
        if capacity_left is not None:
            q = min(q, max(0, capacity_left))
            b = min(b, max(0, capacity_left - q))
        return q, b

    def _decide(self, m: int) -> tuple:
        q = qstar(m, self.bw.P, self.bw.C, self.policy)
        gated = self.behind_max_misses is not None and m > self.behind_max_misses and q > 0
        return q, 0 if gated else min(self.behind, m - q)

    def tables(self, K: int) -> tuple:
        """(q_of_m, b_of_m): decide(m) for m = 0..K before the capacity clamp (the native and
        device decode planners apply it)."""
        return tuple(zip(*(self._decide(m) for m in range(K + 1))))

    def describe(self) -> str:
        bw = self.bw
        text = (f"{self.policy}: q* = round(m P/(P+C)) with P={bw.P:g}/{bw.P_alone:g} GB/s, "
                f"C={bw.C:g}/{bw.C_alone:g} GB/s (concurrent/alone)")
        if self.policy != "hybrid":
            return text
        if not self.behind:
            return f"{text}; admissions off"
        return (f"{text}; admissions fixed {self.behind}"
                + (f" in steps of <= {self.behind_max_misses} misses"
                   if self.behind_max_misses is not None else ""))
