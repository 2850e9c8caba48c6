"""Batched decode bench (issue 32): B sequences decoding together, one forward per step (the
engine's MoETransformer.forward_batch, replayed from graphs captured per batch size on cuda),
against B = 1 and against each row's limit model, per routing workload. Qwen3-30B-A3B-shaped
bf16 model with random weights, host banks built in memory (bench_moe_setup.py); routing
injected: each sequence reads its own stream of the workload (locality: its own seed, so B
sequences share fewer experts than one sequence's consecutive tokens do).

Per (workload, B) row: aggregate tok/s (B tokens per step), per-sequence tok/s, distinct
experts per MoE layer step (the union the step fills or runs), misses per layer step, and the
limit model T_gpu(B) + miss bytes / (P + C): T_gpu(B) is the same B with every expert resident
(measured here, its own row), the miss bytes the row's own (distinct misses x expert bytes).
Goal (issue 32): every row within 1.2x of its limit; on locality, B = 4 aggregate >= 1.5x B = 1.

--during-prefill N: one sequence decodes while an N-token prompt prefills in one streamed
forward (the scheduler's decode beside prefill: runtime.beside_prefill, every miss on the CPU),
its steps run between the prefill's MoE layers (--beside-mode interleave, one every
--beside-every K layers) or back to back on a thread and CUDA stream of their own while the
forward streams every layer (thread: the tuning's decode_beside "thread",
beside.Thread); against the decode alone and the prefill alone, one row per mode.
Goal (issue 32): the decode keeps >= 50% of its tok/s, the prefill takes <= 1.3x its time alone.

    python tools/bench_batch.py --during-prefill 16384 --beside-mode interleave,thread

    python tools/bench_batch.py                                    # full shape, cuda, 25% cache
    python tools/bench_batch.py --device cpu --layers 4 --experts 16 --hidden 256 --inter 128 \\
        --top-k 4 --vocab 1024 --heads 4 --kv-heads 2 --head-dim 64 --tokens 8 --warmup 2

--shape NAME: a shape of tools/bench_shapes.py instead (qwen3-30b-a3b, qwen3.6-35b-a3b,
gpt-oss-20b), its family's model with its random weights and banks; the shape options given
(--layers, --experts, --hidden, ...), --tiny and --set KEY=VALUE shrink it. Models with Gated
DeltaNet layers replay graphs too (each row's recurrent state copied into the captured row).

    python tools/bench_batch.py --shape qwen3.6-35b-a3b
    python tools/bench_batch.py --shape gpt-oss-20b --layers 2 --experts 8 --tiny --device cpu \\
        --tokens 8 --warmup 2
"""
import argparse
import contextlib
import gc
import threading
import time
from types import SimpleNamespace

import numpy as np
import torch

import bench_moe_setup as setup
import bench_routing as routing
from bench_decode import bandwidths
from bench_shapes import add_shape_args
from freetoken import profile
from freetoken.config import EngineConfig
from freetoken.experts import create_expert_runtime
from freetoken.graphs import DecodeGraphs
from freetoken.kv_cache import KVPages, SequenceKV
from freetoken.state_cache import create_state_cache

GB = 1e9


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    setup.add_shape_args(ap)
    ap.add_argument("--batches", default="1,2,4", help="batch sizes B (sequences decoding together)")
    ap.add_argument("--workloads", default="uniform,locality")
    ap.add_argument("--cache-frac", type=float, default=0.25, help="expert cache, a fraction of all experts")
    ap.add_argument("--policy", default="hybrid")
    ap.add_argument("--tokens", type=int, default=32, help="timed steps per row")
    ap.add_argument("--warmup", type=int, default=8, help="steps run before timing")
    ap.add_argument("--history", type=int, default=128, help="steps replayed (books only) to warm the cache")
    ap.add_argument("--eager", action="store_true", help="cuda: no CUDA graphs")
    ap.add_argument("--no-calibrate", action="store_true", help="cuda: default bandwidths")
    ap.add_argument("--during-prefill", type=int, default=0, metavar="N",
                    help="instead: decode beside an N-token streamed prefill (module docstring)")
    ap.add_argument("--beside-every", default="1", metavar="K[,K...]",
                    help="--during-prefill: a decode step every K MoE layers of the prefill, one row per K")
    ap.add_argument("--beside-mode", default="interleave", metavar="MODE[,MODE...]",
                    help="--during-prefill: interleave (between the prefill's layers, --beside-every) "
                         "and/or thread (a decode thread and stream of its own), one row each")
    add_shape_args(ap, shrink=False)
    return setup.parse_shape_args(ap, argv)


def interleaved_trace(wl: str, B: int, steps: int, mc, a):
    """ids, weights [steps * B, L, K]: row t * B + b is sequence b's t-th token (its own stream)."""
    streams = [routing.make_trace(wl, steps, len(mc.moe_layers), a.experts, a.top_k, a.seed + 101 * b)
               for b in range(B)]
    ids = np.stack([s.expert_ids for s in streams], axis=1).reshape(steps * B, *streams[0].expert_ids.shape[1:])
    w = np.stack([s.weights for s in streams], axis=1).reshape(steps * B, *streams[0].weights.shape[1:])
    return ids, w


class BatchBench:
    def __init__(self, a, mc, hb, device, dtype):
        self.a, self.mc, self.hb, self.device, self.dtype = a, mc, hb, device, dtype
        self.layers = list(mc.moe_layers)
        self.proxy = setup.InjectedRouting(None, self.layers)
        self.model = setup.bench_model(mc, self.proxy, device, dtype, hb, a.seed)
        self.graphs_ok = bench_graphs_ok(a, mc, device)
        self.max_b = max(int(b) for b in a.batches.split(","))
        self.per_seq = a.warmup + a.tokens + 1
        pages = -(-self.per_seq // 32)
        self.pages = KVPages(mc, pages * self.max_b, 32, device, dtype)

    def runtime(self, frac):
        ec = EngineConfig(device=self.device, policy=self.a.policy, expert_cache_frac=frac,
                          cpu_threads=self.a.cpu_threads, parallel=self.max_b)
        rates = profile.expert_rates(self.hb.banks, ec, self.device)
        return create_expert_runtime(self.hb.banks, self.mc, ec, self.device, self.dtype, rates)

    @torch.inference_mode()
    def run(self, wl: str, B: int, frac: float) -> dict:
        a = self.a
        steps = a.history + a.warmup + a.tokens
        ids, w = interleaved_trace(wl, B, steps, self.mc, a)
        rt = self.runtime(frac)
        graphs = None
        try:
            if rt.cache.capacity and not rt.all_resident:
                setup.warm_by_replay(rt, ids[:a.history * B], self.layers)
                setup.copy_resident(rt, self.hb)
            self.proxy.runtime = rt
            tr = routing.Trace(wl, ids, w)
            self.proxy.set_trace(*setup.to_device_trace(tr, self.device), cursor=a.history * B)
            pages_per = -(-self.per_seq // 32)
            kvs = [SequenceKV(self.pages, SimpleNamespace(page_table=list(range(b * pages_per, (b + 1) * pages_per)),
                                                          num_kv_tokens=0), self.per_seq) for b in range(B)]
            states = [create_state_cache(self.mc, self.device, self.dtype) for _ in range(B)]
            if self.graphs_ok:
                graphs = DecodeGraphs(self.model, self.pages, self.per_seq, rt, self.device,
                                      max_batch=self.max_b, state=states[0])
                graphs.min_span = 64

            def step(tokens):
                if graphs is not None:
                    hybrid = states if states[0] is not None else None
                    return (graphs.forward_batch(tokens, kvs, hybrid) if B > 1
                            else graphs.forward(tokens, kvs[0], states[0]))
                if B > 1:
                    return self.model.forward_batch(tokens, kvs, states)
                pos = torch.tensor([kvs[0].num_tokens], device=self.device)
                return self.model(tokens, pos, kvs[0], state=states[0])

            tokens = torch.zeros(B, dtype=torch.int64, device=self.device)
            for _ in range(a.warmup):
                tokens = step(tokens).argmax(-1)
                tokens.tolist()
            before = dict(rt.stats)
            setup.sync(self.device)
            t0 = time.perf_counter()
            for _ in range(a.tokens):
                tokens = step(tokens).argmax(-1)
                tokens.tolist()  # one host sync per step, as the scheduler's sampler
            setup.sync(self.device)
            dt = time.perf_counter() - t0
            d = {k: rt.stats[k] - before.get(k, 0) for k in rt.stats if isinstance(rt.stats[k], (int, float))}
            how = graphs.step.describe() if graphs is not None else "eager"
        finally:
            self.proxy.runtime = None
            graphs = None
            rt.close()
            del rt
            gc.collect()
            if self.device == "cuda":
                torch.cuda.empty_cache()
        layer_steps = a.tokens * len(self.layers)
        return {"s_step": dt / a.tokens, "distinct": (d["hits"] + d["misses"]) / layer_steps,
                "misses": d["misses"] / layer_steps, "miss_bytes": d["misses"] * self.hb.slot_bytes / a.tokens,
                "how": how}


@torch.inference_mode()
def during_prefill(bench, wl: str, every: int, mode: str = "interleave") -> dict:
    """One sequence's decode alone, an N-token prefill alone, then the prefill with the decode's
    steps beside it (mode interleave: between its MoE layers, one every `every`; thread: on a
    thread and stream of their own): seconds and tokens (the module docstring)."""
    a, mc, device = bench.a, bench.mc, bench.device
    N, D = a.during_prefill, a.history + a.warmup + a.tokens + 8 * len(bench.layers) + 8
    dec = routing.make_trace(wl, D, len(bench.layers), a.experts, a.top_k, a.seed)
    pre = routing.make_trace("uniform", N, len(bench.layers), a.experts, a.top_k, a.seed + 1)
    ids = np.concatenate([dec.expert_ids, pre.expert_ids, pre.expert_ids])
    w = np.concatenate([dec.weights, pre.weights, pre.weights])
    rt = bench.runtime(a.cache_frac)
    try:
        if rt.cache.capacity and not rt.all_resident:
            setup.warm_by_replay(rt, dec.expert_ids[:a.history], bench.layers)
            setup.copy_resident(rt, bench.hb)
        bench.proxy.runtime = rt
        bench.proxy.set_trace(*setup.to_device_trace(routing.Trace(wl, ids, w), device),
                              cursor=a.history)
        per = -(-(D + 1) // 32)
        pages = KVPages(mc, per + 2 * -(-N // 32), 32, device, bench.dtype)
        kv_d = SequenceKV(pages, SimpleNamespace(page_table=list(range(per)), num_kv_tokens=0), D + 1)
        kv_p = [SequenceKV(pages, SimpleNamespace(page_table=list(range(per + j * -(-N // 32), per + (j + 1) * -(-N // 32))),
                                                  num_kv_tokens=0), N) for j in range(2)]
        state_d = create_state_cache(mc, device, bench.dtype)
        graphs = (DecodeGraphs(bench.model, pages, D + 1, rt, device, state=state_d)
                  if bench.graphs_ok else None)
        if graphs is not None:  # one KV span: no capture beside the prefill (a decode thread runs none)
            graphs.min_span = D + 1
        state_p = create_state_cache(mc, device, bench.dtype)
        tok = torch.zeros(1, dtype=torch.int64, device=device)

        def decode_step():
            nonlocal tok
            if graphs is not None:
                logits = graphs.forward(tok, kv_d, state_d)
            else:
                logits = bench.model(tok, torch.tensor([kv_d.num_tokens], device=device), kv_d,
                                     state=state_d)
            tok = logits[-1].argmax().view(1)
            int(tok)

        for _ in range(a.warmup):
            decode_step()
        setup.sync(device)
        t0 = time.perf_counter()
        for _ in range(a.tokens):
            decode_step()
        setup.sync(device)
        decode_s = (time.perf_counter() - t0) / a.tokens
        dec_at = bench.proxy.where()

        prompt = torch.randint(mc.vocab_size, (N,), device=device)
        pre_at = (D, D)  # the prefill rows after the decode's

        def prefill(j, between=None):
            bench.proxy.moved_to(pre_at)
            setup.sync(device)
            t0 = time.perf_counter()
            if state_p is not None:
                state_p.reset()
            bench.model(prompt, torch.arange(N, device=device), kv_p[j], 1, state=state_p,
                        between=between)
            setup.sync(device)
            kv_p[j].truncate(0)
            return time.perf_counter() - t0

        prefill(0)  # warm-up: kernels chosen, buffers made
        alone_s = prefill(0)
        stats0 = dict(rt.stats)
        steps = 0
        moe = set(bench.layers)

        seen = 0

        def between(layer):
            nonlocal steps, dec_at, seen
            if layer not in moe:
                return
            seen += 1
            if seen % every:
                return
            outer = bench.proxy.where()
            bench.proxy.moved_to(dec_at)
            with rt.beside_prefill():
                decode_step()
            dec_at = bench.proxy.where()
            bench.proxy.moved_to(outer)
            steps += 1

        def beside_thread(j):
            """The prefill forward with the decode's steps back to back on a thread and stream of
            their own (as beside.Thread): (seconds, steps)."""
            stop, errors, count = threading.Event(), [], [0]
            stream = torch.cuda.Stream(device) if device == "cuda" else None
            threads = torch.get_num_threads()

            def run():
                nonlocal dec_at
                try:
                    torch.set_num_threads(threads)
                    on = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
                    with torch.inference_mode(), on:
                        bench.proxy.moved_to(dec_at)  # (this thread's cursor)
                        while not stop.is_set() and kv_d.num_free > 1:
                            with rt.beside_prefill():
                                decode_step()
                            count[0] += 1
                        dec_at = bench.proxy.where()
                except BaseException as e:
                    errors.append(e)

            bench.proxy.moved_to(pre_at)
            setup.sync(device)
            t0 = time.perf_counter()
            if state_p is not None:
                state_p.reset()
            th = threading.Thread(target=run, name="bench-decode-beside")
            th.start()
            try:
                with rt.prefill_beside_thread():
                    bench.model(prompt, torch.arange(N, device=device), kv_p[j], 1, state=state_p)
            finally:
                stop.set()
                th.join()
            if stream is not None:
                torch.cuda.current_stream(device).wait_stream(stream)
            setup.sync(device)
            dt = time.perf_counter() - t0
            kv_p[j].truncate(0)
            if errors:
                raise errors[0]
            return dt, count[0]

        if mode == "thread":
            if not rt.streams_every_layer(N):
                raise SystemExit(f"--beside-mode thread: a {N}-token prefill forward does not stream "
                                 f"every layer here (all experts resident, or fewer tokens than "
                                 f"{rt.prefill_min_tokens})")
            beside_s, steps = beside_thread(1)
        else:
            beside_s = prefill(1, between)
        d = {k: rt.stats[k] - stats0.get(k, 0) for k in ("fills", "cpu_experts", "prefill_layers_streamed")}
        how = graphs.step.describe() if graphs is not None else "eager"
    finally:
        bench.proxy.runtime = None
        graphs = None
        rt.close()
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return {"decode_s": decode_s, "alone_s": alone_s, "beside_s": beside_s, "steps": steps,
            "d": d, "how": how}


def bench_graphs_ok(a, mc, device) -> bool:
    return device == "cuda" and not a.eager


def main(argv=None):
    a = parse_args(argv)
    t_start = time.perf_counter()
    batches = [int(b) for b in a.batches.split(",")]
    with setup.bench_banks(a, "bench_batch") as (mc, hb, device, dtype):
        P, C, source = bandwidths(a, hb, device)
        print(f"# limit model: T_gpu(B) (every expert resident, same B) + miss bytes / (P + C); "
              f"P={P:.1f} C={C:.1f} GB/s ({source})", flush=True)
        print(f"# {a.policy}, expert cache {a.cache_frac:.0%}; {a.history} steps replayed (books), "
              f"{a.warmup} warm-up + {a.tokens} timed steps per row; "
              f"{'graphs' if bench_graphs_ok(a, mc, device) else 'eager'}", flush=True)
        bench = BatchBench(a, mc, hb, device, dtype)
        if a.during_prefill:
            print(f"{'workload':9} {'mode':>10} {'every':>5} {'decode alone tok/s':>18} {'during prefill':>14} "
                  f"{'kept':>6} {'prefill alone s':>15} {'with decode s':>13} {'x':>6}")
            rows = []
            for wl in a.workloads.split(","):
                for mode in a.beside_mode.split(","):
                    if mode not in ("interleave", "thread"):
                        raise SystemExit(f"--beside-mode: interleave or thread, not {mode!r}")
                    rows += ([(wl, mode, int(k)) for k in a.beside_every.split(",")]
                             if mode == "interleave" else [(wl, mode, 0)])
            for wl, mode, every in rows:
                r = during_prefill(bench, wl, every, mode)
                alone, during = 1 / r["decode_s"], r["steps"] / r["beside_s"]
                print(f"{wl:9} {mode:>10} {every if every else '-':>5} {alone:>18.1f} {during:>14.1f} "
                      f"{during / alone:>6.2f} {r['alone_s']:>15.3f} {r['beside_s']:>13.3f} "
                      f"{r['beside_s'] / r['alone_s']:>6.2f}", flush=True)
                print(f"#   {a.during_prefill} tokens; beside the prefill: {r['steps']} decode steps, "
                      f"fills {r['d']['fills']}, CPU experts {r['d']['cpu_experts']}, layers streamed "
                      f"{r['d']['prefill_layers_streamed']}; {r['how']}", flush=True)
            print(f"# total {time.perf_counter() - t_start:.0f} s")
            return
        head = (f"{'workload':9} {'B':>2} {'agg tok/s':>10} {'seq tok/s':>10} {'distinct/layer':>14} "
                f"{'miss/layer':>10} {'T_gpu(B) ms':>11} {'limit tok/s':>11} {'ours/limit':>10} {'vs B=1':>7}")
        print(head)
        print("-" * len(head), flush=True)
        t_gpu = {}
        for wl in a.workloads.split(","):
            first = None
            for B in batches:
                if B not in t_gpu:  # the same B with every expert resident (routing does not matter)
                    t_gpu[B] = bench.run(wl, B, 1.0)["s_step"]
                r = bench.run(wl, B, a.cache_frac)
                agg = B / r["s_step"]
                limit_s = t_gpu[B] + r["miss_bytes"] / ((P + C) * GB)
                first = first or agg
                print(f"{wl:9} {B:>2} {agg:>10.1f} {1 / r['s_step']:>10.1f} {r['distinct']:>14.1f} "
                      f"{r['misses']:>10.2f} {t_gpu[B] * 1e3:>11.2f} {B / limit_s:>11.1f} "
                      f"{r['s_step'] / limit_s:>10.2f} {agg / first:>7.2f}", flush=True)
                print(f"#   {r['how']}", flush=True)
        print(f"# total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
