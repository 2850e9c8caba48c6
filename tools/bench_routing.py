"""Routing workloads for the MoE benches (bench_decode.py, bench_prefill.py): expert ids to
inject into the MoE layers instead of what a random model's routers would pick, and the
statistics that describe them. Knows nothing of models, caches or devices.

  uniform   each token routes to top-k distinct experts drawn uniformly, independently per
            token and layer: no temporal reuse and no popularity, the worst case for a cache.
  locality  a stack-distance process per layer, calibrated to published measurements
            (see LOCALITY): with probability 1 - s a route takes the expert at depth d of the
            layer's recency stack (d drawn from p(d) ~ ((d + 0.5) / E + x0) ** -alpha), with
            probability s it draws from a fixed per-layer Zipf(z) popularity; the token's
            experts then move to the top of the stack. Per-layer LRU with c slots hits exactly
            when d < c, so the depth law sets the LRU hit-rate curve; s sets static skew.

Shape legend: T tokens, L MoE layers, K routes per token, E experts per layer.

    python tools/bench_routing.py --cache-fracs 0.25,0.5   # layer steps per token by misses
"""
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

# Fitted (8 layers x 2000 tokens, E=128, K=8) so that the generated trace reproduces, within
# ~0.02: per-layer LRU holding 12.5% / 25% of a layer's experts hits 67% / 81% of routes, and a
# static top-6.25% set learned on one half of the trace covers ~10% of the other half's routes
# (llama.cpp PR #27861: 64 / 128 slots of 512 experts, 10 routed, 54k routing records).
LOCALITY = {"alpha": 1.9, "x0": 0.045, "s": 0.03, "z": 1.0}
PUBLISHED = ("llama.cpp PR #27861 (512 experts, top-10, 54k records): per-layer LRU at 12.5% / "
             "25% of a layer's experts hits ~67% / ~81%; a static top-6.25% list learned on one "
             "half covers ~10% of the other half (uniform 6.25%)")
WORKLOADS = ("uniform", "locality")


@dataclass
class Trace:
    name: str
    expert_ids: np.ndarray  # [T, L, K] int64, distinct per (token, layer)
    weights: np.ndarray     # [T, L, K] float32, sums to 1 per (token, layer), descending


def _weights(rng, T, L, K):
    w = rng.gamma(1.0, size=(T, L, K)).astype(np.float32)
    w = -np.sort(-w, axis=-1)
    return w / w.sum(-1, keepdims=True)


def uniform_trace(T: int, L: int, E: int, K: int, seed: int = 0) -> Trace:
    rng = np.random.default_rng(seed)
    ids = np.empty((T, L, K), dtype=np.int64)
    for t in range(0, T, 1024):  # chunks: a [T, L, E] draw of a 16K-token prompt is GBs
        draw = rng.random((min(1024, T - t), L, E))
        ids[t:t + 1024] = np.argpartition(draw, K - 1, axis=-1)[..., :K]  # K distinct of E
    return Trace("uniform", ids, _weights(rng, T, L, K))


def locality_trace(T: int, L: int, E: int, K: int, seed: int = 0, params: dict = None) -> Trace:
    """The stack-distance process of the module docstring, all L layers at once (independent
    processes). The stacks start as random permutations, i.e. as if after a long history."""
    p = {**LOCALITY, **(params or {})}
    rng = np.random.default_rng(seed)
    depth_pdf = ((np.arange(E) + 0.5) / E + p["x0"]) ** -p["alpha"]
    depth_cdf = np.cumsum(depth_pdf / depth_pdf.sum())
    zipf = (np.arange(E) + 1.0) ** -p["z"]
    zipf_cdf = np.cumsum(zipf / zipf.sum())
    popular = np.stack([rng.permutation(E) for _ in range(L)])  # [L, E] rank -> expert
    stack = np.stack([rng.permutation(E) for _ in range(L)])    # [L, E] depth -> expert
    pos = np.argsort(stack, axis=1)                              # [L, E] expert -> depth
    rows = np.arange(L)
    ids = np.empty((T, L, K), dtype=np.int64)
    for t in range(T):
        chosen = np.full((L, K), -1, dtype=np.int64)
        for j in range(K):
            todo = rows
            while len(todo):  # redraw where the expert was already chosen for this token
                n = len(todo)
                static = rng.random(n) < p["s"]
                rank = np.minimum(np.searchsorted(zipf_cdf, rng.random(n)), E - 1)
                depth = np.minimum(np.searchsorted(depth_cdf, rng.random(n)), E - 1)
                e = np.where(static, popular[todo, rank], stack[todo, depth])
                dup = (chosen[todo, :j] == e[:, None]).any(axis=1)
                chosen[todo[~dup], j] = e[~dup]
                todo = todo[dup]
        ids[t] = chosen
        key = pos + K  # the token's experts to the top, first pick on top; the rest keep order
        key[rows[:, None], chosen] = np.arange(K)[None, :]
        stack = np.argsort(key, axis=1, kind="stable")
        pos = np.argsort(stack, axis=1)
    return Trace("locality", ids, _weights(rng, T, L, K))


def make_trace(name: str, T: int, L: int, E: int, K: int, seed: int = 0) -> Trace:
    if name == "uniform":
        return uniform_trace(T, L, E, K, seed)
    if name == "locality":
        return locality_trace(T, L, E, K, seed)
    raise ValueError(f"unknown workload {name!r}; expected one of {WORKLOADS}")


# ---- statistics (independent of the generator: plain replays of the ids) -----------------------

def _touch(lru: OrderedDict, keys, capacity: int) -> None:
    """Move keys (in order) to the LRU's recent end, then evict down to capacity."""
    for key in keys:
        lru[key] = None
        lru.move_to_end(key)
    while len(lru) > capacity:
        lru.popitem(last=False)


def lru_hit_rate(ids: np.ndarray, capacity: int) -> float:
    """Per-layer LRU of `capacity` experts over ids [T, L, K]: the fraction of routes whose
    expert is resident when its token arrives (the token's experts are then touched)."""
    T, L, K = ids.shape
    hits = 0
    for layer in range(L):
        lru = OrderedDict()
        for t in range(T):
            row = ids[t, layer].tolist()
            hits += sum(e in lru for e in row)
            _touch(lru, reversed(row), capacity)
    return hits / (T * L * K)


def static_coverage(ids: np.ndarray, E: int, top: int) -> float:
    """The `top` most frequent experts of each layer in the first half, as a fraction of the
    second half's routes they cover."""
    half = ids.shape[0] // 2
    cover = []
    for layer in range(ids.shape[1]):
        counts = np.bincount(ids[:half, layer].ravel(), minlength=E)
        hot = np.argsort(-counts, kind="stable")[:top]
        cover.append(np.isin(ids[half:, layer].ravel(), hot).mean())
    return float(np.mean(cover))


def distinct_per_layer(ids: np.ndarray) -> list:
    """Distinct experts each layer routes a batch ids [T, L, K] to."""
    return [len(np.unique(ids[:, layer])) for layer in range(ids.shape[1])]


def hottest_share(ids: np.ndarray, E: int) -> float:
    """Mean over layers of the hottest expert's share of the layer's routes."""
    T, L, K = ids.shape
    return float(np.mean([np.bincount(ids[:, l].ravel(), minlength=E).max() / (T * K)
                          for l in range(L)]))


def step_misses(ids: np.ndarray, E: int, capacity: int, warm: int = 0) -> np.ndarray:
    """One LRU of `capacity` (layer, expert) pairs over all layers (the engine's global cache,
    every miss cached as offload-only does) replayed over ids [T, L, K]: counts[m] = layer steps
    (token, layer) with m misses, over the tokens after the first `warm`."""
    T, L, K = ids.shape
    lru, counts = OrderedDict(), np.zeros(K + 1, dtype=np.int64)
    for t in range(T):
        for layer in range(L):
            pairs = [layer * E + e for e in ids[t, layer].tolist()]
            if t >= warm:
                counts[sum(p not in lru for p in pairs)] += 1
            _touch(lru, pairs, capacity)
    return counts


def workload_lines(name: str, ids: np.ndarray, E: int) -> list:
    """Text lines: the published numbers the locality workload is calibrated to, and the same
    statistics measured on the trace ids [T, L, K] (per-layer replays, independent of the
    generator)."""
    c8, c4, c16 = max(1, E // 8), max(1, E // 4), max(1, E // 16)
    lines = [f"{name}: {LOCALITY} calibrated to {PUBLISHED}"] if name == "locality" else []
    lines.append(f"{name} trace ({ids.shape[0]} tokens x {ids.shape[1]} layers, E={E}, K={ids.shape[2]}): "
                 f"per-layer LRU {c8} slots ({c8 / E:.1%}) hits {lru_hit_rate(ids, c8):.1%}, {c4} slots "
                 f"({c4 / E:.1%}) {lru_hit_rate(ids, c4):.1%}; static top-{c16} of the first half covers "
                 f"{static_coverage(ids, E, c16):.1%} of the second; hottest expert "
                 f"{hottest_share(ids, E):.2%} of a layer's routes (uniform {1 / E:.2%})")
    return lines


def main(argv=None):
    """Layer steps per token by their miss count m under the global LRU, per cache fraction:
    how many layers a token spends on 0, 1, 2, ... misses (what the split's q(m) acts on)."""
    import argparse
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--workload", default="locality", choices=WORKLOADS)
    ap.add_argument("--cache-fracs", default="0.1,0.25,0.5")
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--warm", type=int, default=200, help="tokens replayed before counting")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    tr = make_trace(a.workload, a.tokens, a.layers, a.experts, a.top_k, a.seed)
    n = a.tokens - a.warm
    print(f"{a.workload}: layer steps per token (of {a.layers}) with m misses, global LRU; "
          f"{n} tokens after {a.warm}")
    print(f"{'cache':>6} " + " ".join(f"{'m=' + str(m):>6}" for m in range(a.top_k + 1))
          + f" {'misses/tok':>10}")
    for frac in (float(f) for f in a.cache_fracs.split(",")):
        c = step_misses(tr.expert_ids, a.experts, int(frac * a.layers * a.experts), a.warm) / n
        print(f"{frac:>6.0%} " + " ".join(f"{v:>6.2f}" for v in c)
              + f" {float((c * np.arange(a.top_k + 1)).sum()):>10.1f}")


if __name__ == "__main__":
    main()
