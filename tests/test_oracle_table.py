"""The oracle table (oracle_table.py): the markdown of given records (worst diff per policy and
cache, greedy yes/no/n/a, failures marked, NaN kept), and a pytest run with --oracle-table
writing the values its tests recorded, a failing test's too; without the option, no file."""
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from oracle_table import Record, markdown

TESTS = Path(__file__).resolve().parent


def rows(text):
    """{family: [cells]} of the markdown tables' rows (first table first)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| family"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            out.setdefault(cells[0], []).append(cells[1:])
    return out


def test_markdown_of_records():
    records = [Record("qwen3_moe", "cpu", "hybrid", "few", "logits decode", diffs=[2e-7, 5e-7]),
               Record("qwen3_moe", "cpu", "hybrid", "all", "greedy", greedy=[True, None]),
               Record("qwen3_moe", "cpu", "offload", "all", "logits prefill", diffs=[3e-3],
                      outcome="failed"),
               Record("qwen3_moe", "cpu", "cpu", "none", "greedy", greedy=[None]),
               Record("mixtral", "cpu", "cpu", "none", "logits chunked", diffs=[math.nan],
                      greedy=[False], outcome="failed"),
               Record("mixtral", "cuda", "hybrid", "few", "logits decode", outcome="skipped")]
    text = markdown(records, {"torch": "2.13.0", "transformers": "5.24.0"})
    assert text.splitlines()[0] == "torch 2.13.0, transformers 5.24.0"
    assert "cpu: 5 tests, 3 passed, 2 failed, 0 skipped" in text
    table = rows(text)
    by_policy, by_cache = table["qwen3_moe"][0], table["qwen3_moe"][1]
    assert by_policy == ["5.0e-07 · yes", "3.0e-03 · n/a **1 FAILED**", "n/a · n/a", "3/4",
                         "logits prefill, cache all, offload"]
    assert by_cache == ["n/a · n/a", "5.0e-07 · n/a", "3.0e-03 · yes **1 FAILED**"]  # none few all
    assert table["mixtral"][:2] == [["–", "–", "nan · no **1 FAILED**", "0/1", "logits chunked, "
                                     "cache none, cpu"], ["nan · no **1 FAILED**", "–", "–"]]
    assert table["mixtral"][2:] == [["skipped", "–", "–", "0/1", "–"], ["skipped"]]  # cuda
    assert "cuda: 1 tests, 0 passed, 0 failed, 1 skipped" in text


INNER = '''
import pytest

@pytest.mark.parametrize("policy", ["hybrid", "cpu"])
@pytest.mark.parametrize("fam", ["tiny"])
def test_logits(fam, policy, oracle):
    value = 2e-3 if policy == "cpu" else 1e-6
    oracle.diff(value)
    assert value <= 1e-4

@pytest.mark.parametrize("fam", ["tiny"])
def test_greedy(fam, oracle):
    oracle.at(cache="few").tokens([1, 2], [1, 2])
'''


def run_inner(tmp_path, *args):
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER))
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",  # (seconds to load them)
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "oracle_table",
                           "-p", "no:cacheprovider", "test_inner.py", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_run_writes_what_its_tests_recorded(tmp_path):
    done = run_inner(tmp_path, "--oracle-table=table.md")
    assert done.returncode == 1 and "1 failed, 2 passed" in done.stdout, done.stdout + done.stderr
    text = (tmp_path / "table.md").read_text()
    assert "transformers " in text.splitlines()[0]
    assert "cpu: 3 tests, 2 passed, 1 failed, 0 skipped" in text
    assert rows(text)["tiny"][0] == ["1.0e-06 · yes", "–", "2.0e-03 · n/a **1 FAILED**", "2/3",
                                     "logits, cache default, cpu"]


def test_without_the_option_nothing_is_written(tmp_path):
    done = run_inner(tmp_path)
    assert "1 failed, 2 passed" in done.stdout, done.stdout + done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test_inner.py"]
