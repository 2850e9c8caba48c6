"""`freetoken run` through click's CliRunner on the bundled model: streaming output, stdin
prompts, timing lines, stop strings, traces, and every bad input as one `error:` line + exit 2."""
import dataclasses

import click
import numpy as np
import pytest
from click.testing import CliRunner

from freetoken.api import default_model_path
from freetoken.cli import main, run
from freetoken.config import EngineConfig
from freetoken.sampling import SamplingParams

BASE = ["run", "--device", "cpu", "-n", "12"]


def invoke(args, **kw):
    return CliRunner().invoke(main, BASE + list(args), **kw)


def assert_usage_error(result, *needles):
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_help_explains_every_option():
    text = CliRunner().invoke(main, ["run", "--help"]).output
    for p in run.params:
        if isinstance(p, click.Option):
            assert p.help, f"{p.name} has no help text"
            assert all(opt in text for opt in p.opts)


def test_defaults_agree_with_the_dataclasses():
    defaults = {p.name: p.default for p in run.params}
    for f in dataclasses.fields(SamplingParams):
        if f.name in defaults and f.name != "stop":
            assert defaults[f.name] == f.default, f.name
    for f in dataclasses.fields(EngineConfig):
        if f.name in defaults:
            assert defaults[f.name] == f.default, f.name


def test_run_bundled_model_prints_text_and_timings():
    result = invoke(["-p", "hello", "--temp", "0", "--stats"])
    assert result.exit_code == 0, result.output
    assert result.stdout.endswith("\n")
    err = result.stderr
    for key in ("load time", "prompt eval", "time to first", "eval ", "tokens per second",
                "expert cache", "hit rate", "GB filled", "on the CPU", "expert stats"):
        assert key in err, (key, err)
    assert "12 tokens" in err or "stopped by     = eos" in err


def test_prompt_from_stdin_equals_prompt_option():
    direct = invoke(["-p", "the expert cache", "--temp", "0"])
    piped = invoke(["-p", "-", "--temp", "0"], input="the expert cache")
    assert direct.exit_code == piped.exit_code == 0
    assert direct.stdout == piped.stdout


def test_seed_reproducible():
    a = invoke(["-p", "hello", "--temp", "1.0", "--seed", "11", "--top-k", "0"])
    b = invoke(["-p", "hello", "--temp", "1.0", "--seed", "11", "--top-k", "0"])
    assert a.exit_code == b.exit_code == 0 and a.stdout == b.stdout


def prompt_tokens(result):
    assert result.exit_code == 0, result.output
    return int(result.stderr.split("ms /")[1].split("tokens")[0])


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny random qwen3_moe with a chat template (the bundled model has none)."""
    import make_tiny_model
    from ftw.convert import convert
    tmp = tmp_path_factory.mktemp("chat")
    src = make_tiny_model.build(tmp / "hf", family="qwen3_moe", seed=7)
    return str(convert(str(src), str(tmp / "chat.ftw"), progress=False))


def test_raw_skips_chat_template(chat_model):
    chat = invoke([chat_model, "-p", "hello", "--temp", "0", "-n", "1"])
    raw = invoke([chat_model, "-p", "hello", "--temp", "0", "-n", "1", "--raw"])
    assert prompt_tokens(chat) > prompt_tokens(raw) >= 1  # the template adds role markers


def test_bundled_model_takes_prompts_raw():
    # trained on source code only, it ships without a chat template: no role markers added
    chat = invoke(["-p", "def f(x):", "--temp", "0", "-n", "4"])
    raw = invoke(["-p", "def f(x):", "--temp", "0", "-n", "4", "--raw"])
    assert prompt_tokens(chat) == prompt_tokens(raw) and chat.stdout == raw.stdout


def test_stop_string_cuts_output():
    full = invoke(["-p", "hello", "--temp", "0", "--raw", "-n", "24"]).stdout.rstrip("\n")
    visible = full.strip()
    assert len(visible) >= 6, "the bundled model's greedy text is too short to cut"
    stop = visible[len(visible) // 2:len(visible) // 2 + 2]
    cut = invoke(["-p", "hello", "--temp", "0", "--raw", "-n", "24", "--stop", stop])
    assert cut.exit_code == 0
    assert cut.stdout.rstrip("\n") == full[:full.index(stop)]


def test_trace_out_records_every_forwarded_token(tmp_path):
    from freetoken.trace import read_trace
    path = tmp_path / "run.npz"
    result = invoke(["-p", "hello", "--raw", "--temp", "0", "-n", "6", "--trace-out", str(path)])
    assert result.exit_code == 0, result.output
    meta, ids = read_trace(path)
    L, K = len(meta["moe_layers"]), meta["top_k"]
    assert ids.shape[1:] == (L, K) and 0 <= ids.min() and ids.max() < meta["num_experts"]
    assert (meta["phases"] == 0).sum() == meta["num_prompt_tokens"] == len(meta["prompt_token_ids"])
    # every sampled token but the last is fed back: one decode step each
    assert (meta["phases"] == 1).sum() == len(meta["generated_token_ids"]) - 1
    assert all(len(set(row)) == K for row in ids.reshape(-1, K).tolist())  # distinct top-k
    assert np.all(np.diff(meta["steps"].astype(int)) >= 0)


@pytest.mark.parametrize("args, needles", [
    (["-n", "0"], ["-n", ">= 1"]),
    (["--temp", "-1"], ["--temp", ">= 0"]),
    (["--top-p", "1.5"], ["--top-p", "(0, 1]"]),
    (["--min-p", "2"], ["--min-p"]),
    (["--top-k", "-3"], ["--top-k"]),
    (["--repeat-penalty", "0"], ["--repeat-penalty"]),
    (["--ctx-size", "4"], ["--ctx-size", "prompt"]),
    (["--ctx-size", "0"], ["--ctx-size"]),
    (["--prefill-chunk", "0"], ["--prefill-chunk"]),
    (["--expert-cache-gb", "1000"], ["--expert-cache-gb", "larger"]),
    (["--expert-cache-frac", "1.5"], ["--expert-cache-frac"]),
    (["--expert-cache-gb", "1", "--expert-cache-frac", "0.5"], ["not both"]),
])
def test_bad_values(args, needles):
    assert_usage_error(invoke(["-p", "hello world, this prompt has some tokens"] + args), *needles)


def test_missing_model(tmp_path):
    assert_usage_error(invoke([str(tmp_path / "nope.ftw"), "-p", "hi"]), "not found")


def test_invalid_model(tmp_path):
    bad = tmp_path / "bad.ftw"
    bad.write_bytes(b"this is not an ftw file" * 50)
    assert_usage_error(invoke([str(bad), "-p", "hi"]), str(bad))


def test_bundled_model_is_small():
    import os
    assert os.path.getsize(default_model_path()) < 24 * 2 ** 20  # the trained model is ~19 MB


def test_expert_cache_line_counts_admissions_among_the_fills():
    from freetoken.stats import expert_lines
    base = {"hits": 6, "misses": 2, "fills": 3, "bytes_filled": 3 << 20, "cpu_experts": 1,
            "cpu_routes": 1}
    plain = expert_lines(base, None, False)[0]
    assert "(3 fills)" in plain and "admissions" not in plain
    line = expert_lines({**base, "fills_behind": 2}, None, False)[0]
    assert "75.0% hit rate" in line and "(3 fills, 2 of them admissions)" in line
