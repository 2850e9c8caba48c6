"""The expert cache's admission and eviction kinds over pair ids (pair = layer * E + expert),
replayed by tools/replay_cache.py and tools/replay_policies.py (issue 38's study): deterministic
state machines over the access trace, fed one layer step at a time as the runtime plans one.
  LRU        admits every miss, evicts the least recently used pair: the runtime's cache
             (freetoken/experts/policy.py LRUPolicy over slots) replayed over pairs
  TinyLFU    LRU behind a frequency filter
  LRFU       decayed access counts, a fixed half-life
  AdaptiveLRFU  LRFU whose half-life follows shadow caches' hits
  AdaptiveLRFUEvict  its eviction order with LRU's admission (every miss filled)
  S3FIFO     small/main/ghost FIFO queues
No runtime code uses them: the runtime runs LRU (the measurements and the LRFU that was once
built into it: docs/MEASUREMENTS.md#expert-admission-and-eviction).
"""
from collections import OrderedDict, deque

import numpy as np


class BaseCachePolicy:
    """Which pairs a cache of `capacity` slots holds, fed one layer step at a time. The policy
    keeps its own set of residents, changed only by fill(); same calls, same answers.

    One layer step (serve() below; the runtime puts its q* split between worth and fill):
      misses = p.access(pairs)            record the step's distinct pairs; returns the misses
      take = p.worth(misses, protected)   the misses worth a slot, best first (changes nothing)
      p.fill(take[:q], protected)         admit them; returns (pair, victim) with victim -1 for
                                          a free slot; `protected` (the step's hits) stay
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity {capacity} must be at least 1 slot")
        self.capacity = capacity

    def resident(self) -> list:
        """The resident pairs (any order)."""
        raise NotImplementedError

    def access(self, pairs: list) -> list:
        raise NotImplementedError

    def worth(self, misses: list, protected: list) -> list:
        return list(misses[:max(0, self.capacity - len(protected))])

    def fill(self, pairs: list, protected: list) -> list:
        raise NotImplementedError


class LRU(BaseCachePolicy):
    """Admits every miss; evicts the least recently used pair (the cache's LRUPolicy over pairs).
    A step's hits become most recent in the order given, then its fills."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.order = OrderedDict()  # pair -> None, least recent first

    def resident(self) -> list:
        return list(self.order)

    def access(self, pairs: list) -> list:
        misses = []
        for p in pairs:
            if p in self.order:
                self.order.move_to_end(p)
            else:
                misses.append(p)
        return misses

    def _victims(self, n: int, protected: list) -> list:
        out = []
        for p in self.order:
            if len(out) == n:
                break
            if p not in protected:
                out.append(p)
        return out

    def fill(self, pairs: list, protected: list) -> list:
        free = self.capacity - len(self.order)
        gone = self._victims(max(0, len(pairs) - free), protected)
        victims = [-1] * min(free, len(pairs)) + gone
        if len(victims) < len(pairs):
            raise ValueError(f"cannot fill {len(pairs)} pairs: {self.capacity} slots, "
                             f"{len(protected)} protected")
        for v in gone:
            del self.order[v]
        for p in pairs:
            self.order[p] = None
        return list(zip(pairs, victims))


class TinyLFU(LRU):
    """LRU eviction behind a frequency filter (Einziger et al., TinyLFU): a miss takes a slot only
    if its access count beats that of the pair it would evict (a free slot: always). Counts are
    exact per pair (the pairs are few, so no count-min sketch) and halve every `window` x capacity
    accesses, so old popularity fades. Misses are offered most frequent first; the first refusal
    ends the step's admissions.

    Example (capacity 1, holding a with count 3, no halving meanwhile): b missed with count 1 is
    refused, and so is b at count 3 (ties keep the resident); b's miss at count 4 evicts a.
    """

    def __init__(self, capacity: int, window: float = 2.0):
        super().__init__(capacity)
        self.sample = max(1, round(window * capacity))
        self.counts = {}  # pair -> aged access count
        self.seen = 0     # accesses since the last halving

    def access(self, pairs: list) -> list:
        for p in pairs:
            self.counts[p] = self.counts.get(p, 0) + 1
        self.seen += len(pairs)
        if self.seen >= self.sample:
            self.seen = 0
            self.counts = {p: c // 2 for p, c in self.counts.items() if c > 1}
        return super().access(pairs)

    def worth(self, misses: list, protected: list) -> list:
        misses = sorted(misses, key=lambda p: (-self.counts.get(p, 0), p))
        room = max(0, self.capacity - len(protected))
        free = self.capacity - len(self.order)
        victims = self._victims(max(0, min(len(misses), room) - free), protected)
        out = []
        for p in misses[:room]:
            if len(out) >= free:
                v = victims[len(out) - free]
                if self.counts.get(p, 0) <= self.counts.get(v, 0):
                    break
            out.append(p)
        return out


class LRFU(BaseCachePolicy):
    """Evicts the pair with the lowest decayed access count (Lee et al., LRFU): each access adds
    1, and counts halve every `half_life` x capacity accesses, so a short half-life ranks by
    recency (LRU) and a long one by frequency (LFU). A miss takes a slot only if its count,
    this access included, beats the victim's (a free slot: always); misses are offered highest
    count first and the first refusal ends the step's admissions.

    Counts are kept as time-free keys log2(count) + t / half_life (same order as the decayed
    counts at any one time), in an array indexed by pair that grows as pairs appear.
    Example (capacity 1, half-life 1 access): a accessed at t=0 and 1 has key log2(1.5) + 1;
    b missed at t=2 gets key 2 > 1.58, so b replaces a.
    """

    def __init__(self, capacity: int, half_life: float = 4.0, admit_test: bool = True):
        """admit_test False: every miss is filled (as LRU admits), only the victims follow the
        counts."""
        super().__init__(capacity)
        self.admit_test = admit_test
        self.half = half_life * capacity
        self.t = 0
        self.key = np.full(64, -np.inf)        # [P] log2(count) + last / half
        self.is_res = np.zeros(64, bool)       # [P]
        self.num_res = 0

    def _grow(self, pair: int) -> None:
        n = max(2 * len(self.key), pair + 1)
        self.key = np.concatenate([self.key, np.full(n - len(self.key), -np.inf)])
        self.is_res = np.concatenate([self.is_res, np.zeros(n - len(self.is_res), bool)])

    def resident(self) -> list:
        return np.flatnonzero(self.is_res).tolist()

    def access(self, pairs: list) -> list:
        misses = []
        for p in pairs:
            if p >= len(self.key):
                self._grow(p)
            now = self.t / self.half
            k = self.key[p]  # count at now = 2 ** (k - now); plus this access
            self.key[p] = now + (np.log2(1.0 + 2.0 ** (k - now)) if k > -np.inf else 0.0)
            self.t += 1
            if not self.is_res[p]:
                misses.append(p)
        return misses

    def _victims(self, n: int, protected: list, key: np.ndarray) -> list:
        if n <= 0:
            return []
        masked = np.where(self.is_res, key, np.inf)
        masked[[p for p in protected if p < len(masked)]] = np.inf
        order = np.argsort(masked, kind="stable")[:n]
        return [int(p) for p in order if masked[p] < np.inf]

    def _admit(self, misses: list, protected: list, key: np.ndarray) -> list:
        misses = sorted(misses, key=lambda p: (-key[p], p))[:max(0, self.capacity - len(protected))]
        if not self.admit_test:
            return misses
        free = self.capacity - self.num_res
        victims = self._victims(len(misses) - free, protected, key)
        out = []
        for p in misses:
            if len(out) >= free:
                j = len(out) - free
                if j >= len(victims) or key[p] <= key[victims[j]]:
                    break
            out.append(p)
        return out

    def worth(self, misses: list, protected: list) -> list:
        return self._admit(misses, protected, self.key)

    def _fill(self, pairs: list, protected: list, key: np.ndarray) -> list:
        free = self.capacity - self.num_res
        gone = self._victims(max(0, len(pairs) - free), protected, key)
        victims = [-1] * min(free, len(pairs)) + gone
        if len(victims) < len(pairs):
            raise ValueError(f"cannot fill {len(pairs)} pairs: {self.capacity} slots, "
                             f"{len(protected)} protected")
        self.is_res[gone] = False
        self.is_res[pairs] = True
        self.num_res += len(pairs) - len(gone)
        return list(zip(pairs, victims))

    def fill(self, pairs: list, protected: list) -> list:
        return self._fill(pairs, protected, self.key)


class AdaptiveLRFU(LRFU):
    """LRFU whose half-life follows the workload: shadow LRFU caches (pair ids only), one per
    candidate half-life, replay every step; decisions use the counts of the shadow with the most
    hits, its hits decayed by `memory` per access. Recency-driven routing picks a short half-life,
    popularity-driven a long one."""

    def __init__(self, capacity: int, half_lives=(0.25, 2.0, 16.0, 128.0), memory: float = 0.9999,
                 admit_test: bool = True):
        super().__init__(capacity, half_lives[0], admit_test)
        self.shadows = [LRFU(capacity, h, admit_test) for h in half_lives]
        self.score = np.zeros(len(half_lives))
        self.memory = memory
        self.lead = 0

    def access(self, pairs: list) -> list:
        n = len(pairs)
        for i, sh in enumerate(self.shadows):
            self.score[i] = self.score[i] * self.memory ** n + n - serve(sh, pairs)
        self.lead = int(self.score.argmax())
        self.key = self.shadows[self.lead].key  # every shadow saw the same pairs: same length
        if len(self.is_res) < len(self.key):
            self.is_res = np.concatenate([self.is_res, np.zeros(len(self.key) - len(self.is_res), bool)])
        return [p for p in pairs if not self.is_res[p]]


class S3FIFO(BaseCachePolicy):
    """Three FIFO queues (Yang et al., SOSP 2023): misses enter a small queue of `small` x
    capacity slots unless recently evicted from it (a ghost: they enter the main queue). A pair
    leaving the small queue moves to main if hit at least `promote` times there, else becomes a
    ghost; main reinserts a pair with hits left (hit counts capped at 3, one spent per pass).
    Evicts from small while it holds at least its share, else from main. Admits every miss."""

    def __init__(self, capacity: int, small: float = 0.05, promote: int = 1):
        super().__init__(capacity)
        self.small_slots = max(1, round(small * capacity))
        self.promote = promote
        self.small, self.main = deque(), deque()  # oldest first
        self.hits = {}                            # resident pair -> hits, capped at 3
        self.ghost = OrderedDict()                # pair -> None, oldest first

    def resident(self) -> list:
        return list(self.small) + list(self.main)

    def access(self, pairs: list) -> list:
        misses = []
        for p in pairs:
            if p in self.hits:
                self.hits[p] = min(self.hits[p] + 1, 3)
            else:
                misses.append(p)
        return misses

    @staticmethod
    def _pop_oldest(q: deque, protected: list):
        """The oldest unprotected pair of q, removed (None if all are protected)."""
        for i, p in enumerate(q):
            if p not in protected:
                del q[i]
                return p
        return None

    def _evict(self, protected: list) -> int:
        while True:
            from_small = len(self.small) >= self.small_slots or not self.main
            p = self._pop_oldest(self.small if from_small else self.main, protected)
            if p is None:  # that queue holds only protected pairs: the other one
                from_small = not from_small
                p = self._pop_oldest(self.small if from_small else self.main, protected)
            if from_small and self.hits[p] >= self.promote:
                self.hits[p] = 0
                self.main.append(p)
            elif from_small:
                del self.hits[p]
                self.ghost[p] = None
                if len(self.ghost) > self.capacity - self.small_slots:
                    self.ghost.popitem(last=False)
                return p
            elif self.hits[p] > 0:
                self.hits[p] -= 1
                self.main.append(p)
            else:
                del self.hits[p]
                return p

    def fill(self, pairs: list, protected: list) -> list:
        if len(pairs) > self.capacity - len(protected):
            raise ValueError(f"cannot fill {len(pairs)} pairs: {self.capacity} slots, "
                             f"{len(protected)} protected")
        out, kept = [], list(protected)
        for p in pairs:
            was_ghost = self.ghost.pop(p, False) is None  # looked up before evicting shifts it
            victim = -1 if len(self.hits) < self.capacity else self._evict(kept)
            self.hits[p] = 0
            (self.main if was_ghost else self.small).append(p)
            kept.append(p)  # a step's fills stay for the step, as its hits do
            out.append((p, victim))
        return out


class AdaptiveLRFUEvict(AdaptiveLRFU):
    """Adaptive LRFU's victims with LRU's admission: every miss is filled, the evicted pair is
    the one with the lowest count at the leading half-life. A fill refused costs a CPU run in
    decode, and the H200 measured refusals costing more than they saved (docs/MEASUREMENTS.md
    #expert-admission-and-eviction); this keeps the eviction order alone."""

    def __init__(self, capacity: int, half_lives=(0.25, 2.0, 16.0, 128.0), memory: float = 0.9999):
        super().__init__(capacity, half_lives, memory, admit_test=False)


POLICY_KINDS = {"lru": LRU, "tinylfu": TinyLFU, "s3fifo": S3FIFO, "lrfu": LRFU,
                "adaptive_lrfu": AdaptiveLRFU, "adaptive_lrfu_evict": AdaptiveLRFUEvict}


def serve(policy: BaseCachePolicy, pairs: list) -> int:
    """One layer step through `policy`, every miss worth a slot filled; returns the misses."""
    misses = policy.access(pairs)
    protected = [p for p in pairs if p not in misses]
    policy.fill(policy.worth(misses, protected), protected)
    return len(misses)
