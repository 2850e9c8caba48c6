"""The expert cache's policies: which cache slots to reuse (LRUPolicy, pure over the cache's
last-used stamps: the runtime's plan), which (layer, expert) pairs deserve a slot at all
(BaseCachePolicy and its kinds: deterministic state machines over the access trace, replayed by
tools/replay_cache.py), and the runtime's LRFU (LRFUPolicy over the cache's books, the device
plan kernel's rule, with EngineLRFU its replay twin: the same helpers). The cache (cache.py) owns
where things live; the split of misses is split.py's. Numbers behind the choice:
docs/MEASUREMENTS.md#expert-admission-and-eviction.
"""
from collections import OrderedDict, deque

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


# ---- admission and eviction over pair ids (pair = layer * E + expert) ------------------------

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

    def __init__(self, capacity: int, half_life: float = 4.0):
        super().__init__(capacity)
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

    def __init__(self, capacity: int, half_lives=(0.25, 2.0, 16.0, 128.0), memory: float = 0.9999):
        super().__init__(capacity, half_lives[0])
        self.shadows = [LRFU(capacity, h) for h in half_lives]
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


# ---- the runtime's LRFU: integer decayed counts, the same on the host and the device ---------
#
# A pair's count is fixed point (LRFU_ONE = an access) with the epoch it was last brought up to;
# epochs are the accesses so far (every distinct expert of a layer step is one) // H, with
# H = round(half_life x capacity); a count halves (shifts right) once per epoch passed. Integers,
# so the host planner (numpy) and the device plan kernel (Triton) rank alike, bit for bit. All
# of a layer step's accesses take the epoch at the step's start. Ties between residents go to
# the least recently used (the cache's stamps), empty slots (count -1) first.

LRFU_ONE = 1 << 16
# half-life in capacity x accesses: fixed on both paths (the replay's shadows are not run; the
# choice: docs/MEASUREMENTS.md#expert-admission-and-eviction)
LRFU_HALF_LIFE = 2.0


def lrfu_half(capacity: int, half_life: float = LRFU_HALF_LIFE) -> int:
    """H: accesses per epoch (a count halves once per epoch)."""
    return max(1, round(half_life * capacity))


def lrfu_decayed(count, epoch, now):
    """Counts (int64 arrays) brought from their epochs to epoch `now`."""
    return count >> np.minimum(now - epoch, 63)


def lrfu_victim_order(keys: np.ndarray, stamps: np.ndarray, n: int) -> np.ndarray:
    """Indices of the n candidates to take first: lowest decayed count, then least recent."""
    return np.lexsort((stamps, keys))[:n]


def lrfu_num_admitted(miss_counts, victim_keys) -> int:
    """How many of the misses (decayed counts, this access included, best first) take a slot:
    the i-th beats the i-th victim's count (-1: a free slot), up to the first that does not
    (miss counts fall and victim counts rise, so none after it would)."""
    k = 0
    for c, v in zip(miss_counts, victim_keys):
        if c <= v:
            break
        k += 1
    return k


class LRFUPolicy:
    """The runtime's admission and eviction by decayed counts (plan.make_plan with this policy;
    the device plan kernel's LRFU branch). Reads the cache's books (`freq`, `freq_epoch`,
    `accesses`, `stamps`, `own`); never mutates: apply_plan commits the plan's counts.

    Example (half-life 1 x capacity 2: H = 2 accesses; both slots full with counts 3 and 1 at
    epoch 0, 2 accesses so far): a step missing expert x (count 0) is at epoch 1: x's count
    0 + 1 = 1, the victims' 1.5 and 0.5; x beats the 0.5 pair and takes its slot. Had the
    step come at epoch 0, x's 1 would not beat the victim's 1: x runs on the CPU."""

    def __init__(self, half_life: float = LRFU_HALF_LIFE):
        self.half_life = half_life

    def now(self, cache) -> int:
        return cache.accesses // lrfu_half(cache.capacity, self.half_life)

    def bump(self, cache, layer: int, experts: list) -> np.ndarray:
        """The experts' counts after this step's access (int64 [U])."""
        now = self.now(cache)
        return lrfu_decayed(cache.freq[layer, experts], cache.freq_epoch[layer, experts], now) \
            + LRFU_ONE

    def victims(self, cache, n: int, protected: list, miss_counts: list) -> list:
        """Slots for the first of n misses (decayed counts best first) that are worth one: a
        prefix of the n lowest-count unprotected slots, the i-th slot for the i-th miss."""
        if n <= 0:
            return []
        own = cache.own
        keys = np.full(cache.capacity, -1, dtype=np.int64)  # empty slots: -1
        full = np.flatnonzero(own[:, 0] >= 0)
        keys[full] = lrfu_decayed(cache.freq[own[full, 0], own[full, 1]],
                                  cache.freq_epoch[own[full, 0], own[full, 1]], self.now(cache))
        free = np.ones(cache.capacity, bool)
        free[protected] = False
        cand = np.flatnonzero(free)
        if n > len(cand):
            raise ValueError(f"cannot take {n} slots: {cache.capacity} slots, "
                             f"{len(protected)} protected")
        take = cand[lrfu_victim_order(keys[cand], cache.stamps[cand], n)]
        k = lrfu_num_admitted(miss_counts[:n], keys[take].tolist())
        return take[:k].tolist()


class EngineLRFU(BaseCachePolicy):
    """LRFUPolicy's replay twin over pair ids: the same counts, epochs, tie-breaks (its own LRU
    stamps, touched as apply_plan does: hits ascending, then fills in fill order) and admission
    test, one layer step at a time; misses are offered highest count first."""

    def __init__(self, capacity: int, half_life: float = LRFU_HALF_LIFE):
        super().__init__(capacity)
        self.H = lrfu_half(capacity, half_life)
        self.t, self.clock, self.now = 0, 0, 0
        self.cnt = np.zeros(64, np.int64)     # [P] fixed-point counts
        self.ep = np.zeros(64, np.int64)      # [P] the epoch each was brought up to
        self.stamp = np.zeros(64, np.int64)   # [P] last use of a resident pair
        self.is_res = np.zeros(64, bool)      # [P]

    def _grow(self, pair: int) -> None:
        n = max(2 * len(self.cnt), pair + 1)
        for name in ("cnt", "ep", "stamp", "is_res"):
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.zeros(n - len(a), a.dtype)]))

    def _touch(self, pairs: list) -> None:
        self.stamp[pairs] = np.arange(self.clock + 1, self.clock + 1 + len(pairs))
        self.clock += len(pairs)

    def resident(self) -> list:
        return np.flatnonzero(self.is_res).tolist()

    def access(self, pairs: list) -> list:
        if pairs and max(pairs) >= len(self.cnt):
            self._grow(max(pairs))
        self.now = now = self.t // self.H  # the step's epoch (its victims' too)
        self.cnt[pairs] = lrfu_decayed(self.cnt[pairs], self.ep[pairs], now) + LRFU_ONE
        self.ep[pairs] = now
        self.t += len(pairs)
        self._touch(sorted(p for p in pairs if self.is_res[p]))
        return [p for p in pairs if not self.is_res[p]]

    def _victims(self, n: int, protected: list) -> tuple:
        """(the n pairs to take first, their keys); -1 stands for a free slot."""
        free = self.capacity - int(self.is_res.sum())
        cand = np.flatnonzero(self.is_res)
        cand = cand[~np.isin(cand, protected)]
        keys = lrfu_decayed(self.cnt[cand], self.ep[cand], self.now)
        order = lrfu_victim_order(keys, self.stamp[cand], max(0, n - free))
        empty = [-1] * min(free, n)
        return empty + cand[order].tolist(), empty + keys[order].tolist()

    def worth(self, misses: list, protected: list) -> list:
        misses = sorted(misses, key=lambda p: (-int(self.cnt[p]), p))
        misses = misses[:max(0, self.capacity - len(protected))]
        _, keys = self._victims(len(misses), protected)
        return misses[:lrfu_num_admitted([int(self.cnt[p]) for p in misses], keys)]

    def fill(self, pairs: list, protected: list) -> list:
        victims, _ = self._victims(len(pairs), protected)
        if len(victims) < len(pairs):
            raise ValueError(f"cannot fill {len(pairs)} pairs: {self.capacity} slots, "
                             f"{len(protected)} protected")
        gone = [v for v in victims if v >= 0]
        self.is_res[gone] = False
        self.is_res[pairs] = True
        self._touch(list(pairs))
        return list(zip(pairs, victims))


POLICY_KINDS = {"lru": LRU, "tinylfu": TinyLFU, "s3fifo": S3FIFO, "lrfu": LRFU,
                "adaptive_lrfu": AdaptiveLRFU, "engine_lrfu": EngineLRFU}


def serve(policy: BaseCachePolicy, pairs: list) -> int:
    """One layer step through `policy`, every miss worth a slot filled; returns the misses."""
    misses = policy.access(pairs)
    protected = [p for p in pairs if p not in misses]
    policy.fill(policy.worth(misses, protected), protected)
    return len(misses)
