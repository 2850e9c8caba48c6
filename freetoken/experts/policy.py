"""The expert cache's eviction policy: which cache slots to reuse (LRUPolicy, pure over the
cache's last-used stamps: the runtime's host plans; the device plan kernel keeps the same rule).
The cache (cache.py) owns where things live; the split of misses is split.py's. The admission
and eviction kinds the replay study compared against it (over pair ids, LRU's replay twin among
them) are tools/cache_policies.py's; numbers behind the choice:
docs/MEASUREMENTS.md#expert-admission-and-eviction.
"""
import numpy as np

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
