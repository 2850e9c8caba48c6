"""The FREETOKEN_* environment table (freetoken/config.py ENV, env, env_int): the table and the
code name the same variables, nothing else reads os.environ for them, unset gives the default,
every allowed value passes, any other raises a ConfigError naming the variable, and the
environments the bench rows set (tools/decode_rows.py) are all accepted."""
import ast
import pathlib
import re

import pytest

from freetoken import config
from freetoken.config import ENV, KINDS, env, env_int
from freetoken.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAME = re.compile(r"FREETOKEN_[A-Z0-9_]+")
# Removed experiments whose measurements the comments keep (experts/device_step.py); no code
# reads them, so setting one changes nothing.
REMOVED = {"FREETOKEN_FINISH_SUM", "FREETOKEN_SPLIT_ROWS"}
NOT_OURS = ("TRITON_INTERPRET", "XDG_CACHE_HOME")  # read where they are used


def sources(*dirs):
    """(path, text) of every .py file under the given repository folders but freetoken/config.py."""
    for d in dirs:
        for path in sorted((ROOT / d).rglob("*.py")):
            if path != ROOT / "freetoken" / "config.py":
                yield path, path.read_text()


def literal_names(text: str) -> set:
    """String constants that are exactly a FREETOKEN_* name (what code reads or sets)."""
    return {node.value for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and NAME.fullmatch(node.value)}


# ---- the table and the code in step ----------------------------------------------------------

def test_table_names_the_variables_the_code_reads():
    """Every FREETOKEN_* name in freetoken/'s code is in the table and every table entry is named
    in the code; mentions in comments and docstrings are table entries or removed experiments."""
    in_code, mentioned = set(), set()
    for _, text in sources("freetoken"):
        in_code |= literal_names(text)
        mentioned |= set(NAME.findall(text))
    assert in_code == set(ENV), (in_code ^ set(ENV))
    assert mentioned - set(ENV) <= REMOVED, mentioned - set(ENV) - REMOVED
    assert not REMOVED & set(ENV)


def test_no_other_environment_reads():
    """Outside config.py, freetoken/ and ftw/ touch os.environ only for variables not ours."""
    for path, text in sources("freetoken", "ftw"):
        for i, line in enumerate(text.splitlines(), 1):
            if "os.environ" in line or "getenv" in line:
                assert any(n in line for n in NOT_OURS), f"{path.name}:{i}: {line.strip()}"


def test_tools_set_only_table_variables():
    for path, text in sources("tools"):
        assert literal_names(text) <= set(ENV), (path.name, literal_names(text) - set(ENV))


def test_entries_are_well_formed():
    for name, var in ENV.items():
        assert var.kind in KINDS, name
        assert var.doc and "\n" not in var.doc, name
        assert var.values is None or var.values is int or (
            isinstance(var.values, tuple) and all(isinstance(v, str) and v for v in var.values)), name
        if isinstance(var.values, tuple):
            assert var.default == "" or var.default in var.values, name
        if var.values is int:
            assert var.default.isdigit(), name


def test_mirrored_constants():
    """The table holds what lower-level modules define, since config cannot import them."""
    from freetoken import kernels
    from freetoken.experts import admissions, executor, handshake
    assert ENV["FREETOKEN_ISA"].values == kernels.ISAS
    assert ENV["FREETOKEN_CPU_EXPERTS"].values == executor.BACKENDS
    assert ENV["FREETOKEN_SIGNALS"].values == handshake.Signals.HOWS
    assert int(ENV["FREETOKEN_ADMIT_PROGRAMS"].default) == admissions.ADMIT_PROGRAMS
    assert kernels.TUNE_ENV in ENV and kernels.SERVE_TRACE_ENV in ENV and kernels.SERVE_SKIP_ENV in ENV


# ---- env(): defaults, allowed values, errors -------------------------------------------------

@pytest.mark.parametrize("name", sorted(ENV))
def test_unset_or_empty_gives_the_default(name, monkeypatch):
    monkeypatch.delenv(name, raising=False)
    assert env(name) == ENV[name].default
    monkeypatch.setenv(name, "")
    assert env(name) == ENV[name].default


@pytest.mark.parametrize("name", sorted(n for n, v in ENV.items() if isinstance(v.values, tuple)))
def test_allowed_values_pass_and_others_raise(name, monkeypatch):
    for value in ENV[name].values:
        monkeypatch.setenv(name, value)
        assert env(name) == value
    for bad in ("bogus", ENV[name].values[0].upper() + "x", " " + ENV[name].values[0]):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ConfigError) as info:
            env(name)
        message = str(info.value)
        assert message.startswith(f"{name}={bad!r}:"), message
        assert "unset it for the default" in message
        assert message.endswith("use one of " + ", ".join(ENV[name].values)), message


def test_count_variable(monkeypatch):
    name = "FREETOKEN_ADMIT_PROGRAMS"
    monkeypatch.delenv(name, raising=False)
    assert env_int(name) == 8
    for value in ("0", "4", "32"):
        monkeypatch.setenv(name, value)
        assert env_int(name) == int(value)
    for bad in ("-1", "1.5", "eight", "\uff18"):  # the last: a full-width 8
        monkeypatch.setenv(name, bad)
        with pytest.raises(ConfigError, match=f"^{name}=.*unset it for the default \\(8\\) or use "
                                              "a whole number >= 0$"):
            env_int(name)


def test_free_form_variable_is_returned_as_is(monkeypatch):
    monkeypatch.setenv("FREETOKEN_KERNEL_TUNE", "rows=4,whatever")  # KernelTuning.parse checks
    assert env("FREETOKEN_KERNEL_TUNE") == "rows=4,whatever"


def test_read_at_call_time(monkeypatch):
    monkeypatch.setenv("FREETOKEN_FILLS", "copy")
    assert env("FREETOKEN_FILLS") == "copy"
    monkeypatch.setenv("FREETOKEN_FILLS", "auto")
    assert env("FREETOKEN_FILLS") == "auto"
    monkeypatch.delenv("FREETOKEN_FILLS")
    assert env("FREETOKEN_FILLS") == "auto"


def test_unknown_name_is_a_programming_error():
    with pytest.raises(KeyError):
        env("FREETOKEN_NO_SUCH_THING")
    with pytest.raises(KeyError):
        config.env("PATH")


def test_a_typo_at_a_read_site_now_raises(monkeypatch):
    """Sites that used to take any other value as their default path now reject it."""
    from freetoken.experts import device_step, executor, split
    monkeypatch.setenv("FREETOKEN_SPLIT_ADAPT", "yes")
    with pytest.raises(ConfigError, match="FREETOKEN_SPLIT_ADAPT='yes'"):
        split.adapt_default()
    monkeypatch.setenv("FREETOKEN_CPU_EXPERTS", "kernel")
    with pytest.raises(ConfigError, match="FREETOKEN_CPU_EXPERTS='kernel'"):
        executor.create_executor({}, "auto")
    monkeypatch.setenv("FREETOKEN_DEVICE_CONTROL", "off")
    with pytest.raises(ConfigError, match="FREETOKEN_DEVICE_CONTROL='off'"):
        device_step.reason_off(None)  # (read before the runtime is looked at)


# ---- the bench rows' environments ------------------------------------------------------------

def test_bench_row_environments_are_accepted(monkeypatch):
    from decode_rows import SUFFIX_ENV, row_spec
    pairs = set(SUFFIX_ENV.values())
    for row in ("host", "late1", "lidle2/3", "hybrid@4", "admit1@16+msig", "paper+nocpu",
                "hybrid+trace+nocpu", "hybrid+defer12", "hybrid+deferauto"):
        pairs |= set(row_spec(row).env.items())
    assert {"FREETOKEN_ADMIT_AT", "FREETOKEN_DEVICE_CONTROL",
            "FREETOKEN_ADMIT_PROGRAMS"} <= {name for name, _ in pairs}
    for name, value in sorted(pairs):
        monkeypatch.setenv(name, value)
        assert env(name) == value, name
