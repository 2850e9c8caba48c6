"""tools/cache_policies.py's admission/eviction kinds on random layer-step traces: the cache
invariants, LRU against a naive model, the admission rules on hand-worked cases, and
tools/replay_cache.py replaying exactly these classes."""
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import replay_cache as rc
from cache_policies import POLICY_KINDS, LRFU, LRU, S3FIFO, AdaptiveLRFU, AdaptiveLRFUEvict, TinyLFU, serve

# a trace: layer steps, each the distinct pairs it touches (<= 4), pair ids below 12
steps_strategy = st.lists(st.lists(st.integers(0, 11), min_size=1, max_size=4, unique=True),
                          min_size=1, max_size=60)


def run(policy, steps):
    """Feeds steps one at a time, checking the invariants after each; returns (misses, fills)."""
    misses, fills = 0, []
    for pairs in steps:
        before = set(policy.resident())
        miss = policy.access(pairs)
        hits = [p for p in pairs if p not in miss]
        assert set(hits) <= before and not set(miss) & before  # misses are exactly the absent
        take = policy.worth(miss, hits)
        assert set(take) <= set(miss) and len(take) == len(set(take))
        done = policy.fill(take, hits)
        after = policy.resident()
        assert len(after) == len(set(after)) <= policy.capacity  # once each, within capacity
        assert set(hits) | set(take) <= set(after)                # the step's pairs stay
        gone = {v for _, v in done if v != -1}
        assert not gone & set(pairs) and set(after) == (before - gone) | set(take)
        misses += len(miss)
        fills.append(done)
    return misses, fills


@settings(max_examples=80, deadline=None)
@given(steps_strategy, st.integers(4, 14), st.sampled_from(sorted(POLICY_KINDS)))
def test_invariants_and_determinism(steps, capacity, kind):
    misses, fills = run(POLICY_KINDS[kind](capacity), steps)
    again = run(POLICY_KINDS[kind](capacity), steps)
    assert (misses, fills) == again  # deterministic for a trace
    accesses = sum(len(s) for s in steps)
    hits = sum(len(s) for s in steps) - misses
    assert 0 <= misses <= accesses and hits + misses == accesses
    first_uses = len({p for s in steps for p in s})
    assert misses >= first_uses  # every pair misses on its first use


def naive_lru(steps, capacity):
    """Ten lines: a step's hits move to the recent end, then each miss evicts the least recent
    pair the step did not touch."""
    cache, misses = OrderedDict(), 0
    for pairs in steps:
        miss = [p for p in pairs if p not in cache]
        for p in pairs:
            if p in cache:
                cache.move_to_end(p)
        for p in miss:
            if len(cache) >= capacity:
                del cache[next(q for q in cache if q not in pairs)]
            cache[p] = None
        misses += len(miss)
    return misses, list(cache)


@settings(max_examples=80, deadline=None)
@given(steps_strategy, st.integers(4, 14))
def test_lru_matches_naive_model(steps, capacity):
    lru = LRU(capacity)
    misses = sum(serve(lru, pairs) for pairs in steps)
    assert (misses, lru.resident()) == naive_lru(steps, capacity)


def test_tinylfu_admission_hand_worked():
    """Capacity 1 holding a (count 3): b is refused until its count beats a's."""
    p = TinyLFU(1, window=100)
    for _ in range(3):
        serve(p, [0])                        # a = 0: count 3, resident
    assert p.access([1]) == [1] and p.counts == {0: 3, 1: 1}
    assert p.worth([1], []) == []            # 1 <= 3: refused, runs without a slot
    for _ in range(2):
        serve(p, [1])                        # b's count 2, then 3: ties refuse
    assert p.resident() == [0] and p.counts[1] == 3
    assert p.access([1]) == [1] and p.worth([1], []) == [1]  # 4 > 3
    assert p.fill([1], []) == [(1, 0)] and p.resident() == [1]


def test_tinylfu_halves_counts_each_window():
    p = TinyLFU(2, window=2)                 # halve every 4 accesses
    serve(p, [0, 1])
    serve(p, [0])
    assert p.counts == {0: 2, 1: 1}
    serve(p, [0])                            # 4th access: 0 -> 3 // 2, 1 -> dropped
    assert p.counts == {0: 1} and p.seen == 0


def test_lrfu_admission_hand_worked():
    """The docstring's example: half-life 1 access, capacity 1."""
    p = LRFU(1, half_life=1.0)
    serve(p, [0])                            # t=0: key 0
    serve(p, [0])                            # t=1: count 1 + 1/2 -> key 1 + log2(1.5)
    assert p.key[0] == pytest.approx(1 + np.log2(1.5))
    assert p.access([1]) == [1] and p.key[1] == 2.0   # t=2: count 1 at time 2
    assert p.worth([1], []) == [1] and p.fill([1], []) == [(1, 0)]
    q = LRFU(1, half_life=100.0)             # long memory: a's two uses outweigh b's one
    serve(q, [0]), serve(q, [0])
    assert q.access([1]) == [1] and q.worth([1], []) == []


def test_s3fifo_ghost_goes_to_main():
    p = S3FIFO(2, small=0.5)                 # one small slot, a one-entry ghost
    serve(p, [0])
    serve(p, [1])                            # free slots: no eviction yet
    serve(p, [2])                            # 0 leaves small unhit: evicted to the ghost
    assert list(p.small) == [1, 2] and list(p.ghost) == [0]
    serve(p, [0])                            # a ghost's miss enters main; 1 becomes the ghost
    assert list(p.main) == [0] and list(p.small) == [2] and list(p.ghost) == [1]
    serve(p, [2])
    serve(p, [3])                            # 2 was hit in small: promoted, main pays
    assert list(p.small) == [3] and list(p.main) == [2] and list(p.ghost) == [1]  # main's
    # evictees leave no ghost


def test_adaptive_lrfu_follows_the_better_half_life():
    # two hot pairs between scans of three never-reused ones, 2 slots: LRU keeps the scan (all
    # miss), a long half-life keeps the hot pairs (only the scan misses)
    steps = [[p] for r in range(200) for p in (0, 1, 100 + 3 * r, 101 + 3 * r, 102 + 3 * r)]
    p = AdaptiveLRFU(2, half_lives=(0.25, 64.0))
    misses = sum(serve(p, s) for s in steps)
    assert p.lead == 1 and misses < 0.7 * len(steps)
    assert sum(serve(LRU(2), s) for s in steps) == len(steps)


def test_fill_refuses_more_than_the_free_room():
    for kind in POLICY_KINDS.values():
        p = kind(2)
        serve(p, [0, 1])
        with pytest.raises(ValueError, match="cannot fill 1 pairs: 2 slots, 2 protected"):
            p.fill([2], [0, 1])
    with pytest.raises(ValueError, match="at least 1 slot"):
        LRU(0)


def test_replay_uses_the_policy_classes():
    """replay_cache's rows are these classes fed the stream's layer steps."""
    rng = np.random.default_rng(4)
    ids = np.stack([[rng.choice(8, 2, replace=False) for _ in range(3)] for _ in range(80)])
    meta = {"num_experts": 8, "phases": np.ones(80, np.uint8), "steps": np.arange(80, dtype=np.uint32)}
    stream = rc.build_stream(meta, ids)
    assert stream.sizes.tolist() == [2] * 240 and stream.sizes.sum() == stream.items.size
    misses, _ = rc.replay([stream], [6])
    for row, kind in rc.KINDS.items():
        policy, want = POLICY_KINDS[kind](6), 0
        for t in range(80):
            for layer in range(3):
                m = serve(policy, sorted(int(e) + 8 * layer for e in ids[t, layer]))
                want += m if t >= 40 else 0
        assert misses[row][0] == want, row


def test_replay_policies_table_and_popularity(tmp_path, capsys):
    import json

    import replay_policies as rp
    for name, hot in (("a_subject", 0), ("b_subject", 3)):  # layer x expert counts, one hot each
        counts = [[90 if e == hot else 1 for e in range(4)] for _ in range(2)]
        (tmp_path / f"{name}.json").write_text(json.dumps({"expert_popularity": counts}))
    meta, ids = rp.popularity_ids(tmp_path, 200, seed=1)
    assert ids.shape == (400, 2, 2) and meta["num_experts"] == 4
    assert all(len(set(r)) == 2 for r in ids.reshape(-1, 2).tolist())  # two distinct experts
    assert (ids[:200] == 0).any(axis=-1).mean() > 0.9 and (ids[200:] == 3).any(axis=-1).mean() > 0.9
    args = ["--mixtral", str(tmp_path), "--subject-tokens", "40", "--bench-shape", "2,8,2",
            "--bench-tokens", "60"]
    assert rp.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out[2:]] == ["bench-uniform", "bench-locality", "mixtral"]
    assert rp.main(["--held-out", str(tmp_path / "none")]) == 2
    assert "collect_traces.py" in capsys.readouterr().err


def test_adaptive_lrfu_evict_fills_every_miss_and_evicts_by_count():
    """Without the admission test every miss takes a slot (as LRU admits) where the gated
    version refuses some (2 slots held by the hot pairs: a scan pair's count never beats
    theirs); with a slot to spare the victims still follow the counts and keep the hot pairs
    that LRU loses."""
    steps = [[p] for r in range(200) for p in (0, 1, 100 + 3 * r, 101 + 3 * r, 102 + 3 * r)]

    def run(p):
        filled = refused = 0
        for s in steps:
            misses = p.access(s)
            worth = p.worth(misses, [])
            refused += len(misses) - len(worth)
            p.fill(worth, [])
            filled += len(worth)
        return filled, refused

    assert run(AdaptiveLRFUEvict(2, half_lives=(0.25, 64.0)))[1] == 0
    assert run(AdaptiveLRFU(2, half_lives=(0.25, 64.0)))[1] > 0
    p = AdaptiveLRFUEvict(3, half_lives=(0.25, 64.0))
    filled, _ = run(p)
    assert p.lead == 1 and filled < 0.7 * len(steps)  # the hot pairs stayed: the scan misses
    assert sum(serve(LRU(3), s) for s in steps) == len(steps)
