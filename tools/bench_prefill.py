"""Prefill bench: time and tok/s of one prompt forward of 512, 2K, 8K and 16K tokens through the
runtime's prefill streaming path (whole expert layers double-buffered onto the device), against
expert_bytes / B_P (every layer crosses PCIe once) and against the compute time of the same
forward with every expert resident on the device. Same model and banks as bench_decode.py
(Qwen3-30B-A3B-shaped bf16, random weights, host banks built in memory); routing injected from
the uniform workload (every layer touches ~all experts). Fixed seed; one warm-up forward per
runtime excluded; rows printed as they finish.

Beside it, per prompt and buffer count (--buffers 2,3: Tuning.prefill_buffers), the
stream's timeline from CUDA events on the copy and compute streams (cpu: clock stamps), read
back after each forward: wall = lead + copy busy + copy idle + tail, where copy idle splits into
waits for a free buffer (the compute of the layer N places earlier) and waits for the host to
issue the copy; copy GB/s while the compute runs; mean copy and expert-compute ms per layer; the
time the compute stood waiting for copies. Then the crossover (--crossover lengths): the same
prompt through three runtimes with the expert cache at --crossover-cache (hybrid split):
Tuning.prefill_choice auto (per layer, freetoken/experts/prefill/choice.py, fed the
B_P measured here and the CPU experts' GFLOP/s measured here), forced stream (every layer, from
one token) and forced slot (every layer planned; tools/prefill_crossover.py); per prompt the auto runtime's per-layer
choices (streamed/slot), the three wall times, and the model's expert-phase predictions from
the auto runtime's decisions: every layer streamed (sum of E * s / B_P), every layer through
the slot path, and its own choices.

    python tools/bench_prefill.py                                  # full shape, cuda
    python tools/bench_prefill.py --buffers 2,3 --crossover 16,32,64,128,256,512
    python tools/bench_prefill.py --device cpu --layers 4 --experts 16 --hidden 256 --inter 128 \
        --top-k 4 --vocab 1024 --heads 4 --kv-heads 2 --head-dim 64 --lengths 64,256 \
        --crossover 4,16,64,256

--quant TYPE[,TYPE...] (issue 35): the tables once per expert bank type (bf16 experts as
`convert --quant TYPE` writes them, bench_quant_banks.py): streaming moves the quantized bytes,
so expert_bytes / B_P shrinks with them; then one line per type of the longest prompt's
stream time against that bound.

    python tools/bench_prefill.py --quant bf16,q8_0,q4_0,mxfp4 --lengths 8192 --crossover ''
"""
import argparse
import gc
import os
import sys
import time
import traceback

import numpy as np
import torch

import bench_moe_setup as setup
import bench_quant_banks as qb
import bench_routing as routing
from prefill_crossover import _close_runtimes, crossover_table
from freetoken import profile
from freetoken.config import EngineConfig, Tuning
from freetoken.experts import create_expert_runtime
from freetoken.kv_cache import KVCache

GB = 1e9


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    setup.add_shape_args(ap)
    ap.add_argument("--lengths", default="512,2048,8192,16384", help="prompt lengths (one forward each)")
    ap.add_argument("--workload", default="uniform", choices=routing.WORKLOADS)
    ap.add_argument("--no-resident", action="store_true", help="skip the all-experts-resident compute run")
    ap.add_argument("--buffers", default="2",
                    help="device layer buffers of the streamed runs, a list to compare (2,3) [2]")
    ap.add_argument("--no-timeline", action="store_true",
                    help="do not record the copy/compute events (the timeline table)")
    ap.add_argument("--crossover", default="16,32,64,128,256,512",
                    help="prompt lengths of the streamed-vs-slot-path table ('' skips it)")
    ap.add_argument("--crossover-cache", type=float, default=0.25,
                    help="expert cache fraction of the slot path in the crossover table [0.25]")
    ap.add_argument("--cpu-gflops", type=float, default=None,
                    help="CPU experts' GFLOP/s for the auto choice [measured here]")
    ap.add_argument("--explain", action="store_true",
                    help="after the crossover table, the auto runtime's slot-path layers per "
                         "length with the model's numbers (prefill_choice.LayerCost)")
    qb.add_quant_arg(ap)
    a = ap.parse_args(argv)
    a.quants = qb.parse_quants(a.quant)
    if a.device == "cuda" and "nvfp4" in a.quants:
        ap.error("nvfp4 experts run on --device cpu only so far (the device kernels read "
                 "freetoken.kernel_args.DEVICE_QUANTS); leave nvfp4 out of --quant on cuda")
    return a


def measure_bp(hb, device) -> tuple:
    """(GB/s, slowest layer GB/s, fastest layer GB/s, how) of whole-layer copies from the host
    banks to the device, alone, as streaming does them: pinned H2D copies on cuda (each timed by
    events), numpy copies (the cpu tier's streamer) on cpu. Every layer once after one warm-up
    copy: the banks span all of host memory (NUMA nodes, huge pages or not), so a few layers can
    flatter B_P; GB/s = all expert bytes / the time of all the copies."""
    banks = [hb.banks[l] for l in sorted(hb.banks)]
    times = []
    if device == "cuda":
        dst = torch.empty(hb.layer_bytes, dtype=torch.uint8, device=device)
        srcs = [torch.from_numpy(b.data) for b in banks]
        dst.copy_(srcs[0], non_blocking=True)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(srcs) + 1)]
        events[0].record()
        for s, ev in zip(srcs, events[1:]):
            dst.copy_(s, non_blocking=True)
            ev.record()
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:])]
        how = "pinned H2D whole-layer copies of every layer, alone, measured here"
    else:
        dst = np.empty(hb.layer_bytes, dtype=np.uint8)
        np.copyto(dst, banks[0].data)
        for b in banks:
            t0 = time.perf_counter()
            np.copyto(dst, b.data)
            times.append(time.perf_counter() - t0)
        how = "numpy whole-layer copies of every layer (the cpu tier's streamer), measured here"
    per_layer = [hb.layer_bytes / max(t, 1e-12) / GB for t in times]
    return len(banks) * hb.layer_bytes / sum(times) / GB, min(per_layer), max(per_layer), how


class PrefillBench:
    def __init__(self, a, mc, hb, device, dtype, max_len):
        self.a, self.mc, self.hb, self.device, self.dtype = a, mc, hb, device, dtype
        self.proxy = setup.InjectedRouting(None, list(mc.moe_layers))
        self.model = setup.build_random_model(mc, self.proxy, device, dtype, a.seed)
        self.kv = KVCache(mc, max_len, device, dtype)
        self.trace = routing.make_trace(a.workload, max_len, len(mc.moe_layers), a.experts, a.top_k, a.seed)
        self.distinct = {n: self.distinct_at(n) for n in sorted({min(512, max_len), max_len})}
        self.proxy.set_trace(*setup.to_device_trace(self.trace, device))
        self.tokens = torch.randint(0, mc.vocab_size, (max_len,), device=device,
                                    generator=torch.Generator(device=device).manual_seed(a.seed))

    def distinct_at(self, n) -> list:
        """Distinct experts per layer routed by the first n tokens."""
        return routing.distinct_per_layer(self.trace.expert_ids[:n])

    def runtime(self, resident: bool, buffers: int = 2, stream=True, cache_frac=0.0, min_tokens=None,
                choice="stream", **tuning):
        """resident: every expert in the device cache (preloaded). Else streaming on with
        `buffers` layer buffers (the cpu device streams into its cpu tier) above min_tokens
        (None: the engine's default) for the layers `choice` (prefill_choice: stream = every
        layer, auto, slot = none) picks, or (stream False) the slot path, with an expert cache
        of cache_frac. tuning: more config.Tuning fields. The rates are the engine's (the
        stored profile)."""
        tuning = Tuning(prefill_stream=stream, prefill_buffers=buffers, prefill_choice=choice,
                        prefill_stream_min_tokens=min_tokens, **tuning)
        ec = EngineConfig(device=self.device, policy="hybrid", cpu_threads=self.a.cpu_threads,
                          expert_cache_frac=1.0 if resident else cache_frac, tuning=tuning)
        rates = profile.expert_rates(self.hb.banks, ec, self.device)
        rt = create_expert_runtime(self.hb.banks, self.mc, ec, self.device, self.dtype, rates)
        if rt.streamer is not None:
            rt.streamer.timing = stream and not resident and not getattr(self.a, "no_timeline", False)
        return rt

    @torch.inference_mode()
    def prefill(self, rt, n) -> tuple:
        """One n-token forward from an empty KV cache -> (seconds, stats delta, the stream's
        StreamTimeline or None)."""
        self.proxy.runtime = rt
        self.kv.truncate(0)
        self.proxy.set_trace(self.proxy.ids, self.proxy.weights, cursor=0)
        before = dict(rt.stats)
        streamer = getattr(rt, "streamer", None)
        if streamer is not None:
            streamer.timeline = None  # set again by this forward's begin() if it streams
        setup.sync(self.device)
        t0 = time.perf_counter()
        logits = self.model(self.tokens[:n], torch.arange(n, device=self.device), self.kv, num_logits=1)
        timeline = streamer.timeline if streamer is not None else None
        if timeline is not None:
            timeline.mark("end")
        int(logits[-1].argmax())
        setup.sync(self.device)
        dt = time.perf_counter() - t0
        stats = {k: v - before.get(k, 0) for k, v in rt.stats.items() if isinstance(v, (int, float))}
        return dt, stats, timeline


def out(line=""):
    print(line, flush=True)


def experts_line(device) -> str:
    """How the streamed and resident layers' experts compute (what grouped_experts.chosen reads
    of the device and the install)."""
    from freetoken.experts.compute import grouped_experts
    if device != "cuda":
        return "as the cpu tier does (no grouped kernels off cuda)"
    if not grouped_experts.available():
        return "per-expert matmuls (no Triton)"
    return "grouped Triton kernels, streamed and resident layers"


def _room_for_resident(hb, device) -> bool:
    if device == "cuda":
        return torch.cuda.mem_get_info()[0] > hb.total_bytes + 6 * GB
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") > hb.total_bytes + 2 * GB


def _ints(text) -> list:
    return [int(v) for v in str(text).split(",") if v.strip()]


def timeline_row(timeline) -> dict:
    """The stream's timeline of one forward, summed (ms unless named): wall = lead + busy +
    idle + tail, idle = buffer_wait + host_late (see the module docstring)."""
    spans = timeline.spans()  # sorted by copy start
    n = len(spans)
    busy = sum(s.copy_end - s.copy for s in spans)
    gaps = list(zip(spans, spans[1:]))
    return dict(
        wall=timeline.elapsed_ms("end"), layers=n, lead=spans[0].copy if n else 0.0, busy=busy,
        idle=sum(b.copy - a.copy_end for a, b in gaps),
        buffer_wait=sum(b.copy - max(b.queued, a.copy_end) for a, b in gaps),
        host_late=sum(max(0.0, b.queued - a.copy_end) for a, b in gaps),
        tail=timeline.elapsed_ms("end") - spans[-1].copy_end if n else 0.0,
        gbps=sum(s.nbytes for s in spans) / max(busy, 1e-9) / 1e6,
        copy_ms=busy / max(n, 1), expert_ms=sum(s.compute_end - s.compute for s in spans) / max(n, 1),
        stalled=sum(s.compute - s.want for s in spans))


TIMELINE_HDR = (f"{'tokens':>7} {'bufs':>4} {'wall ms':>9} {'lead':>6} {'copy busy':>9} {'copy idle':>9} "
                f"{'buf wait':>8} {'host late':>9} {'tail':>7} {'GB/s':>6} {'copy ms/l':>9} "
                f"{'expert ms/l':>11} {'stalled ms':>10}")


def timeline_line(n, buffers, r) -> str:
    return (f"{n:>7} {buffers:>4} {r['wall']:>9.1f} {r['lead']:>6.1f} {r['busy']:>9.1f} {r['idle']:>9.1f} "
            f"{r['buffer_wait']:>8.1f} {r['host_late']:>9.1f} {r['tail']:>7.1f} {r['gbps']:>6.1f} "
            f"{r['copy_ms']:>9.2f} {r['expert_ms']:>11.2f} {r['stalled']:>10.1f}")


def stream_table(a, bench, lengths, buffer_counts, t_bp) -> dict:
    """The main table (one row per prompt length and buffer count), then the timelines ->
    {(tokens, buffers): (stream s, resident s)} of the rows that ran."""
    rts, timelines, done = {}, [], {}
    try:
        for nb in buffer_counts:
            rts[nb] = bench.runtime(resident=False, buffers=nb)
        if a.no_resident:
            out("# resident compute run skipped (--no-resident)")
        elif _room_for_resident(bench.hb, bench.device):
            rts["resident"] = bench.runtime(resident=True)
        else:
            out("# resident compute run skipped: no room for a second copy of every expert")
        for rt in rts.values():  # warm-up forwards, excluded
            bench.prefill(rt, min(lengths))
        for nb in buffer_counts:
            out(f"# {nb} layer buffers: {rts[nb].streamer.memory_bytes / GB:.2f} GB of device memory")
        hdr = (f"{'tokens':>7} {'bufs':>4} {'stream s':>9} {'tok/s':>9} {'resident s':>10} {'tok/s':>9} "
               f"{'bytes/B_P s':>11} {'max(.,.) s':>10} {'stream/max':>10} {'layers':>6} {'GB streamed':>11}")
        out()
        out(hdr)
        out("-" * len(hdr))
        for n in lengths:
            try:
                tr = bench.prefill(rts["resident"], n)[0] if "resident" in rts else float("nan")
                for nb in buffer_counts:
                    ts, st, timeline = bench.prefill(rts[nb], n)
                    bound = max(t_bp, tr) if tr == tr else t_bp
                    note = "" if st.get("prefill_layers_streamed") else "  (NOT streamed: slot path)"
                    done[(n, nb)] = (ts, tr)
                    out(f"{n:>7} {nb:>4} {ts:>9.3f} {n / ts:>9.0f} {tr:>10.3f} {n / tr:>9.0f} {t_bp:>11.3f} "
                        f"{bound:>10.3f} {ts / bound:>10.2f} {st.get('prefill_layers_streamed', 0):>6} "
                        f"{st.get('bytes_streamed', 0) / GB:>11.2f}{note}")
                    if timeline is not None:
                        timelines.append((n, nb, timeline_row(timeline)))
            except Exception as e:  # one failing length must not end the table
                out(f"{n:>7} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                traceback.print_exc(limit=3, file=sys.stderr)
        out("goal: 8K tokens stream/max <= 1.15 (max = max(expert_bytes / B_P, resident compute))")
    finally:
        _close_runtimes(bench, rts)
    if timelines:
        out()
        out("# stream timeline per forward (ms; cuda events on the copy and compute streams): wall = lead "
            "+ copy busy + copy idle + tail; copy idle = buf wait (the copy waited for the compute of the "
            "layer N earlier to free its buffer) + host late (issued after the copy stream ran dry); GB/s "
            "in the copies while the compute runs; stalled = time the compute waited for copies")
        out(TIMELINE_HDR)
        out("-" * len(TIMELINE_HDR))
        for n, nb, r in timelines:
            out(timeline_line(n, nb, r))
    return done


def run(a, mc, hb, device, dtype) -> dict:
    """The prefill tables for a.lengths on the given host banks (bench_decode.py reuses it,
    without the crossover) -> {"t_bp": expert bytes / B_P, "bytes": expert bytes, "rows":
    stream_table's}."""
    lengths = _ints(a.lengths)
    buffer_counts = _ints(getattr(a, "buffers", "2")) or [2]
    cross = _ints(getattr(a, "crossover", ""))
    bench = PrefillBench(a, mc, hb, device, dtype, max(lengths + cross))
    bp, bp_min, bp_max, how = measure_bp(hb, device)
    t_bp = hb.total_bytes / (bp * GB)
    out(f"# prefill: device {device}, compute {str(dtype).replace('torch.', '')}; real qwen3_moe layers, "
        f"random weights; routing injected ({a.workload}); one forward per prompt (no chunking), KV from empty")
    out(f"# B_P = {bp:.1f} GB/s ({how}; layers {bp_min:.1f} to {bp_max:.1f} GB/s); "
        f"expert_bytes / B_P = {t_bp:.2f} s")
    out(f"# experts: {experts_line(device)}")
    for n, d in bench.distinct.items():
        out(f"# {a.workload}: distinct experts per layer in the first {n} tokens: min {min(d)} "
            f"median {int(np.median(d))} max {max(d)}")
    rows = stream_table(a, bench, lengths, buffer_counts, t_bp)
    if cross:
        crossover_table(a, bench, cross, buffer_counts[0], bp)
    return {"t_bp": t_bp, "bp": bp, "bytes": hb.total_bytes, "rows": rows}


def main(argv=None):
    a = parse_args(argv)
    t_start = time.perf_counter()
    by_quant = {}
    for quant in a.quants:
        a.quant = quant
        with setup.bench_banks(a, "bench_prefill") as (mc, hb, device, dtype):
            by_quant[quant] = run(a, mc, hb, device, dtype)
            out(f"# total {time.perf_counter() - t_start:.0f} s")
        gc.collect()  # this type's banks go before the next type's are built
    if len(by_quant) > 1:
        out()
        out(quant_summary(by_quant, max(_ints(a.lengths))))


def quant_summary(by_quant, n) -> str:
    """Per bank type: the n-token prompt's stream time (each buffer count) against the type's
    expert bytes / B_P and bf16's stream time (issue 35's goal: stream <= 1.15 x bytes / B_P)."""
    base = by_quant.get("bf16")
    hdr = ("| type | expert GB | B_P GB/s | bytes/B_P s | resident s | bufs | stream s | "
           "stream / (bytes/B_P) | stream / max | x bf16 tok/s |")
    lines = [f"# {n}-token prompt per expert bank type; goal (issue 35): stream / (bytes/B_P) <= 1.15; "
             "max = max(bytes/B_P, resident: every expert on the device, the compute alone)",
             "", hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for quant, r in by_quant.items():
        for (tokens, nb), (ts, tr) in sorted(r["rows"].items()):
            if tokens != n:
                continue
            b = base["rows"].get((tokens, nb)) if base else None
            speed = f"{b[0] / ts:.2f}" if b else "-"
            bound = max(r["t_bp"], tr) if tr == tr else r["t_bp"]  # (tr NaN: not run)
            lines.append(f"| {quant} | {r['bytes'] / GB:.2f} | {r['bp']:.1f} | {r['t_bp']:.3f} | {tr:.3f} | "
                         f"{nb} | {ts:.3f} | {ts / r['t_bp']:.2f} | {ts / bound:.2f} | {speed} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
