"""The rows and tables of tools/bench_decode.py: what a row name runs (row_spec: policy,
admissions, tuning, environment), one printed row per config (fmt_row, HEADER), a config's
rounds as one row (median_row: the median tok/s) and the side-by-side summary with the issue-5
goal ratios and, for --repeat N > 1, each row's spread over its rounds (summary)."""
import math
from types import SimpleNamespace

GB = 1e9

# What each row name runs (bench_decode --help prints it; row_spec parses the names).
ROWS = """\
  hybrid   the engine's default (experts/split.py): q* = round(m P / (P + C)) of a layer's m
           misses filled, the rest on the CPU (the paper's split), P and C from the profile,
           plus its default admissions (runtime.py: admit1/3 with zero-copy fills; the last
           half of the layers' gathered at the next step's start: experts/captured/admissions.py)
  paper    hybrid with admissions off (--fill-behind 0): the paper's split alone
  admitN   hybrid plus N admissions per layer (--fill-behind N, any N): CPU-run misses also
           copied into the cache, by a gather on a side stream started with the layer's plan;
           admitN/M: only in steps of at most M misses (Tuning.fill_behind_max_misses)
  X+trace  row X with its CPU jobs' work items traced (Tuning.serve_trace): the note gives
           where a job's time went (workers' start, GB/s per worker, waits, spread), to hold
           against tools/bench_cpu_jobs.py --trace's isolated jobs
  X+nocpu  row X with its CPU jobs skipped (Tuning.serve_skip_jobs: zero partials, wrong
           results, timing only): the same fills, admissions and handshakes with the CPU's
           compute free, so X+nocpu / X shows what the CPU's compute costs the step
  X+deferN row X with the admissions of its last N MoE layers gathered at the next step's start
           instead of in their own (Tuning.admit_defer; X+defer0: none), so the step does not
           end waiting for them
  X+pfN    row X with the CPU kernel's software prefetch N bytes ahead of each row's loads
           (FREETOKEN_KERNEL_TUNE=prefetch=N; 0: off) instead of its path's default
  X#N      row X with N CPU expert threads instead of --cpu-threads (e.g. hybrid#14)
  offload  q = m (every miss filled over PCIe)
  cpu      q = 0 with no cache: every expert on the CPU (the CPU-only engine)
  static   a fixed set on the device (each layer's most frequent experts in the warm-up part of
           the trace, the cache split evenly over layers), the rest on the CPU, never changed
           (how llama.cpp --n-cpu-moe / KTransformers place experts)
  limit    T = T_gpu + miss_bytes / (P + C): T_gpu is the measured step with every expert
           resident, miss_bytes the hybrid row's misses per token x slot bytes"""

SUFFIX_TUNING = {"trace": ("serve_trace", True),  # diagnostics: the jobs' items traced
                 "nocpu": ("serve_skip_jobs", True)}  # timing only: the jobs skipped
POLICIES = ("hybrid", "paper", "admitN", "admitN/M", *(f"X+{suffix}" for suffix in SUFFIX_TUNING),
            "X+deferN", "X+pfN", "X#N", "offload", "static")
NAMED = ("hybrid", "paper", "offload", "static", "cpu", "plain", "resident")


def row_spec(row: str) -> SimpleNamespace:
    """A row name -> the engine policy, admissions, tuning fields (config.Tuning) and
    environment it runs under."""
    env, tuning = {}, {}
    name, _, threads = row.partition("#")
    if threads and (not threads.isdigit() or int(threads) < 1):
        raise SystemExit(f"bad thread count in {row!r}: X#N takes a count N >= 1")
    name, *suffixes = name.split("+")
    for suffix in suffixes:
        count = suffix[len("defer"):]
        if suffix.startswith("defer") and count.isdigit():
            tuning["admit_defer"] = int(count)
            continue
        if suffix.startswith("pf") and suffix[2:].isdigit():
            env["FREETOKEN_KERNEL_TUNE"] = f"prefetch={suffix[2:]}"
            continue
        if suffix not in SUFFIX_TUNING:
            raise SystemExit(f"unknown suffix in {row!r}: X+{' or X+'.join(SUFFIX_TUNING)}, "
                             "X+deferN or X+pfN")
        field, value = SUFFIX_TUNING[suffix]
        tuning[field] = value
    behind, max_misses = (0 if name == "paper" else None), None
    count, _, cap = name.partition("/")
    if count.startswith("admit") and count[len("admit"):].isdigit():
        if cap and not cap.isdigit():
            raise SystemExit(f"bad miss cap in {row!r}: admitN/M takes a count M")
        behind, max_misses = int(count[len("admit"):]), (int(cap) if cap else None)
    if name not in NAMED and behind is None:
        raise SystemExit(f"unknown row {row!r}: rows are {', '.join(POLICIES)}")
    if max_misses is not None:
        tuning["fill_behind_max_misses"] = max_misses
    kind = name if name in ("offload", "cpu", "plain") else "cpu" if name == "static" else "hybrid"
    return SimpleNamespace(kind=kind, behind=behind, tuning=tuning, env=env, base=name,
                           threads=int(threads) if threads else None)


def fmt_row(frac, wl, policy, r, note=""):
    ms = r["s_per_tok"] * 1e3
    gbs = r["experts"] * r.get("slot_bytes", 0) / r["s_per_tok"] / GB if r.get("slot_bytes") else float("nan")
    return (f"{frac:>6.0%} {wl:<9} {policy:<8} {1 / r['s_per_tok']:>8.2f} {ms:>9.1f} "
            f"{r['hit']:>6.1%} {r['qm']:>6.2f} {r['gb_fill']:>8.3f} {r['cpu_exp']:>8.1f} "
            f"{r['experts']:>7.1f} {gbs:>7.1f}  {note}")


HEADER = (f"{'cache':>6} {'workload':<9} {'policy':<8} {'tok/s':>8} {'ms/tok':>9} {'hit':>6} "
          f"{'q/m':>6} {'GBfill/t':>8} {'CPUexp/t':>8} {'exp/t':>7} {'GB/s':>7}  note")


def median_row(rounds: list) -> dict:
    """The one place a config's rounds (--repeat N) become one row: tok/s is their median (an
    even count: the mean of the middle two), misses/token their mean (the limit model's input),
    the other fields those of the round nearest the median; adds `rounds` (how many) and
    `spread` ((max - min) / median of tok/s). One round: its fields unchanged, spread 0."""
    tps = sorted(1 / r["s_per_tok"] for r in rounds)
    n, mid = len(tps), len(tps) // 2
    med = tps[mid] if n % 2 else (tps[mid - 1] + tps[mid]) / 2
    row = dict(min(rounds, key=lambda r: abs(1 / r["s_per_tok"] - med)),
               rounds=n, spread=(tps[-1] - tps[0]) / med)
    if n % 2 == 0:
        row["s_per_tok"] = 1 / med
    if "misses" in row:
        row["misses"] = sum(r["misses"] for r in rounds) / n
    return row


def summary(results, fracs, workloads, resident, policies=("hybrid", "offload", "static")):
    """Side-by-side table with the issue-5 goal ratios; columns: the rows asked for, cpu, limit.
    results: {(frac, workload, row): [row dict per round]}; resident: the T_gpu rounds (every
    expert cached; empty if not run). Each config's rounds become one row by median_row; when
    some config ran more than one round, a table of each row's spread follows."""
    rows = {key: median_row(rounds) for key, rounds in results.items() if rounds}
    T_gpu = median_row(resident) if resident else None
    T_gpu_s = T_gpu["s_per_tok"] if T_gpu else None
    num_rounds = max([1, len(resident)] + [len(rounds) for rounds in results.values()])
    fixed = ("hybrid", "offload", "cpu", "static", "limit")
    cols = ["hybrid"] + [c for c in policies if c not in fixed] + list(fixed[1:])
    what = "tok/s" if num_rounds == 1 else f"median tok/s of {num_rounds} rounds"
    lines = ["", f"summary ({what}; ratios of tok/s; T_hyb/T_lim = hybrid time / limit-model time)",
             f"{'cache':>6} {'workload':<9} " + " ".join(f"{c:>8}" for c in cols)
             + f" {'hyb/off':>8} {'hyb/cpu':>8} {'hyb/best':>8} {'Thyb/Tlim':>9}"]
    for frac in sorted(fracs):
        for wl in workloads:
            tps = {c: 1 / rows[(frac, wl, c)]["s_per_tok"] if (frac, wl, c) in rows else float("nan")
                   for c in cols}
            best_other = max((tps[c] for c in ("offload", "cpu", "static") if not math.isnan(tps[c])),
                             default=float("nan"))
            h = tps["hybrid"]
            lines.append(f"{frac:>6.0%} {wl:<9} " + " ".join(f"{tps[c]:>8.2f}" for c in cols)
                         + f" {h / tps['offload']:>8.2f} {h / tps['cpu']:>8.2f} {h / best_other:>8.2f}"
                         + f" {tps['limit'] / h:>9.2f}")
    lines += ["goals: uniform 25%: hyb/off >= 2.0, hyb/cpu >= 1.4, Thyb/Tlim <= 1.3; "
              "locality: hyb/best >= 1.3 (best of offload, cpu, static)",
              f"T_gpu (every expert resident) = {T_gpu_s * 1e3:.2f} ms/token" if T_gpu_s else
              "T_gpu not measured: limit-model column empty"]
    plain = next((r for (_, _, policy), r in rows.items() if policy == "plain"), None)
    if T_gpu_s and plain:
        lines.append(f"machinery: T_gpu / plain resident experts ({plain['s_per_tok'] * 1e3:.2f} ms/token) "
                     f"= {T_gpu_s / plain['s_per_tok']:.2f} (goal <= 1.2)")
    if num_rounds > 1:
        lines += _spread_lines(rows, fracs, workloads, cols[:-1], T_gpu, plain, num_rounds)
    return "\n".join(lines)


def _spread_lines(rows, fracs, workloads, cols, T_gpu, plain, num_rounds) -> list:
    """Each row's (max - min) / median tok/s in %; `(n)` after a cell: only n rounds ran."""
    def cell(r, width=8):
        if r is None:
            return f"{'nan':>{width}}"
        text = f"{100 * r['spread']:.1f}" + (f"({r['rounds']})" if r["rounds"] < num_rounds else "")
        return f"{text:>{width}}"
    lines = ["", f"spread over {num_rounds} rounds ((max - min) / median tok/s, %; a ratio of two rows "
                 "nearer 1 than their spreads is within the noise)",
             f"{'cache':>6} {'workload':<9} " + " ".join(f"{c:>8}" for c in cols)]
    for frac in sorted(fracs):
        for wl in workloads:
            lines.append(f"{frac:>6.0%} {wl:<9} "
                         + " ".join(cell(rows.get((frac, wl, c))) for c in cols))
    single = [f"{name} {cell(r, 0)}" for name, r in (("T_gpu (resident)", T_gpu), ("plain", plain)) if r]
    if single:
        lines.append("spread, %: " + "; ".join(single))
    return lines
