"""Issue 38's replay table: miss rates of LRU, static, cache_policies.py's admission policies and
Belady on every trace set at 10/25/50% cache, one set held out of the tuning and marked; --sweep
prints the tuning grid on the other sets only. Replays with tools/replay_cache.py's code.

Trace sets (all decode-only; each scored on its second half, see replay_cache.py):
  bundled        the bundled model's traces (a folder of .npz, tools/collect_traces.py)
  held-out       another folder of them (`collect_traces.py OUT --prompts more`): never tuned on
  bench-uniform  tools/bench_routing.py's workloads, --bench-shape layers,experts,top_k
  bench-locality
  mixtral        top-2 draws from the published Mixtral-8x7B per-layer expert popularity
                 (Fiddler's MMLU counts): one subject after another, --subject-tokens each

    python tools/replay_policies.py --bundled docs/traces --held-out docs/traces/more \
        --mixtral DATA/routing-traces/fiddler-mixtral-8x7b-expert-popularity/mixtral_8x7b_instruct
"""
from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import sys

import numpy as np

import bench_routing
import replay_cache as rc
from freetoken.trace import PHASES, read_trace

PERCENTS = (10, 25, 50)
ROWS = ("global_lru", "static", "tinylfu", "s3fifo", "adaptive_lrfu", "adaptive_lrfu_evict", "belady")
GRID = {"tinylfu": {"window": (1, 2, 4, 8, 16, 32, 64)},
        "s3fifo": {"small": (0.05, 0.1, 0.2, 0.3), "promote": (1, 2)},
        "lrfu": {"half_life": (0.25, 1, 4, 16)},
        "adaptive_lrfu": {"half_lives": ((0.25, 1, 4, 16), (0.25, 1, 4, 16, 64), (0.25, 2, 16, 128)),
                          "memory": (0.99, 0.999, 0.9999)}}


def decode_meta(ids: np.ndarray, family: str, num_experts: int) -> dict:
    N, L, K = ids.shape
    return {"family": family, "num_layers": L, "num_experts": num_experts, "top_k": K,
            "phases": np.full(N, PHASES.index("decode"), np.uint8),
            "steps": np.arange(N, dtype=np.uint32)}


def popularity_ids(folder, subject_tokens: int, seed: int = 0) -> tuple[dict, np.ndarray]:
    """[T, L, 2] expert ids: for each subject's JSON (sorted by name) in turn, subject_tokens
    tokens whose two experts per layer are drawn without replacement, proportionally to that
    subject's per-layer counts. No order within a subject: no temporal reuse beyond popularity."""
    files = sorted(pathlib.Path(folder).glob("*.json"))
    if not files:
        raise rc.ReplayError(f"--mixtral {folder}: no .json popularity files there")
    rng = np.random.default_rng(seed)
    parts = []
    for f in files:
        counts = np.asarray(json.loads(f.read_text())["expert_popularity"], np.float64)  # [L, E]
        p = counts / counts.sum(axis=1, keepdims=True)
        # Gumbel top-2 = sampling 2 without replacement proportionally to p
        keys = np.log(p)[None] - np.log(-np.log(rng.random((subject_tokens, *p.shape))))
        parts.append(np.argsort(-keys, axis=-1)[..., :2])
    ids = np.concatenate(parts)
    return decode_meta(ids, "mixtral-popularity", counts.shape[1]), ids


def load_sets(args) -> dict:
    """{name: list of (meta, ids)}; the held-out set is named 'held-out'."""
    sets = {}
    for name, folder in (("bundled", args.bundled), ("held-out", args.held_out)):
        if folder:
            paths = sorted(pathlib.Path(folder).glob("*.npz"))
            if not paths:
                raise rc.ReplayError(f"{folder}: no .npz traces (tools/collect_traces.py makes them)")
            sets[name] = [read_trace(p) for p in paths]
    L, E, K = args.bench_shape
    for kind in bench_routing.WORKLOADS:
        ids = bench_routing.make_trace(kind, args.bench_tokens, L, E, K, args.seed).expert_ids
        sets[f"bench-{kind}"] = [(decode_meta(ids, f"bench-{kind}", E), ids)]
    if args.mixtral:
        sets["mixtral"] = [popularity_ids(args.mixtral, args.subject_tokens, args.seed)]
    return sets


def rates(streams, params=None) -> dict:
    """{row: [miss rate % at each of PERCENTS]} over the streams."""
    pairs = streams[0].num_layers * streams[0].num_experts
    caps = [max(1, round(p * pairs / 100)) for p in PERCENTS]
    misses, accesses = rc.replay(streams, caps, params)
    return {row: [100.0 * m / accesses for m in misses[row]] for row in rc.POLICIES}


def kind_rates(streams, kind: str, params: dict) -> list:
    """Miss rate % at each of PERCENTS of one of cache_policies.py's kinds with these arguments."""
    pairs = streams[0].num_layers * streams[0].num_experts
    accesses = sum(s.items.size - s.split for s in streams)
    return [100.0 * sum(rc.policy_misses(s, rc.POLICY_KINDS[kind](max(1, round(p * pairs / 100)),
                                                                 **params)) for s in streams)
            / accesses for p in PERCENTS]


def table(sets: dict) -> str:
    """One line per trace set: for each cache size, the miss rate % of every row."""
    names = {"global_lru": "lru", "adaptive_lrfu": "a-lrfu", "adaptive_lrfu_evict": "a-evict"}
    group = " ".join(f"{names.get(r, r)[:7]:>7}" for r in ROWS)
    width = len(group)
    lines = [f"{'':<20} {'':>5} {'':>7} " + " | ".join(f"{str(p) + '% cache':^{width}}" for p in PERCENTS),
             f"{'trace set':<20} {'pairs':>5} {'scored':>7} " + " | ".join([group] * len(PERCENTS))]
    for name, streams in sets.items():
        r = rates(streams)
        scored = sum(s.items.size - s.split for s in streams)
        label = name + (" (HELD OUT)" if name == "held-out" else "")
        pairs = streams[0].num_layers * streams[0].num_experts
        cells = " | ".join(" ".join(f"{r[row][j]:>7.1f}" for row in ROWS) for j in range(len(PERCENTS)))
        lines.append(f"{label:<20} {pairs:>5} {scored:>7} {cells}")
    return "\n".join(lines)


def sweep(sets: dict) -> str:
    """Each grid point's miss rates, mean over the tuning sets (never the held-out one)."""
    tuning = {n: s for n, s in sets.items() if n != "held-out"}
    lines = [f"tuning sets: {', '.join(tuning)}; mean miss rate % at {PERCENTS}, and the worst "
             "margin over min(LRU, static) (negative = better than both)"]
    base = {n: rates(s) for n, s in tuning.items()}
    for kind, grid in GRID.items():
        keys = list(grid)
        for values in itertools.product(*grid.values()):
            params = dict(zip(keys, values))
            per = {n: kind_rates(s, kind, params) for n, s in tuning.items()}
            mean = np.mean([per[n] for n in tuning], axis=0)
            margin = max(per[n][j] - min(base[n]["global_lru"][j], base[n]["static"][j])
                         for n in tuning for j in range(len(PERCENTS)))
            lines.append(f"{kind:<13} {params!s:<50} " + " ".join(f"{m:6.1f}" for m in mean)
                         + f"   worst margin {margin:+6.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bundled", help="folder of the bundled model's traces (tuning)")
    ap.add_argument("--held-out", help="folder of traces held out of the tuning")
    ap.add_argument("--mixtral", help="folder of Fiddler's per-subject popularity JSON files")
    ap.add_argument("--subject-tokens", type=int, default=300)
    ap.add_argument("--bench-shape", type=lambda s: tuple(int(x) for x in s.split(",")),
                    default=(8, 128, 8), help="layers,experts,top_k of the bench workloads")
    ap.add_argument("--bench-tokens", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sweep", action="store_true", help="print the tuning grid instead")
    args = ap.parse_args(argv)
    try:
        sets = {n: [rc.build_stream(m, ids) for m, ids in loaded]
                for n, loaded in load_sets(args).items()}
        for name, streams in sets.items():
            if len({(s.num_layers, s.num_experts) for s in streams}) > 1:
                raise rc.ReplayError(f"{name}: traces come from different models")
        print(sweep(sets) if args.sweep else table(sets))
    except (rc.FreetokenError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
