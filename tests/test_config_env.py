"""The FREETOKEN_* environment table (freetoken/config.py ENV, env): the table and the
code name the same variables, nothing else reads os.environ for them, unset gives the default,
every allowed value passes, any other raises a ConfigError naming the variable, and the
environments the bench rows set (tools/decode_rows.py) are all accepted."""
import ast
import pathlib
import re

import pytest

from freetoken import config
from freetoken.config import ENV, KINDS, env
from freetoken.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAME = re.compile(r"FREETOKEN_[A-Z0-9_]+")
# Removed experiments whose measurements the comments keep (experts/captured/control.py); no code
# reads them, so setting one changes nothing.
REMOVED = {"FREETOKEN_FINISH_SUM", "FREETOKEN_SPLIT_ROWS", "FREETOKEN_SPLIT_ADAPT",
           "FREETOKEN_SIGNALS", "FREETOKEN_ADMIT_AT", "FREETOKEN_ADMIT_PROGRAMS",
           "FREETOKEN_ADMIT_DEFER", "FREETOKEN_FILLS", "FREETOKEN_FILL_COPIES",
           "FREETOKEN_DEVICE_EXPERTS", "FREETOKEN_CPU_EXPERTS", "FREETOKEN_DEVICE_CONTROL",
           "FREETOKEN_SERVE_TRACE", "FREETOKEN_SERVE_SKIP_JOBS", "FREETOKEN_FUSED",
           "FREETOKEN_FUSED_KV", "FREETOKEN_GEMV", "FREETOKEN_PREFILL_EXPERTS",
           "FREETOKEN_DECODE_ATTENTION"}  # retired: named only in docs and tombstones
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
    assert ENV["FREETOKEN_ISA"].values == kernels.ISAS
    assert kernels.TUNE_ENV in ENV


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


def test_free_form_variable_is_returned_as_is(monkeypatch):
    monkeypatch.setenv("FREETOKEN_KERNEL_TUNE", "rows=4,whatever")  # KernelTuning.parse checks
    assert env("FREETOKEN_KERNEL_TUNE") == "rows=4,whatever"


def test_read_at_call_time(monkeypatch):
    monkeypatch.setenv("FREETOKEN_ISA", "avx2")
    assert env("FREETOKEN_ISA") == "avx2"
    monkeypatch.setenv("FREETOKEN_ISA", "generic")
    assert env("FREETOKEN_ISA") == "generic"
    monkeypatch.delenv("FREETOKEN_ISA")
    assert env("FREETOKEN_ISA") == ""


def test_unknown_name_is_a_programming_error():
    with pytest.raises(KeyError):
        env("FREETOKEN_NO_SUCH_THING")
    with pytest.raises(KeyError):
        config.env("PATH")


def test_a_typo_at_a_read_site_raises(monkeypatch):
    """A value outside the table is refused where it is read, with the fix in the message."""
    pytest.importorskip("freetoken._expert_ffn")
    from freetoken import kernels
    monkeypatch.setenv("FREETOKEN_ISA", "avx-512")
    with pytest.raises(ConfigError, match="FREETOKEN_ISA='avx-512'.*use one of generic"):
        kernels._resolve_isa(None)


# ---- the tuning options (config.Tuning) ------------------------------------------------------

def test_tuning_is_typed_and_validated():
    """Tuning is frozen, an unknown name is an error of its constructor (a typo never passes
    silently), bad values are ConfigErrors naming the field, and EngineConfig takes only a
    Tuning (no untyped dict)."""
    from dataclasses import FrozenInstanceError

    from freetoken.config import EngineConfig, Tuning
    t = Tuning(admit_defer=2, prefill_choice="slot")
    with pytest.raises(FrozenInstanceError):
        t.admit_defer = 3
    with pytest.raises(TypeError, match="admit_defr"):
        Tuning(admit_defr=2)
    for kw, match in (({"admit_defer": -1}, "admit_defer"), ({"prefill_buffers": 0}, "prefill_buffers"),
                      ({"prefill_choice": "sometimes"}, "prefill_choice must be one of auto, stream, slot"),
                      ({"prefill_stream_gbps": 0.0}, "prefill_stream_gbps"),
                      ({"cpu_experts": "kernel"}, "cpu_experts must be one of auto, torch, kernels"),
                      ({"fill_behind_max_misses": 1.5}, "fill_behind_max_misses")):
        with pytest.raises(ConfigError, match=match):
            Tuning(**kw)
    assert EngineConfig().tuning == Tuning()
    with pytest.raises(ConfigError, match="must be a Tuning"):
        EngineConfig(tuning={"admit_defer": 2})


# ---- the bench rows ----------------------------------------------------------------------------

def test_bench_rows_set_table_variables_and_tuning_fields(monkeypatch):
    from dataclasses import fields

    from decode_rows import row_spec
    from freetoken.config import Tuning
    names = {f.name for f in fields(Tuning)}
    for row in ("hybrid", "paper", "admit1/3", "hybrid+trace+nocpu", "hybrid+defer12",
                "hybrid+pf8192#13", "offload", "static"):
        spec = row_spec(row)
        assert set(spec.tuning) <= names, row
        Tuning(**spec.tuning)
        for name, value in spec.env.items():
            monkeypatch.setenv(name, value)
            assert env(name) == value, name
