"""`freetoken bench` through click's CliRunner on the bundled model (cpu, tiny -p/-n): the json,
csv and md outputs have a row per grid cell x test with llama-bench's fields and statistics, the
rows come from the engine's own timings, and every bad argument is one `error:` line + exit 2.
Also SamplingParams.ignore_eos, which the tg tests use: an EOS no longer ends a generation."""
import csv
import io
import itertools
import json
import statistics

import click
import pytest
from click.testing import CliRunner

from freetoken.api import default_model_path
from freetoken.bench import FIELDS
from freetoken.cli import bench, main
from freetoken.config import EngineConfig
from freetoken.engine import Engine
from freetoken.errors import ConfigError
from freetoken.sampling import SamplingParams

GRID = ["-p", "8,16", "-n", "4", "-r", "2", "--policy", "hybrid,cpu", "--expert-cache-gb", "0",
        "--expert-cache-frac", "0.5", "--parallel", "1,2"]
CELLS = {(gb, frac, policy) for (gb, frac), policy in
         itertools.product([(0.0, None), (None, 0.5)], ["hybrid", "cpu"])}
TESTS = [("pp8", 8, 0, 1), ("pp16", 16, 0, 1), ("tg4", 0, 4, 1), ("tg4 x2", 0, 4, 2)]


def invoke(args):
    return CliRunner().invoke(main, ["bench", "--device", "cpu"] + list(args))


@pytest.fixture(scope="module")
def json_rows():
    result = invoke(GRID + ["-o", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_json_rows_are_grid_x_tests(json_rows):
    assert len(json_rows) == len(CELLS) * len(TESTS)
    assert all(list(row) == list(FIELDS) for row in json_rows)
    cells = {}
    for row in json_rows:
        cells.setdefault((row["expert_cache_gb"], row["expert_cache_frac"], row["policy"]),
                         []).append((row["test"], row["n_prompt"], row["n_gen"],
                                     row["n_parallel"]))
    assert set(cells) == CELLS and all(tests == TESTS for tests in cells.values())
    for row in json_rows:
        rates = row["samples_ts"]
        assert row["repetitions"] == len(rates) == 2 and all(r > 0 for r in rates)
        assert row["avg_ts"] == pytest.approx(statistics.fmean(rates))
        assert row["stddev_ts"] == pytest.approx(statistics.stdev(rates))
        assert row["device"] == "cpu" and row["model"] == "default.ftw"
        assert row["build_version"] and row["cpu_info"] and row["torch_version"]
        if row["policy"] == "cpu" or row["expert_cache_gb"] == 0:
            assert row["bytes_filled"] == 0  # nothing cached: nothing copied
    decode = [r for r in json_rows if r["test"].startswith("tg4")]
    # half the experts cached under hybrid: some of the decode's routes hit it
    assert any(r["hit_rate"] for r in decode if r["expert_cache_frac"] == 0.5
               and r["policy"] == "hybrid")
    assert all(r["cpu_experts"] > 0 for r in decode if r["policy"] == "cpu")


def test_csv_has_the_same_rows():
    result = invoke(GRID[:6] + ["-o", "csv"])  # -p 8,16 -n 4 -r 2, default cache and policy
    assert result.exit_code == 0, result.output
    reader = csv.DictReader(io.StringIO(result.stdout))
    rows = list(reader)
    assert tuple(reader.fieldnames) == FIELDS
    assert [(r["test"], int(r["n_prompt"]), int(r["n_gen"]), int(r["n_parallel"]))
            for r in rows] == TESTS[:3]  # (no --parallel: one sequence)
    for r in rows:
        rates = [float(x) for x in r["samples_ts"].split(";")]
        assert len(rates) == int(r["repetitions"]) == 2
        assert float(r["avg_ts"]) == pytest.approx(statistics.fmean(rates), rel=1e-4)
        assert r["policy"] == "hybrid" and r["expert_cache_gb"] == r["expert_cache_frac"] == ""


def test_markdown_table_and_build_line():
    result = invoke(["-p", "8", "-n", "2", "-r", "2", "--policy", "offload,cpu"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("| model | size | device | policy | cache | test | t/s |")
    rows = [line for line in lines[2:] if line.startswith("| default.ftw")]
    assert [(r.split("|")[4].strip(), r.split("|")[6].strip()) for r in rows] == [
        ("offload", "pp8"), ("offload", "tg2"), ("cpu", "pp8"), ("cpu", "tg2")]
    assert all("±" in r for r in rows)
    assert lines[-1].startswith("build: freetoken ") and "| device: cpu" in lines[-1]
    assert "| CPU: " in lines[-1]


@pytest.mark.parametrize("args, needle", [
    (["-p", "8,x"], "-p/--n-prompt"),
    (["-n", "-1"], "-n/--n-gen"),
    (["-p", "0", "-n", "0"], "nothing to run"),
    (["-r", "0"], "-r/--repetitions"),
    (["-r", "2,3"], "-r/--repetitions"),
    (["--policy", "hybrid,fast"], "--policy"),
    (["--expert-cache-gb", "1,big"], "--expert-cache-gb"),
    (["--expert-cache-frac", "0.5,2"], "--expert-cache-frac"),
    (["-o", "xml"], "-o/--output"),
    (["--device", "tpu"], "--device"),
])
def test_bad_arguments_are_one_line_errors(args, needle):
    result = invoke(["-p", "8", "-n", "2", "-r", "1"] + args)
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert result.stdout == "" and "Traceback" not in result.output


def test_help_explains_every_option():
    text = CliRunner().invoke(main, ["bench", "--help"]).output
    for p in bench.params:
        if isinstance(p, click.Option):
            assert p.help, f"{p.name} has no help text"
            assert all(opt in text for opt in p.opts)


class OnlyEos:
    """A constraint that allows nothing but EOS (Engine.generate's constraint interface)."""

    def __init__(self, eos_id: int):
        self.eos_id = eos_id

    def mask(self, logits):
        keep = logits.new_full(logits.shape, float("-inf"))
        keep[self.eos_id] = 0
        return logits + keep

    def advance(self, token_id):
        pass


def test_ignore_eos_generates_exactly_max_tokens():
    with Engine(default_model_path(), EngineConfig(device="cpu", ctx_size=64)) as engine:
        eos = engine.tokenizer.eos_token_ids[0]
        ids = engine.tokenizer.encode("def f(x):")
        assert list(engine.generate(ids, SamplingParams(max_tokens=5, temperature=0),
                                    OnlyEos(eos))) == []
        assert engine.last_stats.stop_reason == "eos"
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        assert list(engine.generate(ids, params, OnlyEos(eos))) == [eos] * 5
        st = engine.last_stats
        assert (st.stop_reason, st.num_generated, st.num_decoded) == ("length", 5, 4)
    with pytest.raises(ConfigError, match="ignore_eos"):
        SamplingParams(ignore_eos=1)


def test_build_version_of_a_checkout_run_in_place(monkeypatch):
    """Without installed metadata (a checkout on PYTHONPATH) the version is the checkout's
    pyproject's, not 'unknown'."""
    import importlib.metadata
    import tomllib
    from pathlib import Path

    from freetoken import bench

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "version", missing)
    pyproject = Path(bench.__file__).resolve().parent.parent / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("an installed package: no pyproject beside it")
    want = tomllib.loads(pyproject.read_text())["project"]["version"]
    assert bench.machine_info()["build_version"] == want
