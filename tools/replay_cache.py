"""Replay routing traces against expert-cache policies and print miss rate vs cache capacity.

Capacity counts (layer, expert) pairs, from 5% to 100% of all of them. Policies:
  global_lru     one LRU over all layers (FreeToken's cache)
  tinylfu        LRU behind a frequency filter        } tools/cache_policies.py's classes,
  s3fifo         small/main/ghost FIFO queues         } fed one layer step at a time, as the
  adaptive_lrfu  decayed counts, half-life adapted    } runtime is
  adaptive_lrfu_evict  its victims, every miss filled }
  layer_lru      one LRU per layer, the capacity split equally (remainder to the first layers)
  static         the most frequent pairs of the first half, resident for good
  layer_offload  llama.cpp style: floor(capacity / E) whole layers resident (the last ones,
                 as llama.cpp's -ngl offloads), every other layer always misses
  belady         offline optimum (evict the furthest next use; a miss may bypass the cache)
Every policy is scored on the second half of each trace (by forward steps): static learns on the
first half, the LRUs and those classes are warmed by it (the classes take each layer step
whole: its hits stay while its misses fill; layer_lru takes one access at a time); belady may
pick its initial contents freely, which makes it a lower bound for all the others. An access is one (step, layer, expert): the experts a step's
tokens route to in a layer, each once. Decode steps only unless --include-prefill.

    python tools/replay_cache.py run1.npz run2.npz [--include-prefill] [--png out.png]
    python tools/replay_cache.py --synthetic locality --tokens 2000 --layers 8 --experts 64 --top-k 4
"""
from __future__ import annotations

import argparse
import heapq
import sys
from dataclasses import dataclass

import numpy as np

from cache_policies import POLICY_KINDS, BaseCachePolicy, serve
from freetoken.errors import FreetokenError
from freetoken.trace import PHASES, read_trace

# rows replayed through cache_policies.py's classes (global_lru: the runtime's LRU over pairs)
KINDS = {"global_lru": "lru", "tinylfu": "tinylfu", "s3fifo": "s3fifo", "adaptive_lrfu": "adaptive_lrfu",
         "adaptive_lrfu_evict": "adaptive_lrfu_evict"}
POLICIES = (*KINDS, "layer_lru", "static", "layer_offload", "belady")
DEFAULT_PERCENTS = (5, 10, 15, 20, 25, 30, 40, 50, 60, 70, 80, 90, 100)


class ReplayError(FreetokenError):
    """Traces that cannot be replayed together, or a bad option."""


@dataclass
class Stream:
    """One trace as a sequence of accesses to pair ids (layer * E + expert)."""
    items: np.ndarray       # int64 [M]
    split: int              # accesses [split:] are scored
    num_layers: int
    num_experts: int
    num_tokens: int         # tokens replayed (after the phase filter)
    sizes: np.ndarray = None  # int64 [G]: accesses of each layer step, in order (sum = M)


def build_stream(meta: dict, ids: np.ndarray, include_prefill: bool = False) -> Stream:
    """Turn [N, L, K] ids into accesses: per step, per layer, the step's distinct experts (sorted).

    Example (E=4, one-token decode steps): ids[t] = [[2, 1], [0, 3]] -> items 1, 2, 4, 7.
    """
    N, L, K = ids.shape
    E = int(meta["num_experts"])
    keep = np.ones(N, bool) if include_prefill else meta["phases"] == PHASES.index("decode")
    steps = meta["steps"][keep]
    kept = ids[keep].astype(np.int64)
    bounds = np.flatnonzero(np.diff(steps)) + 1 if steps.size else np.zeros(0, np.int64)
    starts = np.concatenate([[0], bounds]) if steps.size else np.zeros(0, np.int64)
    ends = np.concatenate([bounds, [steps.size]]) if steps.size else np.zeros(0, np.int64)
    layer_base = (np.arange(L, dtype=np.int64) * E)[:, None]
    chunks, sizes, split = [], [], 0
    for n, (s, e) in enumerate(zip(starts, ends)):
        if n == len(starts) // 2:
            split = sum(c.size for c in chunks)
        block = np.sort(kept[s:e].transpose(1, 0, 2).reshape(L, -1), axis=1)  # [L, T*K]
        first = np.ones(block.shape, bool)
        first[:, 1:] = block[:, 1:] != block[:, :-1]
        chunks.append((block + layer_base)[first])
        sizes.append(first.sum(axis=1))
    items = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
    sizes = np.concatenate(sizes).astype(np.int64) if sizes else np.zeros(0, np.int64)
    return Stream(items, split, L, E, int(keep.sum()), sizes)


def stack_distances(items: np.ndarray, num_layers: int, num_experts: int):
    """LRU stack distance of every access, globally and within its layer (-1 = first use).

    An access hits an LRU cache of capacity C iff 0 <= distance < C (Mattson et al. 1970), so
    one pass gives the misses for every capacity.
    """
    last = np.full(num_layers * num_experts, -1, np.int64)
    dist_global = np.empty(items.size, np.int64)
    dist_layer = np.empty(items.size, np.int64)
    for i, x in enumerate(items.tolist()):
        p = last[x]
        if p < 0:
            dist_global[i] = dist_layer[i] = -1
        else:
            lo = x - x % num_experts
            dist_global[i] = np.count_nonzero(last > p)
            dist_layer[i] = np.count_nonzero(last[lo:lo + num_experts] > p)
        last[x] = i
    return dist_global, dist_layer


def layer_capacities(capacity: int, num_layers: int) -> np.ndarray:
    """Equal split of capacity over layers; the first capacity % L layers get one more."""
    return capacity // num_layers + (np.arange(num_layers) < capacity % num_layers)


def static_ranks(stream: Stream) -> np.ndarray:
    """Rank of every pair by access count in the first half (ties: lower pair id first)."""
    counts = np.bincount(stream.items[:stream.split], minlength=stream.num_layers * stream.num_experts)
    order = np.lexsort((np.arange(counts.size), -counts))
    ranks = np.empty(counts.size, np.int64)
    ranks[order] = np.arange(counts.size)
    return ranks


def belady_misses(items: np.ndarray, capacity: int) -> int:
    """Fewest misses any cache of `capacity` can have on items, free to choose its initial contents.

    The cold fill is free (that is the free choice of initial contents: the C pairs used first);
    then on a miss the resident with the furthest next use goes, unless the missed pair itself is
    used later than all of them, in which case it bypasses the cache.
    """
    M = items.size
    next_use = np.full(M, M, np.int64)  # M = never again
    seen: dict[int, int] = {}
    for i in range(M - 1, -1, -1):
        x = int(items[i])
        next_use[i] = seen.get(x, M)
        seen[x] = i
    resident: dict[int, int] = {}  # pair -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, pair), stale entries skipped
    misses = 0
    for x, nu in zip(items.tolist(), next_use.tolist()):
        if x in resident or len(resident) < capacity:
            resident[x] = nu
            heapq.heappush(heap, (-nu, x))
            continue
        misses += 1
        while resident.get(heap[0][1]) != -heap[0][0]:
            heapq.heappop(heap)
        if nu < -heap[0][0]:
            del resident[heapq.heappop(heap)[1]]
            resident[x] = nu
            heapq.heappush(heap, (-nu, x))
    return misses


def policy_misses(stream: Stream, policy: BaseCachePolicy) -> int:
    """Misses of `policy` (fresh) on the scored half, fed the whole stream one layer step at a
    time: the first half warms it."""
    items, start, misses = stream.items.tolist(), 0, 0
    for n in stream.sizes.tolist():
        m = serve(policy, items[start:start + n])
        misses += m if start >= stream.split else 0
        start += n
    return misses


def replay(streams: list[Stream], capacities: list[int], params: dict = None
           ) -> tuple[dict[str, np.ndarray], int]:
    """Misses of each policy at each capacity over the scored halves of all streams.
    params: {kind: {argument: value}} for cache_policies.py's classes (tuning), else their defaults."""
    params = params or {}
    misses = {p: np.zeros(len(capacities), np.int64) for p in POLICIES}
    accesses = 0
    for s in streams:
        scored = s.items[s.split:]
        accesses += scored.size
        dist_l = stack_distances(s.items, s.num_layers, s.num_experts)[1][s.split:]
        layer = scored // s.num_experts
        ranks = static_ranks(s)[scored]
        for j, cap in enumerate(capacities):
            for row, kind in KINDS.items():
                policy = POLICY_KINDS[kind](cap, **params.get(kind, {}))
                misses[row][j] += policy_misses(s, policy)
            cap_l = layer_capacities(cap, s.num_layers)[layer]
            misses["layer_lru"][j] += np.count_nonzero((dist_l < 0) | (dist_l >= cap_l))
            misses["static"][j] += np.count_nonzero(ranks >= cap)
            first_resident = s.num_layers - min(cap // s.num_experts, s.num_layers)
            misses["layer_offload"][j] += np.count_nonzero(layer < first_resident)
            misses["belady"][j] += belady_misses(scored, cap)
    return misses, accesses


def synthetic_trace(kind: str, num_tokens: int, num_layers: int, num_experts: int, top_k: int,
                    seed: int = 0) -> tuple[dict, np.ndarray]:
    """A decode-only trace: 'uniform' (independent uniform top-k) or 'locality' (per-layer Zipf
    popularity, and each slot reuses one of the previous token's experts with probability 0.5)."""
    if kind not in ("uniform", "locality"):
        raise ReplayError(f"unknown synthetic trace {kind!r}: use uniform or locality")
    if not 0 < top_k <= num_experts:
        raise ReplayError(f"--top-k {top_k} must be in 1..{num_experts} (--experts)")
    rng = np.random.default_rng(seed)
    ids = np.empty((num_tokens, num_layers, top_k), np.int16)
    # expert e of a layer has popularity 1/rank, the ranks a random permutation per layer
    popularity = [1.0 / (1 + rng.permutation(num_experts)) for _ in range(num_layers)]
    for t in range(num_tokens):
        for layer in range(num_layers):
            if kind == "uniform":
                ids[t, layer] = rng.choice(num_experts, top_k, replace=False)
                continue
            weights = popularity[layer].copy()
            chosen = []
            for _ in range(top_k):
                prev = [e for e in (ids[t - 1, layer] if t else ()) if e not in chosen]
                if prev and rng.random() < 0.5:
                    e = int(rng.choice(prev))
                else:
                    e = int(rng.choice(num_experts, p=weights / weights.sum()))
                chosen.append(e)
                weights[e] = 0.0
            ids[t, layer] = chosen
    meta = {"family": f"synthetic-{kind}", "num_layers": num_layers,
            "moe_layers": list(range(num_layers)), "num_experts": num_experts, "top_k": top_k,
            "phases": np.full(num_tokens, PHASES.index("decode"), np.uint8),
            "steps": np.arange(num_tokens, dtype=np.uint32)}
    return meta, ids


def format_table(streams, capacities, percents, misses, accesses, include_prefill) -> str:
    L, E = streams[0].num_layers, streams[0].num_experts
    tokens = sum(s.num_tokens for s in streams)
    phase = "prefill+decode" if include_prefill else "decode-only (prefill excluded)"
    lines = [
        f"{len(streams)} trace(s), {tokens} {phase} tokens, {L} MoE layers x {E} experts = {L * E} pairs",
        f"miss rate (%) on the SECOND HALF of each trace for every policy ({accesses} accesses): "
        "static learned on the first half, LRUs warmed on it, belady = offline optimum",
        f"{'capacity':>8} {'pairs':>6} " + " ".join(f"{p:>13}" for p in POLICIES),
    ]
    for j, (pct, cap) in enumerate(zip(percents, capacities)):
        rates = [100.0 * misses[p][j] / max(accesses, 1) for p in POLICIES]
        lines.append(f"{pct:>7g}% {cap:>6} " + " ".join(f"{r:>13.1f}" for r in rates))
    return "\n".join(lines)


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ReplayError("--png needs matplotlib: pip install matplotlib "
                          "(or install freetoken with the 'tools' extra)") from exc
    return plt


def plot_png(path, percents, misses, accesses) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for p in POLICIES:
        ax.plot(percents, 100.0 * misses[p] / max(accesses, 1), marker="o", markersize=3, label=p)
    ax.set_xlabel("cache capacity (% of all layer x expert pairs)")
    ax.set_ylabel("miss rate (%)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="*", help="trace files written by `freetoken run --trace-out`")
    ap.add_argument("--synthetic", choices=("uniform", "locality"), help="replay a generated trace")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--include-prefill", action="store_true")
    ap.add_argument("--capacities", default=",".join(map(str, DEFAULT_PERCENTS)),
                    help="comma-separated percents of all pairs")
    ap.add_argument("--png", help="also plot miss rate vs capacity to this PNG (needs matplotlib)")
    args = ap.parse_args(argv)
    try:
        if bool(args.traces) == bool(args.synthetic):
            raise ReplayError("give trace files or --synthetic uniform|locality (not both)")
        if args.png:
            _pyplot()  # fail before the replay, not after it
        if args.synthetic:
            loaded = [synthetic_trace(args.synthetic, args.tokens, args.layers, args.experts,
                                      args.top_k, args.seed)]
        else:
            loaded = [read_trace(p) for p in args.traces]
        streams = [build_stream(m, ids, args.include_prefill) for m, ids in loaded]
        shapes = {(s.num_layers, s.num_experts) for s in streams}
        if len(shapes) > 1:
            raise ReplayError(f"traces come from different models (layers x experts {sorted(shapes)})")
        if not any(s.items.size - s.split for s in streams):
            raise ReplayError("no accesses to score: the traces hold no decode tokens "
                              "(try --include-prefill or a longer generation)")
        try:
            percents = [float(p) for p in args.capacities.split(",")]
        except ValueError:
            raise ReplayError(f"--capacities {args.capacities!r}: expected numbers like 5,10,50") from None
        if any(not 0 < p <= 100 for p in percents):
            raise ReplayError("--capacities: each percent must be in (0, 100]")
        num_pairs = streams[0].num_layers * streams[0].num_experts
        capacities = [max(1, round(p * num_pairs / 100)) for p in percents]
        misses, accesses = replay(streams, capacities)
        print(format_table(streams, capacities, percents, misses, accesses, args.include_prefill))
        if args.png:
            plot_png(args.png, percents, misses, accesses)
            print(f"wrote {args.png}")
    except (FreetokenError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
