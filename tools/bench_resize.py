"""Elastic memory bench (issue 37): the expert cache resized while a sequence decodes, on the
engine's own paths (Engine.generate, Engine.resize_expert_cache, the memory watch).

Three parts (--parts, default all):

  resize    one greedy generation at --sizes[0] GB of expert cache, resized to each next size
            every --every tokens by the API (LLM.resize_expert_cache's path): per phase its
            tok/s (tokens 3.. of the phase: the first steps fill the new slots and, on cuda,
            capture the decode graphs again unless the slots sit at a fixed address), the decode
            steps captured in it, and per resize its pause: the resize call plus how much longer
            the next step took than the median step before it. Goal: <= 50 ms plus one step.
            It prints first how the slots are kept (fixed address or reallocated).
  pressure  a generation at --pressure-gb GB of cache with the memory watch on while a second
            process takes --hog-gb GB of device memory in 0.5 GB pieces (retrying where none is
            free, as a program that loads does), holds it --hold s and frees it; before that it
            leaves only --leave-gb GB free beside the engine (a smaller card's room). Per
            second: tok/s and the cache's GB; then the resizes the watch made, whether any
            allocation failed in this process, and whether the tokens equal those of the same
            generation with no pressure (offload and all-cached decode compute every expert on
            the device: equal tokens in bf16 too; hybrid may differ by CPU-vs-GPU rounding).
  context   a --context-tokens prompt under --gpu-mem-gb (a consumer card): the plan the
            engine printed, prefill time, and a few decoded tokens.

    python tools/bench_resize.py --shape qwen3-30b-a3b                 # cuda, all parts
    python tools/bench_resize.py --device cpu --shape qwen3-30b-a3b --tiny --parts resize \\
        --sizes 0.002,0.001,0.002 --every 6
"""
import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time

import torch

from bench_shapes import ModelSource, add_shape_args
from freetoken.config import EngineConfig
from freetoken.engine import Engine
from freetoken.sampling import SamplingParams

GB = 1e9


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None, help="FTW model (default: the bundled one)")
    add_shape_args(p)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--policy", default="hybrid")
    p.add_argument("--parts", default="resize,pressure,context")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens (resize, pressure)")
    p.add_argument("--sizes", default="8,4,8", help="resize: expert cache GB, first to last")
    p.add_argument("--every", type=int, default=48, help="resize: tokens per size")
    p.add_argument("--pressure-gb", type=float, default=20.0)
    p.add_argument("--pressure-policy", default="offload")
    p.add_argument("--hog-gb", type=float, default=15.0)
    p.add_argument("--hold", type=float, default=20.0)
    p.add_argument("--leave-gb", type=float, default=10.0,
                   help="pressure: device memory left free beside the engine before the hog (the "
                        "plan's margin is 0.5 GB + 5%% of the free memory at load)")
    p.add_argument("--context-tokens", type=int, default=32768)
    p.add_argument("--gpu-mem-gb", type=float, default=24.0, help="context: the engine's cap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hog", action="store_true", help=argparse.SUPPRESS)  # the second process
    return p.parse_args(argv)


def prompt_ids(engine, n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    vocab = min(engine.model_config.vocab_size, 32000)
    return torch.randint(10, vocab, (n,), generator=g).tolist()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def timed_tokens(engine, ids, n, between=None):
    """[(token, seconds since the previous token)] of a greedy generation; between(i) runs
    after token i (outside the engine's step)."""
    out, t = [], time.perf_counter()
    for i, tok in enumerate(engine.generate(ids, greedy(n))):
        now = time.perf_counter()
        out.append((tok, now - t))
        if between is not None:
            between(i)
        t = time.perf_counter()
    return out


def part_resize(a, source, echo):
    sizes = [float(x) for x in a.sizes.split(",")]
    cfg = EngineConfig(device=a.device, dtype=a.dtype, policy=a.policy, expert_cache_gb=sizes[0],
                       memory_watch=False)
    with Engine(source(), cfg) as engine:
        ids = prompt_ids(engine, a.prompt, a.seed)
        calls, captures = {}, []  # captures: the graphs' count at the end of each phase
        count = (lambda: engine.graphs.captures) if engine.graphs is not None else (lambda: 0)

        def between(i):
            k = (i + 1) // a.every
            if (i + 1) % a.every == 0 and k < len(sizes):
                captures.append(count())
                t = time.perf_counter()
                engine.resize_expert_cache(sizes[k])
                engine.sync()
                calls[i + 1] = time.perf_counter() - t
        toks = timed_tokens(engine, ids, a.every * len(sizes), between)
        captures.append(count())
        fixed = engine.experts.cache.fixed_address
        storage = engine.experts.storage_info or f"slots in a {engine.device.type} tensor"
    echo(f"resize {' -> '.join(f'{s:g}' for s in sizes)} GB every {a.every} tokens, "
         f"policy {a.policy}; fixed-address slot storage: {'yes' if fixed else 'no'} ({storage})")
    echo("| phase | cache GB | tok/s (tokens 3..) | steps captured | resize call ms | next step ms "
         "| median step ms | pause ms (call + extra of the next step) |")
    echo("|---|---|---|---|---|---|---|---|")
    rows = []
    for k, size in enumerate(sizes):
        steps = [s for _, s in toks[k * a.every:(k + 1) * a.every]]
        steady = steps[3:] if k else steps[3:]
        rate = len(steady) / sum(steady) if steady else float("nan")
        caps = captures[k] - (captures[k - 1] if k else 0)
        if k == 0:
            echo(f"| 0 | {size:g} | {rate:.2f} | {caps} | | | "
                 f"{statistics.median(steady) * 1e3:.1f} | |")
            rows.append(dict(size=size, tok_s=rate, captures=caps, fixed=fixed))
            continue
        before = statistics.median([s for _, s in toks[(k - 1) * a.every + 3:k * a.every]])
        call = calls.get(k * a.every, float("nan"))
        nxt = steps[0]
        pause = call + max(0.0, nxt - before)
        echo(f"| {k} | {size:g} | {rate:.2f} | {caps} | {call * 1e3:.1f} | {nxt * 1e3:.1f} | "
             f"{before * 1e3:.1f} | {pause * 1e3:.1f} |")
        rows.append(dict(size=size, tok_s=rate, captures=caps, call_ms=call * 1e3,
                         next_ms=nxt * 1e3, before_ms=before * 1e3, pause_ms=pause * 1e3))
    return rows


def hog_main(a) -> int:
    """The second process: leave --leave-gb free, then take --hog-gb in pieces, hold, free."""
    dev = torch.device("cuda")
    free, _ = torch.cuda.mem_get_info(dev)
    ballast = max(0, int(free - a.leave_gb * GB))
    keep = [torch.empty(ballast, dtype=torch.uint8, device=dev)] if ballast else []
    print(json.dumps({"event": "ballast", "gb": ballast / GB, "t": time.time()}), flush=True)
    time.sleep(3.0)
    piece, want, hog = int(0.5 * GB), int(a.hog_gb * GB), []
    t0 = time.time()
    while sum(x.numel() for x in hog) < want and time.time() - t0 < 120:
        try:
            hog.append(torch.empty(piece, dtype=torch.uint8, device=dev))
        except torch.OutOfMemoryError:
            time.sleep(0.05)
    got = sum(x.numel() for x in hog) / GB
    print(json.dumps({"event": "hog", "gb": got, "wait_s": time.time() - t0, "t": time.time()}),
          flush=True)
    time.sleep(a.hold)
    hog.clear()
    torch.cuda.empty_cache()
    print(json.dumps({"event": "freed", "t": time.time()}), flush=True)
    time.sleep(8.0)
    del keep
    return 0


def part_pressure(a, source, echo):
    # no prefix cache: each generation of the prompt is a cold prefill, as the reference's
    cfg = EngineConfig(device=a.device, dtype=a.dtype, policy=a.pressure_policy,
                       expert_cache_gb=a.pressure_gb, prefix_cache=False)
    lines = []  # the memory watch's resize lines (freetoken.memory's log)
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(f"{time.time():.1f} {record.getMessage()}")
    log = logging.getLogger("freetoken.memory")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    with Engine(source(), cfg) as engine:
        ids = prompt_ids(engine, a.prompt, a.seed + 1)
        ref = [t for t, _ in timed_tokens(engine, ids, 32)]
        cmd = [sys.executable, os.path.abspath(__file__), "--hog", "--hog-gb", str(a.hog_gb),
               "--hold", str(a.hold), "--leave-gb", str(a.leave_gb)]
        hog = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        events, samples = [], []  # (time, cache GB)
        oom = None
        ballast = json.loads(hog.stdout.readline())
        events.append(ballast)
        t_start, toks = time.time(), []
        try:
            while hog.poll() is None:
                for tok in engine.generate(ids, greedy(32)):
                    toks.append(tok)
                    cache = engine.experts.cache
                    samples.append((time.time(), cache.capacity * cache.slot_stride / GB))
                if toks[-32:] != ref:
                    events.append({"event": "tokens differ", "t": time.time()})
        except torch.OutOfMemoryError as e:
            oom = str(e).splitlines()[0]
        events += [json.loads(line) for line in hog.stdout.read().splitlines() if line.strip()]
        hog.wait()
        resizes = dict(engine.resizes)
    log.removeHandler(handler)
    echo(f"pressure: {a.pressure_gb:g} GB cache, policy {a.pressure_policy}, memory watch on; a "
         f"second process leaves {a.leave_gb:g} GB free ({ballast['gb']:.1f} GB ballast), takes "
         f"{a.hog_gb:g} GB, holds {a.hold:g} s, frees it")
    echo("| second | tok/s | cache GB (min..max) | event |")
    echo("|---|---|---|---|")
    ev_at = {}
    for e in events:
        ev_at.setdefault(int(e["t"] - t_start), []).append(
            e["event"] + (f" {e['gb']:.1f} GB" if "gb" in e else "") +
            (f" after {e['wait_s']:.1f} s" if "wait_s" in e else ""))
    last = int(samples[-1][0] - t_start) if samples else 0
    for sec in range(0, last + 1):
        got = [gb for t, gb in samples if sec <= t - t_start < sec + 1]
        span = f"{min(got):.1f}..{max(got):.1f}" if got else "-"
        echo(f"| {sec} | {len(got)} | {span} | {'; '.join(ev_at.get(sec, []))} |")
    same = sum(1 for e in events if e["event"] == "tokens differ") == 0
    echo(f"out-of-memory in the engine: {oom or 'none'}; tokens equal to the run without pressure "
         f"in every 32-token generation: {same}; resizes by trigger: {resizes}")
    for line in lines:
        echo(f"  {line}")
    return dict(oom=oom, same=same, resizes=resizes)


def part_context(a, source, echo):
    cfg = EngineConfig(device=a.device, dtype=a.dtype, policy=a.policy, gpu_mem_gb=a.gpu_mem_gb,
                       ctx_size=a.context_tokens + 64, parallel=1)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with Engine(source(), cfg) as engine:
        echo(f"context: {a.context_tokens} tokens under --gpu-mem-gb {a.gpu_mem_gb:g}; the plan:")
        for line in engine.memory_plan.lines():
            echo("  " + line)
        ids = prompt_ids(engine, a.context_tokens, a.seed + 2)
        t = time.perf_counter()
        toks = timed_tokens(engine, ids, 8)
        prefill = toks[0][1]
        rate = 7 / sum(s for _, s in toks[1:])
        peak = torch.cuda.max_memory_allocated() / GB if engine.device.type == "cuda" else 0.0
    echo(f"  prefill {prefill:.2f} s ({a.context_tokens / prefill:.0f} tok/s), decode "
         f"{rate:.2f} tok/s after it, total {time.perf_counter() - t:.2f} s; torch peak "
         f"allocated {peak:.2f} GB (the plan: {engine.memory_plan.total / GB:.2f} GB)")
    return dict(prefill_s=prefill, decode_tok_s=rate, peak_gb=peak)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.hog:
        return hog_main(a)
    source = ModelSource(a)
    echo = lambda s: print(s, flush=True)  # noqa: E731
    parts = a.parts.split(",")
    out = {}
    if "resize" in parts:
        out["resize"] = part_resize(a, source, echo)
    if "pressure" in parts:
        out["pressure"] = part_pressure(a, source, echo)
    if "context" in parts:
        out["context"] = part_context(a, source, echo)
    echo(f"model: {source.built()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
