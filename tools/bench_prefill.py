"""Prefill bench: time and tok/s of one prompt forward of 512, 2K, 8K and 16K tokens through the
runtime's prefill streaming path (whole expert layers double-buffered onto the device), against
expert_bytes / B_P (every layer crosses PCIe once) and against the compute time of the same
forward with every expert resident on the device. Same model and banks as bench_decode.py
(Qwen3-30B-A3B-shaped bf16, random weights, host banks built in memory); routing injected from
the uniform workload (every layer touches ~all experts). Fixed seed; one warm-up forward per
runtime excluded; rows printed as they finish.

    python tools/bench_prefill.py                                  # full shape, cuda
    python tools/bench_prefill.py --device cpu --layers 4 --experts 16 --hidden 256 --inter 128 \
        --top-k 4 --vocab 1024 --heads 4 --kv-heads 2 --head-dim 64 --lengths 64,256
"""
import argparse
import os
import sys
import time
import traceback

import numpy as np
import torch

import bench_moe_setup as setup
import bench_routing as routing
from freetoken.config import EngineConfig
from freetoken.experts import create_expert_runtime
from freetoken.kv_cache import KVCache

GB = 1e9


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    setup.add_shape_args(ap)
    ap.add_argument("--lengths", default="512,2048,8192,16384", help="prompt lengths (one forward each)")
    ap.add_argument("--workload", default="uniform", choices=routing.WORKLOADS)
    ap.add_argument("--no-resident", action="store_true", help="skip the all-experts-resident compute run")
    return ap.parse_args(argv)


def measure_bp(hb, device, layers=3) -> tuple:
    """(GB/s, how) of whole-layer copies from the host banks to the device, as streaming does:
    pinned H2D copies on cuda, numpy copies (the cpu tier's streamer) on cpu. Mean over
    `layers` distinct layers after one warm-up copy."""
    banks = [hb.banks[l] for l in sorted(hb.banks)][:max(1, layers)]
    if device == "cuda":
        dst = torch.empty(hb.layer_bytes, dtype=torch.uint8, device=device)
        srcs = [torch.from_numpy(b.data) for b in banks]
        dst.copy_(srcs[0], non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s in srcs:
            dst.copy_(s, non_blocking=True)
        torch.cuda.synchronize()
        how = "pinned H2D whole-layer copies of the banks, measured here"
    else:
        dst = np.empty(hb.layer_bytes, dtype=np.uint8)
        np.copyto(dst, banks[0].data)
        t0 = time.perf_counter()
        for b in banks:
            np.copyto(dst, b.data)
        how = "numpy whole-layer copies (the cpu tier's streamer), measured here"
    return len(banks) * hb.layer_bytes / (time.perf_counter() - t0) / GB, how


class PrefillBench:
    def __init__(self, a, mc, hb, device, dtype, max_len):
        self.a, self.mc, self.hb, self.device, self.dtype = a, mc, hb, device, dtype
        self.proxy = setup.InjectedRouting(None, list(mc.moe_layers))
        self.model = setup.build_random_model(mc, self.proxy, device, dtype, a.seed)
        self.kv = KVCache(mc, max_len, device, dtype)
        tr = routing.make_trace(a.workload, max_len, len(mc.moe_layers), a.experts, a.top_k, a.seed)
        self.distinct = {n: routing.distinct_per_layer(tr.expert_ids[:n]) for n in sorted({min(512, max_len), max_len})}
        self.proxy.set_trace(*setup.to_device_trace(tr, device))
        self.tokens = torch.randint(0, mc.vocab_size, (max_len,), device=device,
                                    generator=torch.Generator(device=device).manual_seed(a.seed))

    def runtime(self, resident: bool):
        """resident: every expert in the device cache (preloaded). Else no cache and streaming
        forced on (the cpu device streams into its cpu tier)."""
        ec = EngineConfig(device=self.device, policy="hybrid", expert_cache_frac=1.0 if resident else 0.0,
                          cpu_threads=self.a.cpu_threads, extra={"prefill_stream": True})
        return create_expert_runtime(self.hb.banks, self.mc, ec, self.device, self.dtype)

    @torch.inference_mode()
    def prefill(self, rt, n) -> tuple:
        """One n-token forward from an empty KV cache -> (seconds, stats delta)."""
        self.proxy.runtime = rt
        self.kv.truncate(0)
        self.proxy.set_trace(self.proxy.ids, self.proxy.weights, cursor=0)
        before = dict(rt.stats)
        setup.sync(self.device)
        t0 = time.perf_counter()
        logits = self.model(self.tokens[:n], torch.arange(n, device=self.device), self.kv, num_logits=1)
        int(logits[-1].argmax())
        setup.sync(self.device)
        dt = time.perf_counter() - t0
        return dt, {k: v - before.get(k, 0) for k, v in rt.stats.items() if isinstance(v, (int, float))}


def out(line=""):
    print(line, flush=True)


def _room_for_resident(hb, device) -> bool:
    if device == "cuda":
        return torch.cuda.mem_get_info()[0] > hb.total_bytes + 6 * GB
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") > hb.total_bytes + 2 * GB


def run(a, mc, hb, device, dtype) -> None:
    """The prefill table for a.lengths on the given host banks (bench_decode.py reuses it)."""
    lengths = [int(n) for n in str(a.lengths).split(",")]
    bench = PrefillBench(a, mc, hb, device, dtype, max(lengths))
    bp, how = measure_bp(hb, device)
    t_bp = hb.total_bytes / (bp * GB)
    out(f"# prefill: device {device}, compute {str(dtype).replace('torch.', '')}; real qwen3_moe layers, "
        f"random weights; routing injected ({a.workload}); one forward per prompt (no chunking), KV from empty")
    out(f"# B_P = {bp:.1f} GB/s ({how}); expert_bytes / B_P = {t_bp:.2f} s")
    for n, d in bench.distinct.items():
        out(f"# {a.workload}: distinct experts per layer in the first {n} tokens: min {min(d)} "
            f"median {int(np.median(d))} max {max(d)}")
    rts = {}
    try:
        rts["streamed"] = bench.runtime(resident=False)
        if a.no_resident:
            out("# resident compute run skipped (--no-resident)")
        elif _room_for_resident(hb, device):
            rts["resident"] = bench.runtime(resident=True)
        else:
            out("# resident compute run skipped: no room for a second copy of every expert")
        for rt in rts.values():  # warm-up forwards, excluded
            bench.prefill(rt, min(lengths))
        hdr = (f"{'tokens':>7} {'stream s':>9} {'tok/s':>9} {'resident s':>10} {'tok/s':>9} "
               f"{'bytes/B_P s':>11} {'max(.,.) s':>10} {'stream/max':>10} {'layers':>6} {'GB streamed':>11}")
        out()
        out(hdr)
        out("-" * len(hdr))
        for n in lengths:
            try:
                ts, st = bench.prefill(rts["streamed"], n)
                tr = bench.prefill(rts["resident"], n)[0] if "resident" in rts else float("nan")
            except Exception as e:  # one failing length must not end the table
                out(f"{n:>7} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                traceback.print_exc(limit=3, file=sys.stderr)
                continue
            bound = max(t_bp, tr) if tr == tr else t_bp
            note = "" if st.get("prefill_layers_streamed") else "  (NOT streamed: slot path)"
            out(f"{n:>7} {ts:>9.3f} {n / ts:>9.0f} {tr:>10.3f} {n / tr:>9.0f} {t_bp:>11.3f} {bound:>10.3f} "
                f"{ts / bound:>10.2f} {st.get('prefill_layers_streamed', 0):>6} "
                f"{st.get('bytes_streamed', 0) / GB:>11.2f}{note}")
        out("goal: 8K tokens stream/max <= 1.15 (max = max(expert_bytes / B_P, resident compute))")
    finally:
        bench.proxy.runtime = None
        for rt in rts.values():
            rt.close()
        if device == "cuda":
            torch.cuda.empty_cache()


def main(argv=None):
    a = parse_args(argv)
    t_start = time.perf_counter()
    with setup.bench_banks(a, "bench_prefill") as (mc, hb, device, dtype):
        run(a, mc, hb, device, dtype)
        out(f"# total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
