"""`freetoken bench`: the user's llama-bench. Prompt processing (pp N: a cold prefill of N
tokens) and token generation (tg N: N decode steps after a one-token prompt; with --parallel B,
B sequences decoding together and their aggregate rate) rates, over a grid of expert-cache
sizes and policies, as a markdown table, JSON rows or CSV.

Runs Engine.generate as `run` does (prefill, decode, CUDA graphs, the expert runtime) and reads
the engine's own timings (GenerationStats); nothing here is a bench-only path. Each grid cell
loads the model once with the prefix cache off (every prefill is cold), runs each test once
unrecorded (warm-up: graph capture, cache fill) and then `repetitions` times. The prompts are
random token ids from a fixed seed, as llama-bench's."""
import csv
import io
import json
import os
import statistics
import subprocess
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Optional

from .config import POLICIES, EngineConfig
from .errors import ConfigError
from .sampling import SamplingParams

FORMATS = ("md", "json", "csv")
SEED = 42  # of the prompts' token ids
FIELDS = ("build_version", "build_commit", "device", "gpu_info", "cpu_info", "torch_version",
          "model", "model_size_bytes", "policy", "expert_cache_gb", "expert_cache_frac", "test",
          "n_prompt", "n_gen", "n_parallel", "repetitions", "avg_ts", "stddev_ts", "samples_ts", "hit_rate",
          "bytes_filled", "cpu_experts", "test_time")


@dataclass(frozen=True)
class BenchConfig:
    """The grid: every cache size (gb values, then frac values; none: the engine's default) x
    every policy, each running every pp test (n_prompt) and tg test (n_gen), the tg tests once
    per parallel value (B sequences decoding together)."""
    n_prompt: tuple = (512, 8192)
    n_gen: tuple = (128,)
    cache_gb: tuple = ()
    cache_frac: tuple = ()
    policies: tuple = ("hybrid",)
    repetitions: int = 5
    parallel: tuple = (1,)

    @property
    def caches(self) -> list:
        """[(expert_cache_gb, expert_cache_frac)] of the grid's cache axis."""
        cells = [(gb, None) for gb in self.cache_gb] + [(None, f) for f in self.cache_frac]
        return cells or [(None, None)]

    @property
    def tests(self) -> list:
        """[(name, n_prompt, n_gen, B)]: pp tests, then tg tests per parallel value B (0s left
        out, as llama-bench)."""
        return ([(f"pp{n}", n, 0, 1) for n in self.n_prompt if n] +
                [(f"tg{n}" + (f" x{b}" if b > 1 else ""), 0, n, b)
                 for n in self.n_gen if n for b in self.parallel])

    def cell_configs(self, base: EngineConfig) -> list:
        """The EngineConfig of every grid cell (a bad value raises here, before any load). Up
        to max(parallel) sequences, no prefix cache, a context that holds the longest test, no
        memory watch (a row measures the cache size it names)."""
        ctx = max(max(self.n_prompt + (0,)) + 1, max(self.n_gen + (0,)) + 2)
        return [replace(base, expert_cache_gb=gb, expert_cache_frac=frac, policy=policy,
                        ctx_size=ctx, parallel=max(self.parallel), kv_tokens=None,
                        prefix_cache=False, memory_watch=False)
                for gb, frac in self.caches for policy in self.policies]


def parse_counts(text: str, option: str, low: int = 0) -> tuple:
    """'512,8192' -> (512, 8192); ConfigError naming `option` unless every value is an
    integer >= low."""
    values = []
    for item in text.split(","):
        try:
            value = int(item.strip())
        except ValueError:
            value = None
        if value is None or value < low:
            raise ConfigError(f"{option} takes a comma list of integers >= {low}, not {text!r}")
        values.append(value)
    return tuple(values)


def parse_sizes(text: Optional[str], option: str) -> tuple:
    """'1.5,4' -> (1.5, 4.0); None -> (); ConfigError naming `option` for anything else (the
    range is EngineConfig's to check)."""
    if text is None:
        return ()
    try:
        return tuple(float(item) for item in text.split(","))
    except ValueError:
        raise ConfigError(f"{option} takes a comma list of numbers, not {text!r}") from None


def parse_policies(text: str) -> tuple:
    policies = tuple(p.strip() for p in text.split(","))
    for p in policies:
        if p not in POLICIES:
            raise ConfigError(f"--policy takes a comma list of {', '.join(POLICIES)}, "
                              f"not {text!r}")
    return policies


def make_config(n_prompt: str, n_gen: str, cache_gb: Optional[str], cache_frac: Optional[str],
                policy: str, repetitions: str, parallel: str = "1") -> BenchConfig:
    """BenchConfig from the command line's strings; a bad value is a ConfigError naming it."""
    reps = parse_counts(repetitions, "-r/--repetitions", low=1)
    if len(reps) != 1:
        raise ConfigError(f"-r/--repetitions takes one integer >= 1, not {repetitions!r}")
    config = BenchConfig(parse_counts(n_prompt, "-p/--n-prompt"), parse_counts(n_gen,
                         "-n/--n-gen"), parse_sizes(cache_gb, "--expert-cache-gb"),
                         parse_sizes(cache_frac, "--expert-cache-frac"), parse_policies(policy),
                         reps[0], parse_counts(parallel, "--parallel", low=1))
    if not config.tests:
        raise ConfigError("nothing to run: -p and -n are both 0; give a prompt or generation "
                          "length")
    return config


def run_bench(path, config: BenchConfig, base: EngineConfig) -> Iterator[dict]:
    """One row (FIELDS) per grid cell and test, yielded as each is measured. path: a .ftw path,
    or an opened model file with reopen() (a bench shape, tools/bench_shapes.SyntheticFile),
    reopened for each cell since an engine closes its file."""
    import torch

    from .engine import Engine

    cells = config.cell_configs(base)
    machine = machine_info()
    for cell in cells:
        source = path.reopen() if hasattr(path, "reopen") else path
        with Engine(source, cell) as engine:
            vocab = engine.model_config.vocab_size
            gen = torch.Generator().manual_seed(SEED)
            for name, n_prompt, n_gen, B in config.tests:
                prompts = [torch.randint(vocab, (max(n_prompt, 1),), generator=gen).tolist()
                           for _ in range(B)]
                params = SamplingParams(max_tokens=n_gen + 1 if n_gen else 1, temperature=0,
                                        ignore_eos=True)
                measure = _measure if B == 1 else _measure_batch
                measure(engine, prompts, params, n_gen)  # warm-up
                runs = [measure(engine, prompts, params, n_gen)
                        for _ in range(config.repetitions)]
                yield _row(machine, engine, cell, name, n_prompt, n_gen, B, runs)


def _measure_batch(engine, prompts: list, params: SamplingParams, n_gen: int) -> tuple:
    """A tg test of B sequences submitted together: (aggregate decode tokens per second from
    the first one's first token to the last one's last, the expert counters over the run)."""
    before = dict(engine.experts.stats)
    reqs = [engine.submit(ids, params) for ids in prompts]
    while not all(r.finished for r in reqs):
        engine.step()
    stats = [r.stats for r in reqs]
    assert all(st.num_decoded == n_gen for st in stats), [st.stop_reason for st in stats]
    start = min(st.t_start + st.ttft_s for st in stats)
    end = max(st.t_start + st.ttft_s + st.decode_s for st in stats)
    after = engine.experts.stats
    counters = {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, (int, float))}
    return sum(st.num_decoded for st in stats) / (end - start), counters


def _measure(engine, prompts: list, params: SamplingParams, n_gen: int) -> tuple:
    """(tokens per second, the run's expert counters): prefill rate for a pp test, decode rate
    for a tg test, as the engine timed them."""
    ids, = prompts
    for _ in engine.generate(ids, params):
        pass
    st = engine.last_stats
    if n_gen:
        assert st.num_decoded == n_gen, (st.num_decoded, n_gen, st.stop_reason)
        return st.decode_tok_s, st.experts
    assert st.num_prefilled == len(ids), (st.num_prefilled, len(ids))
    return st.prefill_tok_s, st.experts


def _row(machine: dict, engine, cell: EngineConfig, name: str, n_prompt: int, n_gen: int,
         B: int, runs: list) -> dict:
    rates = [rate for rate, _ in runs]
    hits = sum(e.get("hits", 0) for _, e in runs)
    misses = sum(e.get("misses", 0) for _, e in runs)
    row = {**machine, "device": engine.device.type, "model": os.path.basename(engine.path),
           "model_size_bytes": _file_size(engine.path, engine.file), "policy": cell.policy,
           "expert_cache_gb": cell.expert_cache_gb, "expert_cache_frac": cell.expert_cache_frac,
           "test": name, "n_prompt": n_prompt, "n_gen": n_gen, "n_parallel": B,
           "repetitions": len(runs),
           "avg_ts": statistics.fmean(rates),
           "stddev_ts": statistics.stdev(rates) if len(rates) > 1 else 0.0, "samples_ts": rates,
           "hit_rate": hits / (hits + misses) if hits + misses else None,
           "bytes_filled": statistics.fmean(e.get("bytes_filled", 0) for _, e in runs),
           "cpu_experts": statistics.fmean(e.get("cpu_experts", 0) for _, e in runs),
           "test_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return {k: row[k] for k in FIELDS}


def _file_size(path: str, file=None) -> int:
    """Bytes of the model, every part of a split file (a file without paths, a bench shape's:
    its tensors' and banks' bytes)."""
    import ftw
    if file is not None and not hasattr(file, "paths"):
        return (sum(t.nbytes for t in file.tensors.values())
                + sum(b.nbytes for b in file.banks.values()))
    with ftw.open(path) as f:
        return sum(os.path.getsize(p) for p in f.paths)


def machine_info() -> dict:
    """The build/device/CPU fields every row carries."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from .profile_store import cpu_model, gpu_name
    try:
        build = version("freetoken")
    except PackageNotFoundError:  # a checkout run in place (PYTHONPATH): its pyproject's
        build = _checkout_version()
    return {"build_version": build, "build_commit": _commit(), "gpu_info": gpu_name(),
            "cpu_info": f"{cpu_model()} ({len(os.sched_getaffinity(0))} CPUs allowed)",
            "torch_version": torch.__version__}


def _checkout_version() -> str:
    """project.version of the pyproject.toml beside the package (a checkout), or 'unknown'."""
    try:
        import tomllib  # (Python >= 3.11)
    except ImportError:
        return "unknown"
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "pyproject.toml")
    try:
        with open(path, "rb") as f:
            return str(tomllib.load(f)["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"


def _commit() -> str:
    """The git commit of the package's checkout, or 'unknown' (an installed wheel)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def report(rows: Iterator[dict], fmt: str, echo: Callable[[str], None]) -> None:
    """Writes rows in fmt: md and csv a line per row as it comes (md ends with the build line),
    json one list of rows at the end."""
    if fmt == "json":
        echo(json.dumps(list(rows), indent=2))
        return
    if fmt == "csv":
        echo(_csv_line(FIELDS))
        for row in rows:
            values = dict(row, samples_ts=";".join(f"{r:.6g}" for r in row["samples_ts"]))
            echo(_csv_line(["" if values[k] is None else values[k] for k in FIELDS]))
        return
    echo("| model | size | device | policy | cache | test | t/s | hit % | MB filled |")
    echo("| --- | ---: | --- | --- | --- | ---: | ---: | ---: | ---: |")
    last = None
    for row in rows:
        echo(md_line(row))
        last = row
    if last is not None:
        echo("")
        echo(build_line(last))


def md_line(row: dict) -> str:
    cache = (f"{row['expert_cache_gb']:g} GB" if row["expert_cache_gb"] is not None else
             f"{row['expert_cache_frac']:g} of experts" if row["expert_cache_frac"] is not None
             else "default")
    hit = "-" if row["hit_rate"] is None else f"{100 * row['hit_rate']:.1f}"
    return (f"| {row['model']} | {row['model_size_bytes'] / 2 ** 20:.1f} MiB | {row['device']} "
            f"| {row['policy']} | {cache} | {row['test']} "
            f"| {row['avg_ts']:.2f} ± {row['stddev_ts']:.2f} | {hit} "
            f"| {row['bytes_filled'] / 1e6:.1f} |")


def build_line(row: dict) -> str:
    device = row["gpu_info"] or "no GPU"
    return (f"build: freetoken {row['build_version']} ({row['build_commit']}), torch "
            f"{row['torch_version']} | device: {row['device']} ({device}) | CPU: {row['cpu_info']}")


def _csv_line(values) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="").writerow(values)
    return out.getvalue()
