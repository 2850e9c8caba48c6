"""Decode bench: tok/s of a Qwen3-30B-A3B-shaped bf16 model (random weights, host banks built in
memory; --shape: another family's shape, below) for the miss-split policies against static
placement and the limit model, per expert cache size and routing workload. Fixed seed; warm-up
excluded; one table, rows printed as they finish, then a side-by-side summary with the issue-5
goal ratios.

The rows (--policies; their legend is decode_rows.ROWS, printed by --help):

{rows}

The model is the real qwen3_moe code (freetoken.models; --shape: its family's) on the device;
routing is injected from a workload trace (bench_routing.py), the routers still run. Before
timing, hybrid/offload caches are warmed by replaying the policy's own plans over --history
tokens (books only, then one copy of the resident bytes), static sets are installed, then
--warmup tokens run for real. A row's note gives, among others, the token sync: µs per token
the host, done with its part of the step, still waited for the step's end (a replayed step:
its last layers, the lm head and the admissions still queued).

--repeat N runs each (cache fraction, workload)'s rows N rounds interleaved (A, B, C, A, B, C, ...;
the note says #r/N), as it does the resident/plain T_gpu rows and the cpu rows; the summary then
takes each row's median tok/s and adds each row's spread over its rounds: decisions between rows
that must beat a noisy machine (rows with identical plans moved by 8-15% within one run).

    python tools/bench_decode.py                                   # full shape, cuda
    python tools/bench_decode.py --cache-fracs 0.5 --workloads locality \
        --policies hybrid,hybrid+defer0,offload --repeat 3       # medians and spreads of 3 rounds
    python tools/bench_decode.py --device cpu --layers 4 --experts 16 --hidden 256 --inter 128 \
        --top-k 4 --vocab 1024 --heads 4 --kv-heads 2 --head-dim 64

--shape NAME: a shape of tools/bench_shapes.py instead (qwen3-30b-a3b, qwen3.6-35b-a3b,
gpt-oss-20b; as bench_batch.py: its family's model code with the shape's random weights and
banks, shrunk by the shape options given, --tiny and --set KEY=VALUE); the same rows. A Gated
DeltaNet hybrid decodes with its sequence's recurrent state (zero at --context's start; the
captured steps copy it in and out, as the engine's), gpt_oss's experts (plain row included)
with the clamped SwiGLU and biases its banks carry. No --prefill-lengths with --shape.

    python tools/bench_decode.py --shape qwen3.6-35b-a3b --policies hybrid,offload,static
    python tools/bench_decode.py --shape gpt-oss-20b --layers 2 --experts 16 --tiny --device cpu \
        --tokens 4 --warmup 1 --history 16

--quant TYPE[,TYPE...] (issue 35): the whole table once per expert bank type (bf16 the
baseline; the others bf16 experts as `convert --quant TYPE` writes them, bench_quant_banks.py),
then one table of every type's tok/s beside bf16's. --expert-cache-gb GB[,GB...] adds cache
sizes in GB (each type's slot count from its own slot size: the same budget buys a 4-bit type
~3.5x the experts), beside --cache-fracs ('' for none). On cuda each type's rows run on that
type's profile (calibrated here when none is stored, as bf16's: the runtime's split and the
limit model's P and C); with --no-calibrate a type without one takes bf16's by
profile.FALLBACK_RULE, as the engine does. The limit model takes the quantized slot bytes.

    python tools/bench_decode.py --quant bf16,q8_0,q4_0 --expert-cache-gb 14.5 --cache-fracs 0.25 \
        --policies hybrid,offload,static                        # issue 35's decode table
"""
import argparse
import gc
import math
import os
import sys
import time
import traceback
from unittest import mock
from types import SimpleNamespace

import numpy as np
import torch

import bench_moe_setup as setup
import bench_quant_banks as qb
import bench_routing as routing
from bench_shapes import add_shape_args
from decode_rows import HEADER, POLICIES, ROWS, fmt_row, median_row, row_spec, summary
from freetoken import bandwidth as bw, profile
from freetoken.config import EngineConfig, Tuning
from freetoken.experts import create_expert_runtime
from freetoken.experts.ffn import check_act
from freetoken.experts.transfer import zero_copy
from freetoken.graphs import DecodeGraphs
from freetoken.kv_cache import KVCache
from freetoken.state_cache import create_state_cache

GB = 1e9
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.replace("{rows}", ROWS),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    setup.add_shape_args(ap)
    ap.add_argument("--cache-fracs", default="0.25,0.1,0.5", help="expert cache sizes, fractions of all experts")
    ap.add_argument("--workloads", default="uniform,locality")
    ap.add_argument("--tokens", type=int, default=32, help="timed decode tokens per config")
    ap.add_argument("--warmup", type=int, default=8, help="decode tokens run before timing")
    ap.add_argument("--context", type=int, default=0,
                    help="tokens already cached when decode starts (their KV slots hold random "
                         "values; no prefill runs): attention's cost at long contexts")
    ap.add_argument("--history", type=int, default=256, help="trace tokens replayed (books only) to warm caches")
    ap.add_argument("--no-calibrate", action="store_true",
                    help="cuda: use defaults instead of a short profile when none is stored")
    ap.add_argument("--policies", default="hybrid,paper,offload,static",
                    help=f"rows per cache size and workload, of {','.join(POLICIES)} (cpu and limit "
                         "always run)")
    ap.add_argument("--eager", action="store_true",
                    help="cuda: launch every decode step from Python (no CUDA graphs)")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="rounds per config: each cache size and workload runs its --policies rows "
                         "N times interleaved (round 1: A, B, C; round 2: A, B, C; ...), the "
                         "resident/plain T_gpu rows and the cpu rows N times too (the eager "
                         "resident row of cuda graph runs once); the summary takes each row's "
                         "median tok/s (even N: the mean of the middle two), the limit model the "
                         "median T_gpu and the MEAN of the hybrid rounds' misses/token, and adds "
                         "each row's spread (max - min) / median in %%; give --max-seconds N "
                         "times the time [1]")
    ap.add_argument("--max-seconds", type=float, default=480, help="skip configs that would start later")
    ap.add_argument("--prefill-lengths", default="",
                    help="then also bench_prefill.py's table for these prompt lengths on the same banks "
                         "(saves a second bank build), e.g. 512,2048,8192,16384")
    add_shape_args(ap, shrink=False)
    add_quant_args(ap)
    a = setup.parse_shape_args(ap, argv)
    parse_quant_args(ap, a)
    if a.shape and a.prefill_lengths:
        ap.error("--prefill-lengths runs bench_prefill's qwen3_moe-shaped model only; leave it "
                 "out with --shape")
    if a.repeat < 1:
        ap.error(f"--repeat takes a number of rounds N >= 1, got {a.repeat}")
    # cpu (no cache: the CPU-only engine) and limit run for every cache size anyway; a cpu row
    # per size would run q = 0 over a cache that hits and mix into the CPU-only row's rounds
    rows = [row for row in a.policies.split(",") if row and row not in ("cpu", "limit")]
    for row in rows:
        row_spec(row)  # an unknown row name ends the run here, not after the banks are built
    a.policies = ",".join(rows)
    return a


def bandwidths(a, hb, device):
    """(P, C, source) in GB/s for the limit model; on cuda the stored profile of the banks' quant
    type (bf16's by profile.FALLBACK_RULE with --no-calibrate), calibrated when none is: then
    the runtime's rates (profile.expert_rates) find it too."""
    if device == "cuda":
        try:
            fills = "zero_copy" if zero_copy.enabled(device, not a.eager) else "copy"  # as the engine
            return profile.bandwidths_for(hb.layout, device, num_threads=a.cpu_threads,
                                          calibrate=not a.no_calibrate, fills=fills)
        except Exception as e:  # a failed calibration must not cost the whole run
            return profile.DEFAULT_P, profile.DEFAULT_C, f"defaults (calibration failed: {type(e).__name__}: {e})"
    # cpu device: the tier's fills are numpy copies, its CPU experts the kernel pool; both
    # share the same cores and memory, measured here one at a time (so the limit is optimistic)
    slots = min(64, hb.total_bytes // hb.slot_bytes)
    src = hb.data[:slots * hb.slot_bytes]
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t0 = time.perf_counter()
    np.copyto(dst, src)
    P = src.nbytes / (time.perf_counter() - t0) / GB
    try:
        from freetoken import kernels
        pool = kernels.get_pool(a.cpu_threads or kernels.default_num_threads(False))
        C = bw.time_kernel(pool, hb.data, hb.layout, 1, a.top_k, seconds=0.3)
        src_c = f"kernel pool {pool.num_threads} threads"
    except ImportError:
        C, src_c = profile.DEFAULT_C, "default (no kernels)"
    return P, C, f"measured in this bench, one at a time (P: memcpy of slots, C: {src_c})"


class DecodeBench:
    def __init__(self, a, mc, hb, device, dtype):
        self.a, self.mc, self.hb, self.device, self.dtype = a, mc, hb, device, dtype
        self.layers = list(mc.moe_layers)
        self.proxy = setup.InjectedRouting(None, self.layers)
        self.model = setup.bench_model(mc, self.proxy, device, dtype, hb, a.seed)
        self.kv = KVCache(mc, a.context + a.warmup + a.tokens + 1, device, dtype)
        self.state = create_state_cache(mc, device, dtype)  # Gated DeltaNet layers, else None
        if a.context:  # [L, 2, KV, max, hd]: stand-ins for a prompt's keys and values
            gen = torch.Generator(device).manual_seed(a.seed)
            self.kv.data[:, :, :, :a.context].normal_(generator=gen)

    def runtime(self, policy, frac, fill_behind=None, tuning=None, threads=None):
        """The engine's runtime for a row, with the rates the engine would read (the stored
        profile, which bandwidths() may have just calibrated)."""
        ec = EngineConfig(device=self.device, policy=policy, expert_cache_frac=frac,
                          cpu_threads=threads or self.a.cpu_threads, fill_behind=fill_behind,
                          tuning=Tuning(**(tuning or {})))
        rates = profile.expert_rates(self.hb.banks, ec, self.device)
        return create_expert_runtime(self.hb.banks, self.mc, ec, self.device, self.dtype, rates)

    @torch.inference_mode()
    def decode(self, n, step=None):
        """n decode steps from the proxy's cursor; seconds. Greedy token, one host sync per
        token (as the engine's sampler). step(token) -> logits: a graph replay; None: eager.
        self.sync_s: the seconds of those syncs (a replayed step's end that the host, done
        with its part, waits for: the last layers, the lm head, admissions still queued)."""
        tok = torch.zeros(1, dtype=torch.int64, device=self.device)
        setup.sync(self.device)
        t0, self.sync_s = time.perf_counter(), 0.0
        for _ in range(n):
            if step is not None:
                logits = step(tok)
            else:
                pos = torch.arange(self.kv.num_tokens, self.kv.num_tokens + 1, device=self.device)
                logits = self.model(tok, pos, self.kv, state=self.state)  # [1, V]
            tok = logits[-1].argmax().view(1)
            t1 = time.perf_counter()
            int(tok)
            self.sync_s += time.perf_counter() - t1
        setup.sync(self.device)
        return time.perf_counter() - t0

    def stepper(self, rt, graphs):
        """The decode step of a config: graph replay (cuda, --graphs) or None (eager)."""
        if not graphs or self.device != "cuda":
            return None
        if isinstance(rt, setup.PlainResident):
            return setup.plain_graph(self.model, self.kv, self.device, rt, self.state)
        graphs = DecodeGraphs(self.model, self.kv.pages, self.kv.max_tokens, rt, self.device,
                              state=self.state)
        return lambda token: graphs.forward(token, self.kv, self.state)

    def restart(self) -> None:
        """The sequence back to --context tokens (random KV; a zero recurrent state)."""
        self.kv.truncate(0)
        self.kv.commit(self.a.context)
        if self.state is not None:
            self.state.reset()
            self.state.commit(self.a.context)

    def run(self, policy, frac, trace, placement=None, graphs=True):
        """One config: set up the cache, warm-up tokens, timed tokens -> row dict."""
        a, H = self.a, self.a.history
        spec = row_spec(policy)
        kind, behind = spec.kind, spec.behind
        env = mock.patch.dict(os.environ, spec.env)  # the row's environment, until it ends
        env.start()
        policy = spec.base  # (static, cpu and plain are told apart below by name)
        note, step = "", None
        rt = (setup.PlainResident(self.hb, self.device, check_act(self.mc)) if policy == "plain"
              else self.runtime(kind, frac, behind, spec.tuning, spec.threads))
        try:
            if policy == "static":
                setup.install_static(rt, placement)
                setup.copy_resident(rt, self.hb)
            elif policy != "cpu" and getattr(rt, "cache", None) is not None and rt.cache.capacity:
                try:
                    setup.warm_by_replay(rt, trace.ids_np[:H], self.layers)
                    setup.copy_resident(rt, self.hb)
                except Exception as e:  # the replay uses runtime internals: if they moved, go on cold
                    rt.close()
                    rt = self.runtime(kind, frac, behind, spec.tuning, spec.threads)
                    note = f"cold cache (history replay failed: {type(e).__name__}: {e}) "
            self.proxy.runtime = rt
            self.restart()
            self.proxy.set_trace(trace.ids, trace.weights, cursor=H)
            step = self.stepper(rt, graphs)  # captures (plain) or captures on its first token
            self.decode(a.warmup, step)
            before = dict(rt.stats)
            gs = getattr(rt, "graph_step", None)
            times_before = dict(gs.times) if gs is not None else None
            dt = self.decode(a.tokens, step)
            note += f"token sync {self.sync_s / a.tokens * 1e6:.0f} us; "
            d = {k: rt.stats[k] - before.get(k, 0) for k in rt.stats if isinstance(rt.stats[k], (int, float))}
            if times_before is not None and gs.times["layers"] > times_before["layers"]:
                n_layers = gs.times["layers"] - times_before["layers"]
                note += "host per layer us: " + " ".join(
                    f"{k} {(gs.times[k] - times_before[k]) / n_layers * 1e6:.0f}"
                    for k in ("wait_gpu", "plan", "launch", "submit", "wait_cpu")) + "; "
            ex = getattr(rt, "executor", None)
            pool = getattr(ex, "pool", None)
            split = (f"{getattr(rt, 'split_info', 'plain')}; CPU experts: {getattr(ex, 'name', type(ex).__name__)}"
                     + (f" ({pool.num_threads} threads, {pool.isa})" if hasattr(pool, "isa") else ""))
            note += "graphs " if step is not None else "eager "
            if gs is not None and step is not None:
                note += f"[{gs.describe()}] "
        finally:
            env.stop()
            self.proxy.runtime = None
            step = None  # its graphs hold the runtime's cache: drop them before the next config
            rt.close()
            del rt
            gc.collect()
            if self.device == "cuda":
                torch.cuda.empty_cache()
        n = a.tokens
        if policy == "plain":  # no books: every route is a device hit
            d = {"hits": n * a.top_k * len(self.layers), "misses": 0, "fills": 0,
                 "bytes_filled": 0, "cpu_experts": 0}
        lookups = d["hits"] + d["misses"]
        return {"s_per_tok": dt / n, "hit": d["hits"] / lookups if lookups else float("nan"),
                "qm": d["fills"] / d["misses"] if d["misses"] else float("nan"),
                "gb_fill": d["bytes_filled"] / n / GB, "cpu_exp": d["cpu_experts"] / n,
                "misses": d["misses"] / n, "experts": lookups / n, "split": split, "note": note}


def out(line=""):
    print(line, flush=True)


def make_traces(a, mc, device) -> dict:
    """{workload: (ids, weights on the device, ids_np)} of history + warm-up + timed tokens;
    prints each workload's statistics and a 512-token batch's distinct experts per layer."""
    T = a.history + a.warmup + a.tokens
    traces = {}
    for wl in a.workloads.split(","):
        tr = routing.make_trace(wl, T + 512, len(mc.moe_layers), a.experts, a.top_k, a.seed)
        batch = routing.distinct_per_layer(tr.expert_ids[T:T + 512])
        out(f"# {wl}: distinct experts per layer in a 512-token batch (of {a.experts}): min {min(batch)} "
            f"median {int(np.median(batch))} max {max(batch)}: {' '.join(map(str, batch))}")
        for line in routing.workload_lines(wl, tr.expert_ids, a.experts):
            out(f"# {line}")
        ids, w = setup.to_device_trace(routing.Trace(wl, tr.expert_ids[:T], tr.weights[:T]), device)
        traces[wl] = SimpleNamespace(ids=ids, weights=w, ids_np=tr.expert_ids[:T])
    return traces


def decode_table(a, bench, traces, P, C, t_start) -> tuple:
    """Every config's rounds, each row printed as it finishes -> (results {(frac, workload,
    row): [row dict per round that ran]}, the resident rounds (T_gpu; empty if not run))."""
    hb, fracs, workloads = bench.hb, [float(f) for f in a.cache_fracs.split(",")], list(traces)
    N, results = a.repeat, {}

    def attempt(frac, wl, policy, note="", rnd=None, **kw):
        tag = f"#{rnd}/{N} " if rnd and N > 1 else ""
        if time.perf_counter() - t_start > a.max_seconds:
            out(f"{frac:>6.0%} {wl:<9} {policy:<8} {tag}skipped: past --max-seconds {a.max_seconds:g}")
            return []
        t0 = time.perf_counter()
        try:
            r = bench.run(policy, frac, traces[wl], **kw)
        except Exception as e:  # one failing config must not end the table
            out(f"{frac:>6.0%} {wl:<9} {policy:<8} {tag}FAILED: {type(e).__name__}: "
                f"{str(e).splitlines()[0][:200]}")
            traceback.print_exc(limit=3, file=sys.stderr)
            if bench.device == "cuda":
                torch.cuda.empty_cache()
            return []
        r["slot_bytes"] = hb.slot_bytes
        out(fmt_row(frac, wl, policy, r, f"{tag}{note}{r['note']}[{time.perf_counter() - t0:.1f} s]"))
        return [r]

    rounds, resident, wl0 = range(1, N + 1), [], workloads[0]
    if _fits_all(hb, bench.device):
        for rnd in rounds:
            resident += attempt(1.0, wl0, "resident", note="every expert cached: T_gpu ", rnd=rnd,
                                graphs=not a.eager)
            if hb.quant == "bf16" or bench.device == "cuda":  # (quantized: Triton reads them)
                results.setdefault((1.0, wl0, "plain"), []).extend(  # the summary's machinery ratio
                    attempt(1.0, wl0, "plain", note="experts plain weights, no cache (baseline) ",
                            rnd=rnd, graphs=not a.eager))
        if bench.device == "cuda" and not a.eager:
            attempt(1.0, wl0, "resident", note="every expert cached ", graphs=False)
    else:
        out(f"{1.0:>6.0%} {'':<9} {'resident':<8} skipped: not enough free memory for every expert")
    T_gpu = median_row(resident)["s_per_tok"] if resident else None
    cpu = {wl: [] for wl in workloads}  # cache-independent: one list of rounds for every size
    for rnd in rounds:
        for wl in workloads:
            cpu[wl] += attempt(0.0, wl, "cpu", note="cache-independent (q = 0, no cache) ", rnd=rnd,
                               graphs=not a.eager)
    results.update({(frac, wl, "cpu"): list(cpu[wl]) for frac in fracs for wl in workloads})
    for frac in fracs:
        for wl in workloads:
            kws = {policy: {} for policy in a.policies.split(",")}
            if "static" in kws:
                cap = math.floor(frac * len(bench.layers) * a.experts + 1e-9)  # as cache_capacity
                kws["static"]["placement"] = setup.static_placement(
                    traces[wl].ids_np[:a.history + a.warmup], bench.layers, a.experts, cap)
            for rnd in rounds:
                for policy in a.policies.split(","):
                    r = attempt(frac, wl, policy, rnd=rnd, graphs=not a.eager, **kws[policy])
                    done = results.setdefault((frac, wl, policy), [])
                    done += r
                    if r and policy == "hybrid" and len(done) == 1:  # the first hybrid row
                        out(f"{'':>6} {'':<9} {'':<8} split: {r[0]['split']}")
            hybrid = results.get((frac, wl, "hybrid"))
            if hybrid and T_gpu:
                h = median_row(hybrid)
                t_lim = T_gpu + h["misses"] * hb.slot_bytes / ((P + C) * GB)
                results[(frac, wl, "limit")] = [{"s_per_tok": t_lim}]
                out(f"{frac:>6.0%} {wl:<9} {'limit':<8} {1 / t_lim:>8.2f} {t_lim * 1e3:>9.1f}  "
                    f"T_gpu {T_gpu * 1e3:.1f} ms + {h['misses']:.1f} misses/tok x "
                    f"{hb.slot_bytes / 1e6:.2f} MB / {P + C:.1f} GB/s"
                    + (f" (T_gpu: median of {len(resident)}, misses: mean of {len(hybrid)} rounds)"
                       if N > 1 else ""))
    return results, resident


def main(argv=None):
    a = parse_args(argv)
    t_start = time.perf_counter()
    for wl in a.workloads.split(","):
        if wl not in routing.WORKLOADS:
            sys.exit(f"error: unknown workload {wl!r}; use {','.join(routing.WORKLOADS)}")
    by_quant = {}
    for quant in a.quants:
        a.quant = quant
        by_quant[quant] = run_banks(a, t_start)
        gc.collect()  # this type's banks go before the next type's are built
    if len(by_quant) > 1:
        out()
        out(quant_summary(by_quant, a.workloads.split(","), a.policies.split(",")))


def run_banks(a, t_start) -> tuple:
    """The decode table (and --prefill-lengths') on banks of type a.quant -> (results of
    decode_table, {cache fraction: label})."""
    with setup.bench_banks(a, "bench_decode") as (mc, hb, device, dtype):
        labels = cache_sizes(a, hb)
        out(f"# device {device}, compute {str(dtype).replace('torch.', '')}; non-expert part: the real "
            f"{mc.family} layers (freetoken.models) with random weights on the device, KV context grows "
            f"{a.context}..{a.context + a.warmup + a.tokens}; routing injected from the workload trace (routers still run)")
        out(f"# per config: {a.history} history tokens replayed (cache books) + {a.warmup} warm-up tokens "
            f"(excluded) + {a.tokens} timed tokens; seed {a.seed}")
        P, C, source = bandwidths(a, hb, device)  # cuda: this type's profile (calibrated)
        out(f"# limit model bandwidths: P={P:.1f} GB/s, C={C:.1f} GB/s, P+C={P + C:.1f} GB/s; {source}")
        bench = DecodeBench(a, mc, hb, device, dtype)
        traces = make_traces(a, mc, device)
        out()
        out(HEADER)
        out("-" * len(HEADER))
        results, resident = decode_table(a, bench, traces, P, C, t_start)
        out(summary(results, [float(f) for f in a.cache_fracs.split(",")], list(traces), resident,
                    a.policies.split(",")))
        out(f"# decode total {time.perf_counter() - t_start:.0f} s")
        del bench, traces
        if a.prefill_lengths and time.perf_counter() - t_start > a.max_seconds:
            out(f"# prefill table skipped: past --max-seconds {a.max_seconds:g}")
        elif a.prefill_lengths:
            import bench_prefill
            out()
            bench_prefill.run(SimpleNamespace(**vars(a), lengths=a.prefill_lengths, workload="uniform",
                                              no_resident=False), mc, hb, device, dtype)
            out(f"# total {time.perf_counter() - t_start:.0f} s")
    return results, labels


# ---- --quant and --expert-cache-gb (issue 35) ------------------------------------------------------

def add_quant_args(ap) -> None:
    qb.add_quant_arg(ap)
    ap.add_argument("--expert-cache-gb", default="", metavar="GB[,GB...]",
                    help="expert cache sizes in GB (10^9 bytes) beside --cache-fracs, each type's "
                         "slots from its own slot size (bf16's 25%% is 14.5 GB)")


def parse_quant_args(ap, a) -> None:
    a.quants = qb.parse_quants(a.quant)
    try:
        a.cache_gbs = [float(v) for v in a.expert_cache_gb.split(",") if v.strip()]
        a.fracs_given = [float(v) for v in a.cache_fracs.split(",") if v.strip()]
    except ValueError as e:
        ap.error(f"--expert-cache-gb / --cache-fracs take comma lists of numbers: {e}")
    if not a.cache_gbs and not a.fracs_given:
        ap.error("give a cache size: --cache-fracs or --expert-cache-gb")
    if a.device == "cuda" and "nvfp4" in a.quants:
        ap.error("nvfp4 experts run on --device cpu only so far (the device kernels read "
                 "freetoken.kernel_args.DEVICE_QUANTS); leave nvfp4 out of --quant on cuda")
    if a.device == "cuda" and a.shape == "gpt-oss-20b" and a.quants != ["bf16"]:
        ap.error("quantized experts with biases (gpt-oss) run on --device cpu only so far "
                 "(engine._refuse_quantized); use --quant bf16 or --device cpu")


def cache_sizes(a, hb) -> dict:
    """Set a.cache_fracs for these banks: --cache-fracs, then each --expert-cache-gb as the
    fraction of experts its slots hold (capped at every expert; a size equal to another's
    fraction runs once) -> {fraction: label} ("25%", "14.5 GB", "25% = 14.5 GB")."""
    total = hb.total_bytes // hb.slot_bytes
    labels = {f: f"{f:.0%}" for f in a.fracs_given}
    for gb in a.cache_gbs:
        slots = min(total, math.floor(gb * GB / hb.slot_bytes))
        f = slots / total
        labels[f] = (labels[f] + " = " if f in labels else "") + f"{gb:g} GB"
        out(f"# --expert-cache-gb {gb:g}: {slots} of {total} {hb.quant} slots of "
            f"{hb.slot_bytes / 1e6:.2f} MB, the {f:.1%} row")
    a.cache_fracs = ",".join(repr(f) for f in labels)
    return labels


def quant_summary(by_quant, workloads, policies) -> str:
    """Every type's median tok/s per cache size label, workload and row, beside bf16's (the
    issue 35 goals: 4-bit >= 3x bf16, q8_0 >= 1.7x), rows that ran for some type."""
    types = list(by_quant)
    base = "bf16" if "bf16" in by_quant else None
    tps = {}  # (label, workload, row) -> {type: tok/s}
    for quant, (results, labels) in by_quant.items():
        for (frac, wl, row), rounds in results.items():
            if rounds and frac in labels:
                for label in labels[frac].split(" = "):
                    tps.setdefault((label, wl, row), {})[quant] = 1 / median_row(rounds)["s_per_tok"]
    order = ["cpu", *policies, "limit"]
    keys = sorted(tps, key=lambda k: (k[0], workloads.index(k[1]) if k[1] in workloads else 99,
                                      order.index(k[2]) if k[2] in order else 99))
    hdr = "| cache | workload | row | " + " | ".join(
        t if t == base or base is None else f"{t} | x {base}" for t in types) + " |"
    lines = ["# tok/s per expert bank type (medians of the rounds); x bf16: tok/s over bf16's in "
             "the same row; goals (issue 35): 4-bit >= 3x, q8_0 >= 1.7x", "", hdr,
             "|" + "---|" * (hdr.count("|") - 1)]
    for key in keys:
        cells = []
        for t in types:
            v = tps[key].get(t)
            cells.append(f"{v:.2f}" if v else "-")
            if base is not None and t != base:
                b = tps[key].get(base)
                cells.append(f"{v / b:.2f}" if v and b else "-")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fits_all(hb, device) -> bool:
    """Room for a second copy of every expert (the all-resident T_gpu run) plus a margin."""
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        return free > hb.total_bytes + 4 * GB
    avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return avail > hb.total_bytes + 2 * GB


if __name__ == "__main__":
    main()
