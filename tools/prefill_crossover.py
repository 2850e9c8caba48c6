"""The crossover table of tools/bench_prefill.py: the same prompt through three runtimes with
the expert cache at --crossover-cache (prefill_choice auto, forced stream, forced slot), one line
per prompt length with the auto runtime's per-layer choices and the model's expert-phase
predictions; with --explain, the auto runtime's slot-path layers and the model's numbers
(prefill_choice.LayerCost). bench_prefill.run calls crossover_table."""
import sys
import traceback

import numpy as np
import torch

from freetoken import bandwidth as bw, kernels


def out(line=""):
    print(line, flush=True)


def measure_cpu_gflops(hb, threads) -> float:
    """GFLOP/s of the CPU experts per extra route at many tokens per expert (prefill/choice.py's
    F), measured as `freetoken profile` measures it (bandwidth.time_route_flops) on the kernel
    pool and the bench's first bank."""
    bank = hb.banks[min(hb.banks)]
    return bw.time_route_flops(kernels.get_pool(threads), bank.data,
                               kernels.layout_from_bank_info(bank.info), seconds=0.3)


CROSS_HDR = (f"{'tokens':>7} {'distinct':>8} {'misses/l':>8} {'str/slot':>8} {'auto s':>8} "
             f"{'stream s':>8} {'slot s':>8} {'best':>6} {'auto/best':>9} {'model auto ms':>13} "
             f"{'model stream ms':>15} {'model slot ms':>13}")


def crossover_row(n, bench, times, log, L) -> str:
    """One crossover line: times {auto, stream, slot} s; log: the auto runtime's LayerCosts."""
    best = min(times, key=times.get)
    n_stream = sum(c.streamed for c in log)
    model_auto = sum(c.stream_us if c.streamed else c.slot_us for c in log) / 1e3
    model_stream = sum(c.copy_us for c in log) / 1e3
    model_slot = sum(c.slot_us for c in log) / 1e3
    misses = np.median([c.misses for c in log]) if log else float("nan")
    return (f"{n:>7} {int(np.median(bench.distinct_at(n))):>8} {misses:>8.1f} "
            f"{f'{n_stream}/{len(log) - n_stream}':>8} {times['auto']:>8.3f} {times['stream']:>8.3f} "
            f"{times['slot']:>8.3f} {best:>6} {times['auto'] / times[best]:>9.2f} {model_auto:>13.3f} "
            f"{model_stream:>15.3f} {model_slot:>13.3f}")


def explain(logs: dict) -> None:
    """Per prompt length, the auto runtime's layers that took the slot path (LayerCost: routed
    experts u, misses m, fills q, CPU routes, the model's stream / slot / whole-copy µs)."""
    out("# explain: slot-path layers of the auto runtime (model µs; stream = its copy left, or "
        "all of it when not issued ahead)")
    for n, log in logs.items():
        slot = [c for c in log if not c.streamed]
        out(f"# {n} tokens: {len(slot)} of {len(log)} layers on the slot path" + (":" if slot else ""))
        for c in slot[:16]:
            out(f"#   layer {c.layer:>3} u {c.distinct:>3} m {c.misses:>3} q {c.filled:>3} "
                f"cpu routes {c.cpu_routes:>6} stream {c.stream_us:>9.0f} slot {c.slot_us:>9.0f} "
                f"copy {c.copy_us:>8.0f}")


def crossover_table(a, bench, lengths, buffers, bp) -> None:
    """Short to long prompts through the per-layer prefill choice (auto) against every layer
    streamed and every layer through the slot path, all with an expert cache of
    a.crossover_cache (module docstring)."""
    threads = a.cpu_threads
    gflops = a.cpu_gflops or measure_cpu_gflops(bench.hb, threads)
    rts = {}
    try:
        model = {"prefill_stream_gbps": bp, "prefill_cpu_gflops": gflops}
        common = dict(buffers=buffers, cache_frac=a.crossover_cache, **model)
        rts["auto"] = bench.runtime(resident=False, choice="auto", **common)
        rts["stream"] = bench.runtime(resident=False, choice="stream", min_tokens=1, **common)
        rts["slot"] = bench.runtime(resident=False, choice="slot", **common)
        for rt in rts.values():
            rt.streamer.timing = False
            bench.prefill(rt, min(lengths))  # warm-up (the slot paths' caches keep what they filled)
        auto, L = rts["auto"], len(bench.mc.moe_layers)
        auto.prefill_choice.log = []
        out()
        out(f"# crossover: prefill_choice auto vs stream vs slot (buffers={buffers}; expert cache "
            f"{a.crossover_cache:.0%} = {auto.cache.capacity} slots each, kept from the forwards before; "
            f"P={auto.P:g} C={auto.C:g} GB/s{' (cpu device placeholders)' if bench.device == 'cpu' else ''}, "
            f"B_P={bp:.1f} GB/s, CPU experts {gflops:.0f} GFLOP/s "
            f"({'given' if a.cpu_gflops else 'measured'}{', not used on the cpu device' if bench.device == 'cpu' else ''}))")
        out(f"# {auto.prefill_choice.describe()}; per layer (median): distinct experts, misses; "
            f"str/slot: layers the auto runtime streamed / planned; model: expert-phase ms "
            f"from its decisions (every layer streamed = E*s/B_P each, every layer planned, its choices)")
        out(CROSS_HDR)
        out("-" * len(CROSS_HDR))
        best_at = {"auto": [], "stream": [], "slot": []}
        logs = {}
        for n in lengths:
            try:
                times = {}
                for name in ("auto", "stream", "slot"):
                    times[name] = bench.prefill(rts[name], n)[0]
                    if name == "auto":
                        log = list(auto.prefill_choice.log)
            except Exception as e:
                out(f"{n:>7} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                traceback.print_exc(limit=3, file=sys.stderr)
                continue
            best_at[min(times, key=times.get)].append(n)
            logs[n] = log
            out(crossover_row(n, bench, times, log, L))
        out(f"# fastest: stream at {best_at['stream'] or 'no length'}, slot at {best_at['slot'] or 'no length'}, "
            f"auto at {best_at['auto'] or 'no length'} (tokens)")
        if getattr(a, "explain", False):
            explain(logs)
    finally:
        _close_runtimes(bench, rts)


def _close_runtimes(bench, rts: dict) -> None:
    """Detach the routing proxy, close the runtimes and drop them (their caches and buffers)
    before emptying the device's cache."""
    bench.proxy.runtime = None
    for rt in rts.values():
        rt.close()
    rts.clear()
    if bench.device == "cuda":
        torch.cuda.empty_cache()
