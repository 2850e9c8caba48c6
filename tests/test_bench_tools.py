"""Smoke tests of tools/bench_decode.py and tools/bench_prefill.py on tiny shapes with --device cpu
(bench_decode also on each bench_shapes.py shape, --shape), and checks of their routing
workloads (tools/bench_routing.py) and static placement."""
import re

import numpy as np
import pytest

import bench_decode
import bench_moe_setup as setup
import bench_prefill
import bench_routing as routing

TINY = ["--device", "cpu", "--layers", "3", "--experts", "16", "--hidden", "64", "--inter", "32",
        "--top-k", "4", "--vocab", "97", "--heads", "2", "--kv-heads", "1", "--head-dim", "32"]


@pytest.mark.parametrize("name", routing.WORKLOADS)
def test_traces_route_k_distinct_experts_with_normalised_weights(name):
    tr = routing.make_trace(name, 40, 3, 16, 4, seed=5)
    assert tr.expert_ids.shape == tr.weights.shape == (40, 3, 4)
    assert tr.expert_ids.min() >= 0 and tr.expert_ids.max() < 16
    assert all(len(set(row)) == 4 for row in tr.expert_ids.reshape(-1, 4).tolist())
    np.testing.assert_allclose(tr.weights.sum(-1), 1.0, rtol=1e-5)
    again = routing.make_trace(name, 40, 3, 16, 4, seed=5)
    assert (again.expert_ids == tr.expert_ids).all()


def test_locality_trace_reproduces_the_published_lru_hit_rates():
    """Per-layer LRU at 12.5% / 25% of 128 experts (top-8) hits ~67% / ~81% (LOCALITY's
    calibration); the uniform workload hits only what the cache's share gives."""
    loc = routing.locality_trace(600, 3, 128, 8, seed=1).expert_ids
    assert 0.60 < routing.lru_hit_rate(loc, 16) < 0.74
    assert 0.75 < routing.lru_hit_rate(loc, 32) < 0.88
    uni = routing.uniform_trace(600, 3, 128, 8, seed=1).expert_ids
    assert 0.09 < routing.lru_hit_rate(uni, 16) < 0.16
    assert routing.distinct_per_layer(uni[:512]) == [128, 128, 128]


def test_lru_hit_rate_on_a_hand_made_trace():
    ids = np.array([[[0, 1]], [[1, 2]], [[0, 3]], [[3, 1]]])  # [T=4, L=1, K=2]
    # capacity 2: t1 hits 1; t2 (LRU holds 2, 1) misses both; t3 (holds 3, 0) hits 3
    assert routing.lru_hit_rate(ids, 2) == pytest.approx(2 / 8)


def test_static_placement_splits_the_cache_over_layers_by_frequency():
    ids = np.array([[[5, 1], [2, 3]], [[5, 2], [2, 0]], [[5, 1], [4, 2]]])  # [T=3, L=2, K=2]
    got = setup.static_placement(ids, [0, 1], 8, 3)
    assert got == {0: [1, 5], 1: [2]}


def _rows(text, first_col):
    return [line.split() for line in text.splitlines() if line.split()[:1] == [first_col]]


def test_bench_decode_tiny_cpu(capsys):
    bench_decode.main(TINY + ["--cache-fracs", "0.25,0.5", "--history", "16", "--warmup", "2",
                              "--tokens", "4", "--prefill-lengths", "16"])
    text = capsys.readouterr().out
    assert "FAILED" not in text and "skipped" not in text
    assert re.search(r"uniform: distinct experts per layer in a 512-token batch \(of 16\): min 16", text)
    rows = {(r[0], r[1], r[2]): r for r in _rows(text, "25%") + _rows(text, "50%") + _rows(text, "0%")}
    for frac in ("25%", "50%"):
        for wl in routing.WORKLOADS:
            for policy in ("hybrid", "paper", "offload", "static", "limit"):
                assert (frac, wl, policy) in rows, (frac, wl, policy)
            assert rows[(frac, wl, "offload")][6] == "1.00"  # q/m: every miss filled
            static = rows[(frac, wl, "static")]
            assert static[6] == "0.00" and float(static[7]) == 0.0  # never fills
    for wl in routing.WORKLOADS:
        cpu = rows[("0%", wl, "cpu")]
        assert cpu[5] == "0.0%" and cpu[8] == cpu[9]  # no hits: every expert on the CPU
    assert "summary" in text and "T_gpu (every expert resident)" in text
    assert re.search(r"25% +locality +hybrid .*token sync \d+ us; ", text)  # the step's end
    plain = [r for r in _rows(text, "100%") if r[2] == "plain"]  # the machinery's baseline row
    assert len(plain) == 1 and float(plain[0][3]) > 0 and plain[0][5] == "100.0%"
    assert re.search(r"machinery: T_gpu / plain resident experts \([\d.]+ ms/token\) = [\d.]+ \(goal <= 1.2\)", text)
    assert len(_table(text, ["tokens", "bufs", "stream"])) == 1  # the prefill table on the same banks


def test_bench_decode_full_cache_static_and_a_named_cpu_row(capsys):
    """At --cache-fracs 1 the static row is every expert resident (no second placement), and
    cpu named in --policies is the one cache-independent CPU-only row, not a q = 0 row over a
    cache that holds everything."""
    bench_decode.main(TINY + ["--cache-fracs", "1", "--workloads", "uniform", "--history", "4",
                              "--warmup", "1", "--tokens", "2", "--policies", "hybrid,cpu,static"])
    text = capsys.readouterr().out
    assert "FAILED" not in text
    rows = _rows(text, "100%") + _rows(text, "0%")
    static = next(r for r in rows if r[2] == "static")
    assert static[5] == "100.0%"  # hit rate: every expert resident
    cpus = [r for r in rows if r[2] == "cpu"]
    assert len(cpus) == 1 and cpus[0][0] == "0%" and cpus[0][5] == "0.0%"


def test_bench_decode_a_failing_config_does_not_end_the_table(capsys, monkeypatch):
    real = bench_decode.DecodeBench.run

    def run(self, policy, frac, trace, placement=None, graphs=True):
        if policy == "static":
            raise RuntimeError("boom")
        return real(self, policy, frac, trace, placement, graphs)
    monkeypatch.setattr(bench_decode.DecodeBench, "run", run)
    bench_decode.main(TINY + ["--cache-fracs", "0.25", "--workloads", "uniform", "--history", "4",
                              "--warmup", "1", "--tokens", "2"])
    text = capsys.readouterr().out
    assert "25% uniform   static   FAILED: RuntimeError: boom" in text
    assert [r[2] for r in _rows(text, "25%")][:5] == ["hybrid", "paper", "offload", "static",
                                                     "limit"]
    assert re.search(r"25% uniform( +[\d.]+){4} +nan", text)  # summary: no static


def test_bench_decode_context(capsys, monkeypatch):
    """--context N: every config's decode starts with N tokens cached (random KV, no prefill)."""
    real, starts = bench_decode.DecodeBench.decode, []

    def decode(self, n, step=None):
        starts.append(self.kv.num_tokens)
        return real(self, n, step)
    monkeypatch.setattr(bench_decode.DecodeBench, "decode", decode)
    bench_decode.main(TINY + ["--cache-fracs", "0.25", "--workloads", "uniform", "--history", "4",
                              "--warmup", "1", "--tokens", "2", "--policies", "hybrid",
                              "--context", "24"])
    text = capsys.readouterr().out
    assert "KV context grows 24..27" in text and "FAILED" not in text
    assert starts[0::2] == [24] * (len(starts) // 2) and starts[1::2] == [25] * (len(starts) // 2)


# the default run's shape (conftest.py: the others are marked slow): the hybrid's state;
# qwen3_moe's rows are test_bench_decode_tiny_cpu's, gpt_oss's banks
# test_plain_resident_runs_the_banks_activation_and_biases'
SUITE_CELLS = {"test_bench_decode_with_shape": [{"name": "qwen3.6-35b-a3b"}]}
SHAPE_SIZES = {"qwen3-30b-a3b": ["--layers", "2"], "qwen3.6-35b-a3b": ["--layers", "4"],
               "gpt-oss-20b": ["--layers", "2"]}  # qwen3.6: its 4th layer is full attention


def _shape_decode(name, device, capsys, *more):
    """bench_decode --shape NAME --tiny: issue 34's rows at 25% cache, both workloads."""
    from bench_shapes import shape_config
    bench_decode.main(["--device", device, *more, "--shape", name, "--tiny", *SHAPE_SIZES[name],
                       "--experts", "16", "--cache-fracs", "0.25", "--history", "4", "--warmup",
                       "1", "--tokens", "2", "--context", "3", "--policies",
                       "hybrid,offload,static"])
    text = capsys.readouterr().out
    assert "FAILED" not in text and "skipped" not in text
    family = shape_config(name)["model_type"]
    assert f"{name} ({family}) random bf16" in text and f"the real {family} layers" in text
    assert "KV context grows 3..6" in text
    rows = {(r[0], r[1], r[2]): r for r in _rows(text, "25%") + _rows(text, "0%") + _rows(text, "100%")}
    for wl in routing.WORKLOADS:
        for policy in ("hybrid", "offload", "static", "limit"):
            assert ("25%", wl, policy) in rows, (wl, policy)
        assert rows[("25%", wl, "offload")][6] == "1.00"  # q/m: every miss filled
        assert float(rows[("25%", wl, "static")][7]) == 0.0  # never fills
        assert rows[("0%", wl, "cpu")][5] == "0.0%"
    wl0 = routing.WORKLOADS[0]
    assert rows[("100%", wl0, "resident")][5] == rows[("100%", wl0, "plain")][5] == "100.0%"
    assert re.search(r"machinery: T_gpu / plain resident experts \([\d.]+ ms/token\) = [\d.]+", text)
    return text


@pytest.mark.parametrize("name", sorted(SHAPE_SIZES))
def test_bench_decode_with_shape(name, capsys):
    """bench_decode --shape on each family's real model with the synthetic weights and banks:
    the hybrid's recurrent state is passed and kept with the KV cache (the model refuses a
    missing one, asserts one apart: a FAILED row), gpt_oss's experts as its banks carry them."""
    _shape_decode(name, "cpu", capsys)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SHAPE_SIZES))
def test_bench_decode_with_shape_cuda(name, capsys):
    """On cuda the rows replay captured steps (the hybrid's state copied in and out of the
    captured row), the plain resident row its one graph."""
    text = _shape_decode(name, "cuda", capsys, "--no-calibrate")
    assert re.search(r"100% \S+ +plain .* graphs ", text)
    assert re.search(r"25% locality +hybrid .* graphs \[", text)


def test_plain_resident_runs_the_banks_activation_and_biases():
    """PlainResident (the T_gpu baseline) on gpt_oss's banks equals the engine's runtime with
    every expert cached: the clamped SwiGLU of check_act and the slots' biases (with the
    default SiLU it does not)."""
    import torch
    from bench_host_banks import FileBanks
    from bench_shapes import SyntheticFile
    from freetoken import profile
    from freetoken.config import EngineConfig, ModelConfig
    from freetoken.experts import create_expert_runtime
    from freetoken.experts.ffn import check_act
    hb = FileBanks(SyntheticFile("gpt-oss-20b", layers=2, experts=8, tiny=True))
    mc = ModelConfig.from_dict(hb.file.config)
    ec = EngineConfig(device="cpu", policy="hybrid", expert_cache_frac=1.0)
    rt = create_expert_runtime(hb.banks, mc, ec, "cpu", torch.float32,
                               profile.expert_rates(hb.banks, ec, "cpu"))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, mc.hidden_size, generator=gen)
    ids = torch.tensor([[0, 3, 5, 7], [1, 2, 3, 4], [6, 5, 0, 1]])
    w = torch.softmax(torch.randn(3, 4, generator=gen), -1)
    layer = mc.moe_layers[1]
    try:
        rt.begin_step("prefill", 3)
        want = rt.forward(layer, x, ids, w)
    finally:
        rt.close()
    got = setup.PlainResident(hb, "cpu", check_act(mc)).forward(layer, x, ids, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    silu = setup.PlainResident(hb, "cpu").forward(layer, x, ids, w)
    assert (silu - want).abs().max() > 0.01


def test_bench_decode_shape_refuses_prefill_lengths(capsys):
    with pytest.raises(SystemExit):
        bench_decode.parse_args(["--shape", "gpt-oss-20b", "--prefill-lengths", "16"])
    assert "leave it out with --shape" in capsys.readouterr().err


def _table(text, header_start):
    """Rows (split) of the table whose header line starts with header_start."""
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.split()[:len(header_start)] == header_start)
    rows = []
    for line in lines[i + 2:]:  # header, dashes
        if not line.strip() or not line.split()[0].isdigit():
            break
        rows.append(line.split())
    return rows


def test_bench_prefill_tiny_cpu(capsys):
    bench_prefill.main(TINY + ["--lengths", "16,48", "--buffers", "2,3", "--crossover", "4,16"])
    text = capsys.readouterr().out
    assert "FAILED" not in text and "NOT streamed" not in text
    rows = _table(text, ["tokens", "bufs", "stream"])
    assert [(r[0], r[1]) for r in rows] == [("16", "2"), ("16", "3"), ("48", "2"), ("48", "3")]
    assert all(r[-2] == "3" for r in rows)  # every MoE layer streamed once per forward
    assert "# 3 layer buffers:" in text
    assert "# experts: as the cpu tier does (no grouped kernels off cuda)" in text
    timeline = _table(text, ["tokens", "bufs", "wall"])
    assert [(r[0], r[1]) for r in timeline] == [(r[0], r[1]) for r in rows]
    for r in timeline:
        wall, lead, busy, idle, buf_wait, host_late, tail = map(float, r[2:9])
        assert wall == pytest.approx(lead + busy + idle + tail, abs=0.3)  # printed to 0.1 ms
        assert idle == pytest.approx(buf_wait + host_late, abs=0.2)
        assert float(r[9]) > 0 and float(r[11]) > 0  # GB/s in copies, expert ms per layer
    cross = _table(text, ["tokens", "distinct"])
    assert [r[0] for r in cross] == ["4", "16"]
    for r in cross:  # streamed/planned layers of the auto runtime; the fastest of the three
        assert sum(map(int, r[3].split("/"))) == 3 and r[7] in ("auto", "stream", "slot")
        times = dict(zip(("auto", "stream", "slot"), map(float, r[4:7])))
        assert times[r[7]] <= min(times.values()) + 0.001 and float(r[8]) >= 1.0  # printed to 1 ms
        assert float(r[10]) > 0 and float(r[11]) >= 0  # model: every layer streamed, planned
    assert re.search(r"# fastest: stream at .+, slot at .+, auto at .+ \(tokens\)", text)
    assert re.search(r"CPU experts \d+ GFLOP/s \(measured", text)


def test_decode_row_names():
    """bench_decode's row names: admissions (admitN, capped admitN/M), the paper's split without
    admissions, diagnostics and tunings (X+suffix) and thread counts (X#N); bad names end the
    run with a message."""
    from decode_rows import row_spec
    r = row_spec("admit1/4")
    assert (r.kind, r.behind, r.tuning, r.env) == ("hybrid", 1, {"fill_behind_max_misses": 4}, {})
    assert (row_spec("paper").behind, row_spec("hybrid").behind) == (0, None)
    assert row_spec("static").kind == "cpu" and row_spec("offload").env == {}
    r = row_spec("hybrid+trace#14")  # a diagnostic, a row's thread count
    assert (r.kind, r.behind, r.threads, r.tuning) == ("hybrid", None, 14, {"serve_trace": True})
    assert row_spec("paper+nocpu").tuning == {"serve_skip_jobs": True}
    assert (row_spec("offload#2").threads, row_spec("offload").threads) == (2, None)
    assert row_spec("hybrid+defer12").tuning == {"admit_defer": 12}
    assert row_spec("admit1/3+defer0").tuning == {"admit_defer": 0, "fill_behind_max_misses": 3}
    assert row_spec("hybrid+pf8192#13").env == {"FREETOKEN_KERNEL_TUNE": "prefetch=8192"}
    for bad in ("admit1/x", "nosuch", "hybrid+nosuch", "hybrid#0", "hybrid#x", "hybrid+defer",
                "hybrid+deferx", "hybrid+deferauto", "hybrid+pf", "hybrid+pfx", "host",
                "observe", "late1", "idle1", "hybrid+sdpa", "hybrid+kvcopy", "hybrid+cublas",
                "admit1@8", "hybrid+msig", "hybrid:ceil"):  # the last: removed rows
        with pytest.raises(SystemExit):
            row_spec(bad)


def _summary_input():
    """A fixed results table (one round per config) in summary()'s form, T_gpu 25 ms."""
    results = {}
    for frac, base in ((0.25, 10.0), (0.5, 20.0)):
        for wl, m in (("uniform", 1.0), ("locality", 1.5)):
            for row, times in (("hybrid", 2), ("paper", 1.5), ("offload", 1)):
                results[(frac, wl, row)] = [{"s_per_tok": 1 / (base * m * times), "misses": 2.0}]
            results[(frac, wl, "cpu")] = [{"s_per_tok": 1 / (8.0 * m), "misses": 2.0}]
            results[(frac, wl, "limit")] = [{"s_per_tok": 1 / (base * m * 2.5)}]
    results[(0.5, "uniform", "static")] = [{"s_per_tok": 1 / 25.0, "misses": 2.0}]
    results[(1.0, "uniform", "plain")] = [{"s_per_tok": 1 / 50.0, "misses": 0.0}]
    return results, [{"s_per_tok": 0.025}]


def test_decode_summary_of_single_rounds_is_unchanged():
    """--repeat 1: the summary is the one printed before --repeat existed (same input, same text)."""
    from decode_rows import summary
    results, resident = _summary_input()
    got = summary(results, [0.25, 0.5], ["uniform", "locality"], resident,
                  ["hybrid", "paper", "offload", "static"])
    assert got == (
        "\nsummary (tok/s; ratios of tok/s; T_hyb/T_lim = hybrid time / limit-model time)\n"
        " cache workload    hybrid    paper  offload      cpu   static    limit  hyb/off  hyb/cpu hyb/best Thyb/Tlim\n"
        "   25% uniform      20.00    15.00    10.00     8.00      nan    25.00     2.00     2.50     2.00      1.25\n"
        "   25% locality     30.00    22.50    15.00    12.00      nan    37.50     2.00     2.50     2.00      1.25\n"
        "   50% uniform      40.00    30.00    20.00     8.00    25.00    50.00     2.00     5.00     1.60      1.25\n"
        "   50% locality     60.00    45.00    30.00    12.00      nan    75.00     2.00     5.00     2.00      1.25\n"
        "goals: uniform 25%: hyb/off >= 2.0, hyb/cpu >= 1.4, Thyb/Tlim <= 1.3; locality: hyb/best >= 1.3 "
        "(best of offload, cpu, static)\n"
        "T_gpu (every expert resident) = 25.00 ms/token\n"
        "machinery: T_gpu / plain resident experts (20.00 ms/token) = 1.25 (goal <= 1.2)")


def test_decode_summary_takes_each_rows_median_and_prints_its_spread():
    """Rounds of a config: the median tok/s (an even count: the mean of the middle two) in the
    summary, misses the mean, and a spread table of (max - min) / median in %."""
    from decode_rows import median_row, summary
    rounds = lambda *tps: [{"s_per_tok": 1 / t, "misses": t / 10, "hit": t} for t in tps]  # noqa: E731
    hybrid = rounds(10.0, 30.0, 12.0)
    med = median_row(hybrid)
    assert 1 / med["s_per_tok"] == pytest.approx(12.0) and med["hit"] == 12.0  # the median round's fields
    assert med["misses"] == pytest.approx((1.0 + 3.0 + 1.2) / 3) and med["rounds"] == 3
    assert med["spread"] == pytest.approx(20 / 12)
    assert 1 / median_row(rounds(4.0, 6.0, 100.0, 1.0))["s_per_tok"] == pytest.approx(5.0)
    results = {(0.5, "locality", "hybrid"): hybrid, (0.5, "locality", "offload"): rounds(4.0, 6.0, 5.5),
               (0.5, "locality", "cpu"): rounds(3.0),  # one round only ran
               (0.5, "locality", "limit"): [{"s_per_tok": 1 / 20.0}],
               (1.0, "locality", "plain"): rounds(40.0, 50.0, 60.0)}
    resident = [{"s_per_tok": s} for s in (0.02, 0.05, 0.025)]
    text = summary(results, [0.5], ["locality"], resident, ["hybrid", "offload"])
    assert "summary (median tok/s of 3 rounds;" in text
    assert re.search(r"50% locality +12\.00 +5\.50 +3\.00 +nan +20\.00 +2\.18 +4\.00 ", text)
    assert "T_gpu (every expert resident) = 25.00 ms/token" in text
    assert "plain resident experts (20.00 ms/token) = 1.25" in text
    assert "spread over 3 rounds" in text
    spreads = [line.split() for line in text.splitlines()[text.splitlines().index(
        next(line for line in text.splitlines() if line.startswith("spread over"))) + 1:]]
    assert spreads[0] == ["cache", "workload", "hybrid", "offload", "cpu", "static"]
    assert spreads[1] == ["50%", "locality", "166.7", "36.4", "0.0(1)", "nan"]
    assert spreads[2] == ["spread,", "%:", "T_gpu", "(resident)", "75.0;", "plain", "40.0"]


def test_bench_decode_repeat_rejects_zero_rounds(capsys):
    with pytest.raises(SystemExit) as e:
        bench_decode.parse_args(["--repeat", "0"])
    assert e.value.code == 2
    assert "--repeat takes a number of rounds N >= 1, got 0" in capsys.readouterr().err
    assert bench_decode.parse_args([]).repeat == 1


def test_bench_decode_repeat_runs_rounds_interleaved(capsys):
    """--repeat 2: each config's rows run round by round (A, B, A, B), each row noted #r/2; the
    summary holds the median (here the mean of the two) and a spread table follows."""
    bench_decode.main(TINY + ["--cache-fracs", "0.5", "--workloads", "locality", "--history", "4",
                              "--warmup", "1", "--tokens", "2", "--policies", "hybrid,offload",
                              "--repeat", "2"])
    text = capsys.readouterr().out
    assert "FAILED" not in text and "skipped" not in text
    rows = [line for line in text.splitlines() if line.split()[:2] == ["50%", "locality"]]
    table = [(line.split()[2], re.search(r"#\d/2", line).group()) for line in rows[:4]]
    assert table == [("hybrid", "#1/2"), ("offload", "#1/2"), ("hybrid", "#2/2"), ("offload", "#2/2")]
    assert "mean of 2 rounds" in rows[4] and rows[4].split()[2] == "limit"
    hybrid = [float(line.split()[3]) for line in rows[:4:2]]
    summary_row = rows[-2].split()
    assert summary_row[:2] == ["50%", "locality"]
    assert float(summary_row[2]) == pytest.approx(sum(hybrid) / 2, abs=0.01)
    assert [r[2] for r in _rows(text, "0%")] == ["cpu", "cpu"]
    assert len([r for r in _rows(text, "100%") if r[2] == "plain"]) == 2
    assert "spread over 2 rounds" in text and "spread, %: T_gpu (resident)" in text


def test_step_misses_counts_every_layer_step():
    """The global-LRU replay behind `bench_routing.py`: every (token, layer) step counted once
    by its misses; a cache holding everything misses only on first touches, none misses all."""
    tr = routing.make_trace("locality", 40, 3, 16, 4, seed=1)
    c = routing.step_misses(tr.expert_ids, 16, 3 * 16 // 4, warm=10)
    assert c.sum() == 30 * 3 and len(c) == 5
    assert routing.step_misses(tr.expert_ids, 16, 0).tolist() == [0, 0, 0, 0, 40 * 3]
    full = routing.step_misses(tr.expert_ids, 16, 3 * 16)
    assert (full * np.arange(5)).sum() == len(np.unique(tr.expert_ids[:, 0])) + len(
        np.unique(tr.expert_ids[:, 1])) + len(np.unique(tr.expert_ids[:, 2]))


def test_row_legend_names_every_row_switch(capsys):
    """decode_rows.ROWS keeps up with the switches row_spec knows, and bench_decode --help
    prints it."""
    from decode_rows import POLICIES, ROWS, SUFFIX_TUNING
    for suffix in SUFFIX_TUNING:
        assert f"X+{suffix}" in ROWS, suffix
    for name in POLICIES:
        assert name.replace("/M", "").split("@")[0] in ROWS, name
    with pytest.raises(SystemExit):
        bench_decode.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "X+nocpu  row X" in text and "{rows}" not in text


def test_bench_agent_reuses_each_turns_prefix(capsys):
    """tools/bench_agent.py on the bundled model: from turn 2 on, every turn takes at least the
    previous turn's prompt from the prefix cache, to the token (their timing is printed, not
    checked)."""
    import bench_agent
    rows = bench_agent.main(["--device", "cpu", "--system", "70", "--turns", "3",
                             "--tool", "8,16", "--reply", "2,4", "--from", "2"])
    assert [r[0] for r in rows] == [1, 2, 3] and rows[0][2] == 0
    for (_, prompt, cached, _, _), (_, before, _, _, _) in zip(rows[1:], rows):
        assert before <= cached < prompt
    assert "of prompt tokens from the cache" in capsys.readouterr().out


def test_bench_cli_cells_runs_freetoken_bench_on_a_shape(capsys):
    """tools/bench_cli_cells.py: `freetoken bench`'s rows on a bench shape without an .ftw file
    (run_bench reopens the synthetic file for each cell), the model's size its tensors and banks."""
    import bench_cli_cells
    bench_cli_cells.main(["--shape", "qwen3-30b-a3b", "--tiny", "--layers", "2", "--device", "cpu",
                          "-p", "8", "-n", "4", "-r", "1", "--policy", "cpu,hybrid"])
    text = capsys.readouterr().out
    rows = re.findall(r"^\| synthetic:qwen3-30b-a3b \| ([\d.]+) MiB \| cpu \| (\w+) \| 0.25 of experts "
                      r"\| (pp8|tg4) \| [\d.]+ ± ", text, re.M)
    assert [(p, t) for _, p, t in rows] == [("cpu", "pp8"), ("cpu", "tg4"), ("hybrid", "pp8"),
                                            ("hybrid", "tg4")], text
    assert float(rows[0][0]) > 0
