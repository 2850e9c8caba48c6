"""Bench the whole engine on the CPU (`--device cpu`): load, prefill and decode speed for each
miss policy x expert-cache size, against a STREAM-like read of this machine, on one table.

Default: builds a random bf16 qwen3_moe (24 layers x 64 experts, hidden 256, expert width 96,
top-8, ~230 MB of experts) in a temporary folder and runs cpu / hybrid / offload at caches of 0,
10 and 50% of the experts, 32 prompt tokens and 32 generated (greedy, fixed ids): ~1 minute on 2
cores. `--big` builds the issue's ~1 GB shape (48 layers x 128 experts); `--model X.ftw` runs an
existing model. The first generation of each engine is a warm-up and is not timed.

Columns: load s (Engine(): banks, runtime, model, KV cache; torch import excluded), prefill and
decode tok/s, expert GB/s = routed expert bytes per decode token (MoE layers x top-k x expert
bytes) x decode tok/s, and that as a fraction of the STREAM read (the kernel pool's threads
summing one expert bank set, best pass).

    python tools/bench_cpu_engine.py                     # ~1 minute
    python tools/bench_cpu_engine.py --big               # ~0.9 GB model (builds in ~40 s)
    python tools/bench_cpu_engine.py --model m.ftw --policies cpu --caches 0 -n 64
"""
import argparse
import os
import platform
import sys
import tempfile
import time

import numpy as np
import torch

SMALL = dict(num_hidden_layers=24, num_experts=64)
BIG = dict(num_hidden_layers=48, num_experts=128)
SHAPE = dict(hidden_size=256, moe_intermediate_size=96, num_experts_per_tok=8,
             intermediate_size=512)


def build_model(out_dir: str, big: bool) -> str:
    """A random bf16 qwen3_moe checkpoint converted to FTW; returns the .ftw path."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import make_tiny_model
    from ftw.convert import convert

    hf = make_tiny_model.build(os.path.join(out_dir, "hf"), "qwen3_moe", dtype="bf16",
                               **SHAPE, **(BIG if big else SMALL))
    return str(convert(hf, os.path.join(out_dir, "model.ftw")))


def stream_read_gbs(path: str, seconds: float = 1.0) -> float:
    """STREAM-like read GB/s over the model's expert banks (up to 512 MB of them), by the
    kernel pool's threads; numpy's sum on one thread when the kernels are not built."""
    import ftw
    with ftw.open(path) as f:
        banks = f.load_banks()
        datas, total = [], 0
        for layer in sorted(banks):
            if total >= 512 << 20:
                break
            datas.append(banks[layer].data)
            total += banks[layer].data.nbytes
        buf = np.concatenate(datas)
    try:
        from freetoken import bandwidth as bw, kernels
        pool = kernels.get_pool(kernels.default_num_threads(has_gpu=False))
        return bw.time_stream_read(pool, buf, seconds)
    except ImportError:
        words = buf.view(np.uint64)
        best, t_end = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            words.sum()
            best = max(best, buf.nbytes / (time.perf_counter() - t0))
        return best / 1e9


def run_one(path: str, policy: str, frac: float, prompt: list, num_new: int) -> dict:
    from freetoken.config import EngineConfig
    from freetoken.engine import Engine
    from freetoken.sampling import SamplingParams

    t0 = time.perf_counter()
    with Engine(path, EngineConfig(device="cpu", policy=policy, expert_cache_frac=frac)) as eng:
        load_s = time.perf_counter() - t0
        params = SamplingParams(max_tokens=num_new, temperature=0.0, seed=0)
        list(eng.generate(prompt, params))  # warm-up: page faults, pool wake-up, allocator
        list(eng.generate(prompt, params))
        st, mc = eng.last_stats, eng.model_config
        info = next(iter(eng.experts.banks.values())).info
        expert_bytes = sum(p.nbytes for p in info.projections)
        per_token = len(mc.moe_layers) * mc.num_experts_per_tok * expert_bytes
        hits, misses = st.experts.get("hits", 0), st.experts.get("misses", 0)
        return {"load_s": load_s, "prefill": st.prefill_tok_s, "decode": st.decode_tok_s,
                "gbs": per_token * st.decode_tok_s / 1e9,
                "hit": hits / (hits + misses) if hits + misses else 0.0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="an existing .ftw (default: build a random qwen3_moe)")
    p.add_argument("--big", action="store_true", help="build the ~1 GB 48x128-expert shape")
    p.add_argument("--policies", default="cpu,hybrid,offload")
    p.add_argument("--caches", default="0,0.1,0.5", help="expert cache fractions")
    p.add_argument("-p", "--prompt-tokens", type=int, default=32)
    p.add_argument("-n", "--new-tokens", type=int, default=32)
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="ft-bench-") as tmp:
        path = args.model
        if path is None:
            t0 = time.perf_counter()
            path = build_model(tmp, args.big)
            print(f"built {path} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        import ftw
        with ftw.open(path) as f:
            c = f.config
            vocab = c["vocab_size"]
        stream = stream_read_gbs(path)
        prompt = np.random.default_rng(0).integers(3, vocab, args.prompt_tokens).tolist()
        print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
              f"{torch.__version__}; {os.path.basename(path)}: {c['family']} {c['num_layers']} "
              f"layers x {c['num_experts']} experts (top-{c['num_experts_per_tok']}, hidden "
              f"{c['hidden_size']}, expert width {c['moe_intermediate_size']}); prompt "
              f"{args.prompt_tokens}, generate {args.new_tokens}; STREAM read {stream:.1f} GB/s")
        print(f"{'policy':8} {'cache':>6} {'load s':>7} {'prefill tok/s':>14} {'decode tok/s':>13} "
              f"{'expert GB/s':>12} {'of STREAM':>10} {'hit rate':>9}")
        for frac in (float(x) for x in args.caches.split(",")):
            for policy in args.policies.split(","):
                r = run_one(path, policy, frac, prompt, args.new_tokens)
                print(f"{policy:8} {frac:6.0%} {r['load_s']:7.2f} {r['prefill']:14.1f} "
                      f"{r['decode']:13.1f} {r['gbs']:12.2f} {r['gbs'] / stream:10.1%} "
                      f"{r['hit']:9.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
