"""freetoken/trace.py round trip and tools/replay_cache.py policies against naive references."""
import io
import itertools
import json
import struct
import zipfile
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import replay_cache as rc
from freetoken.trace import PHASES, VERSION, TraceError, TraceWriter, read_trace

META = {"family": "qwen3_moe", "num_layers": 3, "moe_layers": [1, 2], "num_experts": 6,
        "top_k": 2, "prompt": "def f(x):", "num_prompt_tokens": 4}


def random_ids(rng, num_tokens, num_layers, num_experts, top_k):
    ids = np.empty((num_tokens, num_layers, top_k), np.int64)
    for t, layer in itertools.product(range(num_tokens), range(num_layers)):
        ids[t, layer] = rng.choice(num_experts, top_k, replace=False)
    return ids


def decode_meta(num_tokens, num_experts):
    return {"num_experts": num_experts, "phases": np.ones(num_tokens, np.uint8),
            "steps": np.arange(num_tokens, dtype=np.uint32)}


# ---------------------------------------------------------------- trace file

def test_trace_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    prefill, decode = random_ids(rng, 4, 2, 6, 2), random_ids(rng, 5, 2, 6, 2)
    path = tmp_path / "t.npz"
    with TraceWriter(path, META) as w:
        w.add_step(prefill, "prefill")
        for token in decode:
            w.add(token)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"]  # no .partial left behind
    meta, ids = read_trace(path)
    assert ids.dtype == np.int16 and ids.shape == (9, 2, 2)
    np.testing.assert_array_equal(ids, np.concatenate([prefill, decode]))
    assert [PHASES[p] for p in meta["phases"]] == ["prefill"] * 4 + ["decode"] * 5
    np.testing.assert_array_equal(meta["steps"], [0, 0, 0, 0, 1, 2, 3, 4, 5])
    assert {k: meta[k] for k in META} == META and meta["num_tokens"] == 9
    assert meta["shape"] == [9, 2, 2] and meta["ids_dtype"] == "int16"
    with np.load(path, allow_pickle=False) as npz:  # numpy's own container, nothing pickled
        assert sorted(npz.files) == ["ids", "meta", "phases", "steps", "version"]
        assert int(npz["version"]) == VERSION and json.loads(str(npz["meta"])) == META


def test_trace_wide_ids_and_empty(tmp_path):
    meta = dict(META, num_experts=40000, top_k=1)
    w = TraceWriter(tmp_path / "w", meta)  # any name: no ".npz" is appended
    w.add([[39999], [7]])
    w.close()
    assert w.close() == str(tmp_path / "w")  # second close is harmless
    _, ids = read_trace(tmp_path / "w")
    assert ids.dtype == np.int32 and ids.tolist() == [[[39999], [7]]]
    TraceWriter(tmp_path / "e", META).close()
    assert read_trace(tmp_path / "e")[1].shape == (0, 2, 2)


def test_trace_record_errors(tmp_path):
    with pytest.raises(TraceError, match="lacks num_experts"):
        TraceWriter(tmp_path / "x", {"num_layers": 1, "moe_layers": [0], "top_k": 1})
    w = TraceWriter(tmp_path / "x", META)
    with pytest.raises(TraceError, match="expected"):
        w.add_step(np.zeros((1, 3, 2)), "decode")
    with pytest.raises(TraceError, match="out of range"):
        w.add([[0, 6], [1, 2]])
    with pytest.raises(TraceError, match="phase"):
        w.add([[0, 1], [1, 2]], "generate")
    w.close()
    with pytest.raises(TraceError, match="closed"):
        w.add([[0, 1], [1, 2]])


@pytest.fixture
def trace_bytes(tmp_path):
    with TraceWriter(tmp_path / "good.npz", META) as w:
        w.add_step(random_ids(np.random.default_rng(1), 40, 2, 6, 2), "prefill")
    return (tmp_path / "good.npz").read_bytes()


@pytest.mark.parametrize("cut", [0, 3, 30, 0.5, -22, -1])
def test_truncated_trace(tmp_path, trace_bytes, cut):
    end = int(len(trace_bytes) * cut) if isinstance(cut, float) else cut
    (tmp_path / "short.npz").write_bytes(trace_bytes[:end])
    want = "not a freetoken trace" if end == 0 else "damaged or truncated.*record it again"
    with pytest.raises(TraceError, match=want):
        read_trace(tmp_path / "short.npz")


def test_corrupt_trace(tmp_path, trace_bytes):
    """A flipped byte in any member's compressed data fails the zip checksum, never loads."""
    with zipfile.ZipFile(io.BytesIO(trace_bytes)) as z:
        infos = z.infolist()
    for info in infos:
        raw = bytearray(trace_bytes)
        name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)  # local header
        raw[info.header_offset + 30 + name_len + extra_len + info.compress_size // 2] ^= 0x40
        (tmp_path / "bad.npz").write_bytes(raw)
        with pytest.raises(TraceError, match="damaged or truncated.*record it again"):
            read_trace(tmp_path / "bad.npz")


def test_not_a_trace(tmp_path):
    cases = {"junk": b"hello world, not a trace at all", "old.fttrace": b"FTTRACE\0" + bytes(16)}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    np.save(tmp_path / "array.npy", np.zeros(3))
    np.savez(tmp_path / "other.npz", ids=np.zeros((1, 2, 2), np.int16))
    for name, want in [("junk", "not an .npz"), ("old.fttrace", "version 1.*record it again"),
                       ("array.npy", "not an .npz holding"), ("other.npz", "not an .npz holding"),
                       ("missing.npz", "does not exist")]:
        with pytest.raises(TraceError, match=want):
            read_trace(tmp_path / name)
    with TraceWriter(tmp_path / "v.npz", META) as w:
        w.add([[0, 1], [1, 2]])
    with np.load(tmp_path / "v.npz") as npz:
        arrays = dict(npz)
    np.savez(tmp_path / "v.npz", **dict(arrays, version=np.uint32(VERSION + 1)))
    with pytest.raises(TraceError, match=f"version {VERSION + 1}; this freetoken reads version {VERSION}"):
        read_trace(tmp_path / "v.npz")
    np.savez(tmp_path / "v.npz", **dict(arrays, steps=np.zeros(2, np.uint32)))
    with pytest.raises(TraceError, match="damaged trace"):
        read_trace(tmp_path / "v.npz")
    assert rc.main([str(tmp_path / "junk")]) == 2


# ---------------------------------------------------------------- streams

def test_build_stream_example_and_prefill_filter():
    ids = np.array([[[2, 1], [0, 3]],      # prefill step 0, token 0
                    [[1, 3], [0, 1]],      # prefill step 0, token 1
                    [[2, 1], [0, 3]]])     # decode step 1
    meta = {"num_experts": 4, "phases": np.array([0, 0, 1], np.uint8),
            "steps": np.array([0, 0, 1], np.uint32)}
    assert rc.build_stream(meta, ids).items.tolist() == [1, 2, 4, 7]
    full = rc.build_stream(meta, ids, include_prefill=True)
    # the prefill step touches each of its experts once per layer
    assert full.items.tolist() == [1, 2, 3, 4, 5, 7, 1, 2, 4, 7] and full.split == 6


def naive_lru_misses(items, sizes, capacity, split):
    """One layer step at a time: its hits become most recent, then each miss evicts the least
    recent pair the step did not touch."""
    cache, misses, start = OrderedDict(), 0, 0
    for n in sizes:
        step = items[start:start + n]
        miss = [x for x in step if x not in cache]
        for x in step:
            if x in cache:
                cache.move_to_end(x)
        for x in miss:
            if len(cache) >= capacity:
                del cache[next(y for y in cache if y not in step)]
            cache[x] = True
        misses += len(miss) if start >= split else 0
        start += n
    return misses


def naive_layer_lru_misses(items, layer_caps, num_experts, split):
    caches = [OrderedDict() for _ in layer_caps]
    misses = 0
    for i, x in enumerate(items):
        cache, cap = caches[x // num_experts], layer_caps[x // num_experts]
        if x in cache:
            cache.move_to_end(x)
            continue
        misses += i >= split
        cache[x] = True
        if len(cache) > cap:
            cache.popitem(last=False)
    return misses


def brute_force_optimum(items, capacity):
    """Fewest misses over every eviction/bypass choice and every initial cache content."""
    distinct = sorted(set(items))
    best = len(items)
    for size in range(min(capacity, len(distinct)) + 1):
        for start in itertools.combinations(distinct, size):
            states = {frozenset(start): 0}
            for x in items:
                nxt = {}
                for state, cost in states.items():
                    if x in state:
                        options = [(state, cost)]
                    elif len(state) < capacity:
                        options = [(state | {x}, cost + 1), (state, cost + 1)]
                    else:
                        options = [(state - {y} | {x}, cost + 1) for y in state] + [(state, cost + 1)]
                    for s, c in options:
                        nxt[s] = min(nxt.get(s, c), c)
                states = nxt
            best = min(best, min(states.values()))
    return best


def small_streams(draw_max_tokens=30):
    @st.composite
    def strategy(draw):
        L = draw(st.integers(1, 3))
        E = draw(st.integers(1, 6))
        K = draw(st.integers(1, E))
        N = draw(st.integers(2, draw_max_tokens))
        seed = draw(st.integers(0, 2**16))
        ids = random_ids(np.random.default_rng(seed), N, L, E, K)
        return rc.build_stream(decode_meta(N, E), ids)
    return strategy()


@settings(max_examples=60, deadline=None)
@given(small_streams())
def test_belady_is_a_lower_bound_and_lru_matches_naive(stream):
    L, E = stream.num_layers, stream.num_experts
    K = int(stream.sizes.max())
    capacities = list(range(1, L * E + 1))
    misses, accesses = rc.replay([stream], capacities)
    assert accesses == stream.items.size - stream.split
    for j, cap in enumerate(capacities):
        for p in rc.POLICIES:
            assert 0 <= misses["belady"][j] <= misses[p][j] <= accesses, (p, cap)
        if cap >= K:  # a step's K pairs fit: the runtime's cache is never smaller
            naive = naive_lru_misses(stream.items.tolist(), stream.sizes.tolist(), cap, stream.split)
            assert misses["global_lru"][j] == naive
        per_layer = rc.layer_capacities(cap, L)
        naive_layer = naive_layer_lru_misses(stream.items.tolist(), per_layer, E, stream.split)
        assert misses["layer_lru"][j] == naive_layer


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=9), st.integers(1, 3))
def test_belady_equals_brute_force_optimum(items, capacity):
    assert rc.belady_misses(np.array(items), capacity) == brute_force_optimum(items, capacity)


def test_full_capacity_gives_only_compulsory_misses():
    rng = np.random.default_rng(1)
    ids = random_ids(rng, 40, 3, 16, 2)
    stream = rc.build_stream(decode_meta(40, 16), ids)
    misses, accesses = rc.replay([stream], [48])
    first_seen = {}
    for i, x in enumerate(stream.items.tolist()):
        first_seen.setdefault(x, i)
    compulsory = sum(i >= stream.split for i in first_seen.values())
    assert compulsory > 0  # the trace is short enough that some pairs appear late
    assert misses["global_lru"][0] == misses["layer_lru"][0] == compulsory
    assert misses["static"][0] == misses["layer_offload"][0] == misses["belady"][0] == 0


def test_layer_offload_math():
    L, E, K, N = 4, 8, 2, 30
    ids = random_ids(np.random.default_rng(2), N, L, E, K)
    stream = rc.build_stream(decode_meta(N, E), ids)
    caps = [1, 7, 8, 15, 16, 24, 31, 32]
    misses, accesses = rc.replay([stream], caps)
    for j, cap in enumerate(caps):
        resident_layers = cap // E
        assert misses["layer_offload"][j] == accesses * (L - resident_layers) // L
    # the resident layers are the last ones (llama.cpp -ngl): only layer 0 misses at 3 layers
    scored = stream.items[stream.split:]
    assert misses["layer_offload"][caps.index(24)] == np.count_nonzero(scored // E == 0)


def test_static_learns_on_first_half():
    # first half: only pair 0 and 1 of layer 0; second half: pair 0 and 2
    ids = np.array([[[0]]] * 4 + [[[1]]] * 2 + [[[0]]] * 3 + [[[2]]] * 3)
    stream = rc.build_stream(decode_meta(12, 4), ids)
    misses, _ = rc.replay([stream], [1, 2])
    assert misses["static"].tolist() == [3, 3]  # pair 2 was never frequent in the first half


# ---------------------------------------------------------------- synthetic + CLI

def test_synthetic_traces_are_valid_and_locality_helps():
    rates = {}
    for kind in ("uniform", "locality"):
        meta, ids = rc.synthetic_trace(kind, 300, 4, 16, 2, seed=5)
        again = rc.synthetic_trace(kind, 300, 4, 16, 2, seed=5)[1]
        np.testing.assert_array_equal(ids, again)
        assert ids.min() >= 0 and ids.max() < 16
        assert all(len(set(row)) == 2 for row in ids.reshape(-1, 2).tolist())
        misses, accesses = rc.replay([rc.build_stream(meta, ids)], [16])
        rates[kind] = misses["global_lru"][0] / accesses
    assert rates["locality"] < rates["uniform"] - 0.1


def test_cli_on_trace_files_and_png(tmp_path, capsys):
    meta = dict(META, num_layers=2, moe_layers=[0, 1])
    rng = np.random.default_rng(3)
    paths = []
    for n in range(2):
        path = tmp_path / f"{n}.npz"
        with TraceWriter(path, meta) as w:
            w.add_step(random_ids(rng, 6, 2, 6, 2), "prefill")
            for token in random_ids(rng, 20, 2, 6, 2):
                w.add(token)
        paths.append(str(path))
    png = tmp_path / "plot.png"
    code = rc.main(paths + ["--capacities", "10,50,100", "--png", str(png)])
    out, err = capsys.readouterr()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert code == 2 and "matplotlib" in err
        return
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "40 decode-only" in out and "SECOND HALF" in out
    assert all(p in out for p in rc.POLICIES) and len(out.strip().splitlines()) == 3 + 3 + 1


def test_cli_synthetic_and_errors(capsys):
    assert rc.main(["--synthetic", "uniform", "--tokens", "50", "--layers", "2", "--experts", "8",
                    "--top-k", "2", "--capacities", "25,100"]) == 0
    out = capsys.readouterr().out
    assert "100%     16" in out
    assert rc.main([]) == 2
    assert rc.main(["--synthetic", "uniform", "--capacities", "0,50"]) == 2
    assert rc.main(["--synthetic", "uniform", "--top-k", "99"]) == 2
    assert "error:" in capsys.readouterr().err
