"""Policies of the expert tier, pure functions of what they are shown: which cache slots to
evict (LRU over the last-used stamps) and how many decode misses to fill over PCIe (q) versus
run on the CPU (m - q). The cache (cache.py) owns where things live; nothing here mutates it.
"""
import math

import numpy as np

from ..config import POLICIES

# Fill (P) and CPU-expert (C) bandwidths in GB/s, used until `freetoken profile` has measured
# this machine. cuda: a PCIe 4.0 x16 link (~25 GB/s) against a desktop CPU reading experts at
# ~50 GB/s while the copies run, so q* = m/3. cpu device tier: both paths read the same host
# memory, so P = C and q* = m/2 (the tier exists to exercise fills and CPU runs together).
DEFAULT_BANDWIDTHS = {"cuda": (25.0, 50.0), "cpu": (1.0, 1.0)}


def split(m: int, P: float, C: float, policy: str, free_slots: int = None) -> int:
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


def miss_bandwidth_set(device_type: str, slot_bytes: int = None, fills: str = "copy") -> tuple:
    """(split.MissBandwidths, measured): P and C concurrent and each alone, from the stored
    profile (measured True), else DEFAULT_BANDWIDTHS for both (measured False)."""
    from .split import MissBandwidths
    try:
        from ..profile import get_bandwidths
        got = get_bandwidths(device_type, slot_bytes, fills=fills)
    except (ImportError, AttributeError, TypeError, OSError, ValueError):
        got = None
    if isinstance(got, dict) and got.get("P", 0) > 0 and got.get("C", 0) > 0:
        P, C = float(got["P"]), float(got["C"])
        return MissBandwidths(P, C, float(got.get("P_alone") or P), float(got.get("C_alone") or C)), True
    P, C = DEFAULT_BANDWIDTHS["cuda" if device_type == "cuda" else "cpu"]
    return MissBandwidths(P, C, P, C), False


_NEVER = np.iinfo(np.int64).max  # a stamp no slot has: protected or taken


class BaseEvictionPolicy:
    """Chooses which cache slots to reuse. Reads the cache's last-used stamps; never mutates."""

    def victims(self, stamps: np.ndarray, n: int, protected: list) -> list:
        """n distinct slot ids, none in `protected`, in the order they should be taken.
        stamps: int64 [C], unique, larger = used more recently."""
        raise NotImplementedError


class LRUPolicy(BaseEvictionPolicy):
    """Least recently used first. Stamps are unique (cache.py), so the choice is deterministic;
    empty slots carry stamps below every real one and are taken first, lowest slot first."""

    def victims(self, stamps: np.ndarray, n: int, protected: list) -> list:
        if n == 0:
            return []
        if n > len(stamps) - len(protected):
            raise ValueError(f"cannot take {n} slots: {len(stamps)} slots, "
                             f"{len(protected)} protected")
        if protected or n <= 8:
            stamps = stamps.copy()
            stamps[protected] = _NEVER
        if n <= 8:  # a decode step's few victims: argmin is ~10x cheaper than argpartition
            out = []
            for _ in range(n):
                s = int(stamps.argmin())
                out.append(s)
                stamps[s] = _NEVER
            return out
        if n < len(stamps):
            head = np.argpartition(stamps, n - 1)[:n]
        else:
            head = np.arange(n)
        return head[np.argsort(stamps[head])].tolist()
