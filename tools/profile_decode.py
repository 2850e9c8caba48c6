"""Decode-step profile: where the time of one decode token goes. Builds a qwen3_moe-shaped model
with random weights in memory (bench_moe_setup.py: host banks, the real model layers, routing
injected from a workload trace), runs --tokens decode steps for ms/token, then the same number
under torch.profiler, and prints
  (a) ms/token (unprofiled) and driver CPU ms/token (process CPU time of the timed steps); the
      host's time per token in the step call (a replay: its launch, then serving the CPU side)
      and in the token's sync after it (the step's end the host waits for: with GPU-resident
      control the layers after the last CPU job, the lm head, the admissions still queued),
  (b) the top ops by self CPU time and, on cuda, by device time,
  (c) synchronising calls and copies per token and per MoE layer (aten::item,
      aten::_local_scalar_dense, cuda*Synchronize, cudaMemcpy, Memcpy DtoH/HtoD, ...), plus
      aten ops and kernel launches per layer: the eager path's per-layer cost.
Build only a few layers' banks (--layers 8) to keep it short: per-layer figures are what count.

    python tools/profile_decode.py --device cuda --layers 8 --cache-frac 1
    python tools/profile_decode.py --device cuda --layers 8 --cache-frac 0.25 --policy hybrid
    python tools/profile_decode.py --device cpu --layers 4 --cache-frac 0.25 --tier-compute torch
    python tools/profile_decode.py --device cuda --layers 8 --cache-frac 1 --graph   # (d): kernels

--graph (cuda) replays the decode step from its CUDA graphs (freetoken.graphs) instead of eager
launches. On cuda (d) lists device kernels per token and per layer, their summed device time
against the token's wall time (the rest is gaps between graph nodes and waits) and the kernels by
name; (e) the main stream's idle gaps by the kernels around them (a wait for the CPU's job shows
there); (f) under GPU-resident control, per MoE layer the time from its plan kernel (its last store
raises `ready`) to its finish kernel's end beside the host server's ready-to-done: the flags'
round trip.
"""
import argparse
import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile

import bench_moe_setup as setup
import bench_routing as routing
from bench_host_banks import HostBanks
from freetoken import profile as ft_profile
from freetoken.config import EngineConfig, Tuning
from freetoken.experts import create_expert_runtime
from freetoken.graphs import DecodeGraphs
from freetoken.kv_cache import KVCache

# substrings of profiler event names that mean "the host waits for the device" or a copy
SYNC_NAMES = ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize",
              "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync",
              "Memcpy DtoH", "Memcpy HtoD", "Memcpy DtoD", "aten::copy_", "aten::to",
              "aten::nonzero", "cudaLaunchKernel", "cudaHostAlloc")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    setup.add_shape_args(ap)
    ap.set_defaults(layers=8)
    ap.add_argument("--cache-frac", type=float, default=1.0, help="expert cache, fraction of all experts")
    ap.add_argument("--policy", default="hybrid", choices=("hybrid", "offload", "cpu"))
    ap.add_argument("--workload", default="uniform", choices=routing.WORKLOADS)
    ap.add_argument("--fill-behind", type=int, default=None, metavar="N",
                    help="hybrid admissions per layer step (run's --fill-behind; default: the engine's)")
    ap.add_argument("--tokens", type=int, default=8, help="decode tokens timed, then as many profiled")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--history", type=int, default=64, help="trace tokens replayed to warm the cache books")
    ap.add_argument("--tier-compute", default="auto", choices=("auto", "torch"),
                    help="cpu device tier: torch runs the tier's experts with torch ops (the cuda path's shape)")
    ap.add_argument("--cpu-experts", default="auto", choices=("auto", "torch", "kernels"))
    ap.add_argument("--rows", type=int, default=25, help="rows of each op table")
    ap.add_argument("--trace-out", default=None, metavar="PATH",
                    help="cuda: also write the profiled steps as a chrome trace (json)")
    ap.add_argument("--graph", action="store_true",
                    help="cuda: replay the decode step from CUDA graphs; adds the kernel table (d)")
    return ap.parse_args(argv)


def build(a):
    """(model, proxy, runtime, kv, host banks) ready to decode from the trace's --history cursor."""
    device, dtype = a.device, setup.dtype_for(a.device)
    mc = setup.model_config(a)
    torch.manual_seed(a.seed)
    hb = HostBanks(mc, a.fill_threads, a.seed)
    if device == "cuda":
        hb.pin()
    layers = list(mc.moe_layers)
    proxy = setup.InjectedRouting(None, layers)
    model = setup.build_random_model(mc, proxy, device, dtype, a.seed)
    T = a.history + 2 * (a.warmup + a.tokens) + 1
    tr = routing.make_trace(a.workload, T, len(layers), a.experts, a.top_k, a.seed)
    ids, w = setup.to_device_trace(tr, device)
    frac = a.cache_frac if a.policy != "cpu" else 0.0
    ec = EngineConfig(device=device, policy=a.policy, expert_cache_frac=frac, cpu_threads=a.cpu_threads,
                      fill_behind=a.fill_behind,
                      tuning=Tuning(tier_torch=a.tier_compute == "torch", cpu_experts=a.cpu_experts))
    rt = create_expert_runtime(hb.banks, mc, ec, device, dtype, ft_profile.expert_rates(hb.banks, ec, device))
    if 0 < rt.cache.capacity < rt.cache.num_experts_total and a.policy != "cpu":
        setup.warm_by_replay(rt, tr.expert_ids[:a.history], layers)
        setup.copy_resident(rt, hb)
    proxy.runtime = rt
    proxy.set_trace(ids, w, cursor=a.history)
    kv = KVCache(mc, T, device, dtype)
    return model, proxy, rt, kv, hb


@torch.inference_mode()
def decode(model, kv, device, n, step=None):
    """n greedy decode steps, one host sync per token (as the sampler) -> (wall s, process CPU s,
    host s in the step calls, host s in the token syncs after them). step(token) -> logits: a
    graph replay (its launch, then the host serving its CPU side); None: eager."""
    tok = torch.zeros(1, dtype=torch.int64, device=device)
    setup.sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    in_step = in_sync = 0.0
    for _ in range(n):
        t = time.perf_counter()
        if step is not None:
            logits = step(tok)
        else:
            pos = torch.arange(kv.num_tokens, kv.num_tokens + 1, device=device)
            logits = model(tok, pos, kv)
        tok = logits[-1].argmax().view(1)
        t1 = time.perf_counter()
        int(tok)  # waits for the rest of the step: what the host no longer takes part in
        in_step, in_sync = in_step + t1 - t, in_sync + time.perf_counter() - t1
    setup.sync(device)
    return time.perf_counter() - t0, time.process_time() - c0, in_step, in_sync


def sync_counts(prof, tokens: int, layers: int) -> list:
    """Lines: each SYNC_NAMES event's count per token and per token-layer, and total aten ops."""
    counts = collections.Counter()
    aten = 0
    for ev in prof.events():
        name = ev.name
        if name.startswith("aten::"):
            aten += 1
        for s in SYNC_NAMES:
            if name == s or (s.startswith("Memcpy") and name.startswith(s)):
                counts[s] += 1
    lines = [f"{'event':<28} {'per token':>10} {'per layer':>10}"]
    for s in SYNC_NAMES:
        if counts[s]:
            lines.append(f"{s:<28} {counts[s] / tokens:>10.1f} {counts[s] / tokens / layers:>10.2f}")
    lines.append(f"{'all aten:: ops (nested too)':<28} {aten / tokens:>10.1f} {aten / tokens / layers:>10.2f}")
    return lines


def kernel_lines(prof, tokens: int, layers: int, wall_per_token: float, rows: int) -> list:
    """(d): device kernels per token and layer, their summed time against the wall time, and the
    kernels by total device time (name, count per token, mean µs, share of the kernel time)."""
    per = collections.defaultdict(lambda: [0, 0.0])  # name -> [count, µs]
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and not ev.name.startswith("Memcpy"):
            per[ev.name][0] += 1
            per[ev.name][1] += ev.device_time_total
    n = sum(c for c, _ in per.values()) / tokens
    us = sum(t for _, t in per.values()) / tokens
    lines = [f"kernels per token {n:.0f} ({n / layers:.1f} per MoE layer); summed kernel time "
             f"{us / 1e3:.2f} ms per token of {wall_per_token * 1e3:.2f} ms wall "
             f"({us / 1e3 / (wall_per_token * 1e3):.0%}); mean {us / max(n, 1):.1f} µs per kernel",
             f"{'kernel':<60} {'per token':>9} {'mean µs':>8} {'share':>6}"]
    for name, (c, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[:rows]:
        lines.append(f"{name[:60]:<60} {c / tokens:>9.1f} {t / c:>8.1f} {t / tokens / max(us, 1e-9):>6.1%}")
    return lines


def main_stream(prof) -> tuple:
    """(the stream running most device events, its events (start ns, end ns, stream, name) in
    time order); (None, []) without device events."""
    evs = [(e.start_ns(), e.end_ns(), e.device_resource_id(), e.name())
           for e in prof.profiler.kineto_results.events()
           if e.device_type() == torch.autograd.DeviceType.CUDA]
    if not evs:
        return None, []
    main = collections.Counter(e[2] for e in evs).most_common(1)[0][0]
    return main, sorted(e for e in evs if e[2] == main)


def gap_lines(prof, tokens: int, rows: int) -> list:
    """(e): idle time of the main stream (the one running most device events): per token, and by
    the pair of events around each gap (previous -> next), largest total first. In a captured
    step under GPU-resident control a wait for the host's CPU job is such a gap."""
    main, seq = main_stream(prof)
    if not seq:
        return ["no device events recorded"]
    per = collections.defaultdict(lambda: [0, 0.0])  # (prev, next) -> [count, µs]
    idle = 0.0
    for a, b in zip(seq, seq[1:]):
        gap = max(0.0, (b[0] - a[1]) / 1e3)
        idle += gap
        key = (a[3][:28], b[3][:28])
        per[key][0] += 1
        per[key][1] += gap
    lines = [f"main stream {main}: {len(seq) / tokens:.0f} events per token, idle {idle / tokens / 1e3:.2f} ms "
             f"per token (between tokens included)",
             f"{'previous -> next':<60} {'per token':>9} {'mean µs':>8} {'µs/token':>9}"]
    for (p, n), (c, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[:rows]:
        lines.append(f"{p + ' -> ' + n:<60} {c / tokens:>9.1f} {t / c:>8.1f} {t / tokens:>9.1f}")
    return lines


def signal_lines(prof, tokens: int, host: str) -> list:
    """(f) under GPU-resident control, per MoE layer on the main stream: from its plan kernel's
    end (its last store raises `ready`) to its finish kernel's start (pre: the fills' gather, the device experts, their
    sum) and the finish kernel's own time (F: its wait for the host's done included), by
    whether the layer filled (its gather took over 20 µs) and whether its finish waited (over
    8 µs: a CPU job was still running). In a layer that waited, pre + F less the host's
    ready-to-done (`host`, the server's own clock) and a finish that did not wait is the flags'
    round trip: the ready store reaching the host, the host starting the job, its done reaching
    the GPU."""
    _, seq = main_stream(prof)
    if not seq:
        return ["no device events recorded"]
    rows = collections.defaultdict(list)  # (filled, waited) -> [(pre, F)]
    ready, filled = None, False
    for start, end, _, name in seq:
        if name.startswith("_plan_kernel"):
            ready, filled = end, False
        elif ready is None:
            continue
        elif name.startswith("_gather"):
            filled = filled or (end - start) > 20e3
        elif name.startswith("_finish"):
            rows[filled, (end - start) > 8e3].append(((start - ready) / 1e3, (end - start) / 1e3))
            ready = None
    if not rows:
        return ["no plan/finish kernels (not under GPU-resident control)"]
    lines = [host, f"{'layers':<28} {'per token':>9} {'pre µs':>8} {'F µs':>8} {'pre+F µs':>9}"]
    for key in sorted(rows, reverse=True):
        r = rows[key]
        pre, F = (sum(v[i] for v in r) / len(r) for i in range(2))
        label = f"{'fills' if key[0] else 'no fills'}, {'waited' if key[1] else 'no wait'}"
        lines.append(f"{label:<28} {len(r) / tokens:>9.1f} {pre:>8.1f} {F:>8.1f} {pre + F:>9.1f}")
    return lines


def main(argv=None):
    a = parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA GPU is visible; use --device cpu")
    t_start = time.perf_counter()
    print(f"# profile_decode | {setup.hardware_line(a.device)}", flush=True)
    model, proxy, rt, kv, hb = build(a)
    try:
        L = len(proxy.index)
        print(f"# {a.layers} layers x {a.experts} experts top-{a.top_k}, hidden {a.hidden}, width {a.inter}; "
              f"policy {a.policy}, cache {rt.cache.capacity} slots ({a.cache_frac:.0%}), workload "
              f"{a.workload}; built in {time.perf_counter() - t_start:.1f} s; split: {rt.split_info}", flush=True)
        if a.graph and a.device != "cuda":
            raise SystemExit("error: --graph needs --device cuda")
        graphs = DecodeGraphs(model, kv.pages, kv.max_tokens, rt, a.device) if a.graph else None
        step = (lambda token: graphs.forward(token, kv)) if graphs else None
        decode(model, kv, a.device, a.warmup, step)
        before = dict(rt.stats)
        wall, cpu, in_step, in_sync = decode(model, kv, a.device, a.tokens, step)
        d = {k: rt.stats[k] - before.get(k, 0) for k in rt.stats}
        n = a.tokens
        print(f"(a) {wall / n * 1e3:.2f} ms/token ({n / wall:.2f} tok/s), {wall / n / L * 1e3:.3f} ms per "
              f"layer; driver process CPU {cpu / n * 1e3:.2f} ms/token (all threads); per token: "
              f"hits {d['hits'] / n:.1f}, misses {d['misses'] / n:.1f}, fills {d['fills'] / n:.1f}, "
              f"CPU experts {d['cpu_experts'] / n:.1f}; host per token: {in_step / n * 1e3:.2f} ms in the "
              f"step call, then {in_sync / n * 1e6:.0f} µs waiting for the step's end", flush=True)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
        with profile(activities=acts) as prof:
            decode(model, kv, a.device, n, step)
        ka = prof.key_averages()
        print(f"\n(b) top {a.rows} ops by self CPU time ({n} tokens x {L} layers)")
        print(ka.table(sort_by="self_cpu_time_total", row_limit=a.rows))
        if a.device == "cuda":
            print(f"(b) top {a.rows} ops by device time")
            print(ka.table(sort_by="self_device_time_total", row_limit=a.rows))
        print(f"(c) synchronising calls and copies ({L} MoE layers)")
        print("\n".join(sync_counts(prof, n, L)))
        if a.device == "cuda":
            print(f"\n(d) device kernels ({'graph replay' if a.graph else 'eager'})")
            print("\n".join(kernel_lines(prof, n, L, wall / n, a.rows)))
            print("\n(e) gaps on the main stream")
            print("\n".join(gap_lines(prof, n, a.rows)))
            if graphs is not None:
                print("\n(f) flags: ready -> finish per MoE layer")
                print("\n".join(signal_lines(prof, n, graphs.step.describe())))
            if a.trace_out:
                prof.export_chrome_trace(a.trace_out)
                print(f"# chrome trace: {a.trace_out}")
        print(f"# total {time.perf_counter() - t_start:.1f} s")
    finally:
        rt.close()
        hb.close()


if __name__ == "__main__":
    main()
