"""The oracle table (`pytest --oracle-table=FILE tests/test_engine_oracle.py`): a pytest plugin
(conftest.py takes its hooks and its fixture) whose `oracle` fixture is one test's record of
the values its assertions check against transformers (logits max abs diff, greedy tokens
equal), and which writes them at the session's end as markdown, one row per family.
Without the option the records are kept nowhere and nothing is written.
Not a test module itself.
"""
import math
import os
import platform
from dataclasses import dataclass, field
from importlib import metadata

import pytest

POLICIES = ("hybrid", "offload", "cpu")
CACHES = ("none", "few", "half", "all", "default")
FAMILY_PARAMS = ("fam", "hybrid")  # the tests' module fixtures, parametrized by family
RECORDS = pytest.StashKey[list]()
RECORD = pytest.StashKey["Record"]()


@dataclass
class Record:
    """One test: where it ran (family, device, policy, cache, kind) and what it measured. A test
    records each value before asserting on it, so a failing test still shows its value."""
    family: str
    device: str
    policy: str
    cache: str
    kind: str
    diffs: list = field(default_factory=list)
    greedy: list = field(default_factory=list)
    outcome: str = "passed"  # "passed", "failed" or "skipped" (set from the reports)

    def at(self, **where) -> "Record":
        """For a test that fixes its policy or cache instead of taking them as parameters."""
        for key, value in where.items():
            setattr(self, key, value)
        return self

    def diff(self, value: float) -> None:
        self.diffs.append(float(value))

    def tokens(self, ours, ref) -> None:
        """Greedy tokens compared: equal or not; none compared (ref empty) is n/a."""
        self.greedy.append(list(ours) == list(ref) if len(ref) else None)

    def note(self, report) -> None:
        if report.failed:
            self.outcome = "failed"
        elif report.skipped and self.outcome != "failed":
            self.outcome = "skipped"

    @classmethod
    def of(cls, item) -> "Record":
        params = getattr(getattr(item, "callspec", None), "params", {})
        family = next((params[p] for p in FAMILY_PARAMS if p in params), "?")
        kind = item.originalname.removeprefix("test_").removeprefix("cuda_")
        if "mode" in params:
            kind += f" {params['mode']}"
        if params.get("beside"):
            kind += " beside"
        return cls(family, "cuda" if item.get_closest_marker("gpu") else "cpu",
                   params.get("policy", "hybrid"), params.get("cache", "default"), kind)


def worst(values):
    """The largest value, NaN if any is (a NaN diff fails its assertion too); None if empty."""
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values, default=None)


def cell(records) -> str:
    """'2.4e-07 · yes': the worst diff and whether all greedy tokens compared matched."""
    if not records:
        return "–"
    if all(r.outcome == "skipped" for r in records):
        return "skipped"
    diff = worst([d for r in records for d in r.diffs])
    greedy = [g for r in records for g in r.greedy if g is not None]
    text = ("n/a" if diff is None else f"{diff:.1e}") + " · " + (
        "n/a" if not greedy else "yes" if all(greedy) else "no")
    failed = sum(r.outcome == "failed" for r in records)
    return text + (f" **{failed} FAILED**" if failed else "")


def where_worst(records) -> str:
    scored = [(worst(r.diffs), r) for r in records if r.diffs]
    if not scored:
        return "–"
    _, r = max(scored, key=lambda s: (math.isnan(s[0]), s[0]))
    return f"{r.kind}, cache {r.cache}, {r.policy}"


def markdown(records, env: dict) -> str:
    """The table per device: one row per family, a column per policy (worst diff · greedy
    equal), the tests' outcomes and where the worst diff was; then the worst per cache size."""
    lines = [", ".join(f"{k} {v}" for k, v in env.items()), ""]
    for device in ("cpu", "cuda"):
        mine = [r for r in records if r.device == device]
        if not mine:
            continue
        families = list(dict.fromkeys(r.family for r in mine))
        counts = ", ".join(f"{sum(r.outcome == o for r in mine)} {o}"
                           for o in ("passed", "failed", "skipped"))
        lines += [f"{device}: {len(mine)} tests, {counts}", "", "| family | " + " | ".join(POLICIES) + " | tests | worst at |",
                  "|---" * (len(POLICIES) + 3) + "|"]
        for fam in families:
            rows = [r for r in mine if r.family == fam]
            passed = sum(r.outcome == "passed" for r in rows)
            lines.append(f"| {fam} | " + " | ".join(cell([r for r in rows if r.policy == p])
                                                     for p in POLICIES)
                         + f" | {passed}/{len(rows)} | {where_worst(rows)} |")
        caches = [c for c in CACHES if any(r.cache == c for r in mine)]
        lines += ["", "| family | " + " | ".join(f"cache {c}" for c in caches) + " |",
                  "|---" * (len(caches) + 1) + "|"]
        for fam in families:
            rows = [r for r in mine if r.family == fam]
            lines.append(f"| {fam} | " + " | ".join(cell([r for r in rows if r.cache == c])
                                                     for c in caches) + " |")
        lines.append("")
    return "\n".join(lines)


def environment(records) -> dict:
    """Versions read from the installed packages' metadata (nothing imported for them)."""
    env = {"python": platform.python_version()}
    for name in ("torch", "transformers"):
        try:
            env[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            env[name] = "not installed"
    if any(r.device == "cuda" and r.outcome != "skipped" for r in records):
        import torch
        env["cuda"] = f"{torch.version.cuda} on {torch.cuda.get_device_name()}"
    env["machine"] = f"{platform.machine()}, {os.cpu_count()} cpus"
    return env


# ---- the plugin ----------------------------------------------------------------------------------

def pytest_addoption(parser):
    parser.addoption("--oracle-table", metavar="FILE", default=None,
                     help="write the oracle tests' measured values against transformers "
                          "(tests/test_engine_oracle.py) to FILE as a markdown table")


def pytest_configure(config):
    if config.getoption("--oracle-table"):
        if getattr(config.option, "numprocesses", None):  # the records would stay in the workers
            raise pytest.UsageError("--oracle-table collects in one process: add -n 0")
        config.stash[RECORDS] = []


@pytest.fixture
def oracle(request) -> Record:
    """This test's record (see Record); kept for the table only with --oracle-table."""
    record = Record.of(request.node)
    records = request.config.stash.get(RECORDS, None)
    if records is not None:
        records.append(record)
        request.node.stash[RECORD] = record
    return record


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    record = item.stash.get(RECORD, None)
    if record is not None:
        record.note(report)
    return report


def pytest_sessionfinish(session):
    records = session.config.stash.get(RECORDS, None)
    if records is None:
        return
    path = session.config.getoption("--oracle-table")
    with open(path, "w") as f:
        f.write(markdown(records, environment(records)))
