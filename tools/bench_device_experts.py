"""Device expert kernels at decode batch (experts/compute/triton_experts.py, cuda): GB/s of expert weights
each kernel reads, against the device's own read rate (a torch sum over a large bf16 tensor), for
each block configuration in a sweep. The default configuration is marked; every configuration's
result is checked against torch before it is timed.

Slots live in a pool larger than the L2 cache and each call reads a different random set of
them, so every call reads from device memory. Calls are timed as the decode step runs them:
--calls launches captured in one CUDA graph, replayed --reps times, median per call (the gap
between graph nodes included).

With --quant (q8_0, q4_0, mxfp4) the slots hold ftw.quant's blocks and scales, read in
place (experts/compute/quant_blocks.py): GB/s counts the quantized bytes, and the second value
of each sweep is 32-blocks per step (BLOCKS_GATE_UP, BLOCKS_DOWN) instead of columns.

    python tools/bench_device_experts.py                       # Qwen3-30B-A3B expert, batch 1
    python tools/bench_device_experts.py --tokens 4 --hidden 7168 --inter 2048
    python tools/bench_device_experts.py --quant q4_0 --gate-up 4,8/8,16,32/2,4 --down 16,32/4,8,16/4
"""
import argparse
import itertools
import statistics

import numpy as np
import torch

from freetoken.experts.compute import triton_experts as te
from freetoken.experts.compute.quant_blocks import CODES
from ftw import quant as Q

GB = 1e9


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048, help="D")
    ap.add_argument("--inter", type=int, default=768, help="I, the expert's intermediate width")
    ap.add_argument("--top-k", type=int, default=8, help="routes per token")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--pool-gb", type=float, default=3.0, help="slot pool size (well above L2)")
    ap.add_argument("--calls", type=int, default=64, help="calls captured in one graph")
    ap.add_argument("--reps", type=int, default=20, help="graph replays; the median is reported")
    ap.add_argument("--gate-up", help="gate_up sweep: BLOCK_I values / BLOCK_D values (--quant: "
                    "BLOCKS_GATE_UP) / num_warps values; default 4,8,16,32/128,256,512/2,4,8 "
                    "(--quant: 4,8,16/8,16,32/2,4)")
    ap.add_argument("--down", help="down sweep: BLOCK_O values / BLOCK_H values (--quant: "
                    "BLOCKS_DOWN) / num_warps values; default 16,32,64/128,256,512/2,4,8 "
                    "(--quant: 16,32,64/4,8,16/2,4,8)")
    ap.add_argument("--quant", choices=["none", *CODES], default="none",
                    help="slots of this quant type (the sweeps' second values: blocks per step)")
    a = ap.parse_args(argv)
    quant = a.quant != "none"
    a.gate_up = a.gate_up or ("4,8,16/8,16,32/2,4" if quant else "4,8,16,32/128,256,512/2,4,8")
    a.down = a.down or ("16,32,64/4,8,16/2,4,8" if quant else "16,32,64/128,256,512/2,4,8")
    return a


def sweep(spec: str) -> list:
    parts = [[int(v) for v in p.split(",")] for p in spec.split("/")]
    return list(itertools.product(*parts))


def per_call_us(launch, calls: int, reps: int) -> float:
    """Median µs per call of `calls` launches (launch(i)) captured in one graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (compiles) outside the capture
        for i in range(3):
            launch(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            launch(i)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median_high(times)


def read_rate(nbytes: int) -> float:
    """GB/s of a torch sum over nbytes of bf16 (the device's read rate for a plain kernel)."""
    big = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    out = torch.empty((), dtype=torch.float32, device="cuda")
    us = per_call_us(lambda i: torch.sum(big, dim=0, dtype=torch.float32, out=out), 8, 10)
    return nbytes / (us * 1e-6) / GB


class Pool:
    """S slots of one random expert (gate, up, down) in the bench's layout, and its fp32 weights
    (dequantized for a quant type): bf16 elements, or a quant type's bytes with their scales."""

    def __init__(self, D, I, quant, pool_gb, min_slots):
        g = np.random.default_rng(0)
        w = [g.standard_normal(shape).astype(np.float32) * 0.02 for shape in ((I, D), (I, D), (D, I))]
        self.quant = quant
        if quant == "none":
            self.nbytes = [I * D * 2] * 3
            raw = torch.cat([torch.from_numpy(m).reshape(-1) for m in w]).to(torch.bfloat16)
            self.weights = [torch.from_numpy(m).to(torch.bfloat16).float().cuda() for m in w]
        else:
            blobs = [Q.quantize(m, quant) for m in w]
            self.nbytes = [len(b) for b in blobs]
            self.weights = [torch.from_numpy(Q.dequantize(b, quant, m.shape)).cuda() for b, m in zip(blobs, w)]
            raw = torch.from_numpy(np.frombuffer(b"".join(blobs), np.uint8).copy())
        self.offs = np.cumsum([0] + [n // raw.element_size() for n in self.nbytes[:2]]).tolist()
        size = raw.numel() * raw.element_size()
        self.S = max(min_slots, int(pool_gb * GB) // size)
        self.pool = raw.cuda().repeat(self.S, 1)  # [S, slot elements]: every slot the same expert
        if quant != "none":
            self.scales = self.pool.view(torch.float16) if quant != "mxfp4" else self.pool
            r = [Q.regions(quant, m.shape).scales_offset for m in w]
            size = 1 if quant == "mxfp4" else 2
            self.soffs = [(o + ro) // size for o, ro in zip(self.offs, r)]


def main(argv=None):
    a = parse_args(argv)
    if not torch.cuda.is_available() or not te.available():
        raise SystemExit("error: bench_device_experts needs a CUDA GPU and Triton")
    D, I, K, T = a.hidden, a.inter, a.top_k, a.tokens
    R = T * K
    torch.manual_seed(0)
    p = Pool(D, I, a.quant, a.pool_gb, 2 * R)
    S, pool, offs, code = p.S, p.pool, p.offs, CODES.get(a.quant, 0)
    slot_elems = pool.stride(0)
    scales = p.scales if code else pool
    s_slot = scales.stride(0) if code else 0
    soffs = p.soffs if code else (0, 0, 0)
    x = torch.randn(T, D, device="cuda").to(torch.bfloat16)
    weights = torch.rand(R, device="cuda") + 0.1
    sets = [torch.randperm(S, device="cuda")[:R] for _ in range(a.calls)]
    h = torch.empty(R, I, device="cuda")
    y = torch.empty(R, D, device="cuda")

    # torch reference (every slot holds the same expert)
    gate, up, down = p.weights
    xr = x.float().repeat_interleave(K, dim=0)  # route r = t*K + k
    h_ref = torch.nn.functional.silu(xr @ gate.T) * (xr @ up.T)
    y_ref = (h_ref @ down.T) * weights[:, None]

    ref = read_rate(2 * 1024 ** 3)
    print(f"# device expert kernels | {torch.cuda.get_device_name()} | D {D} x I {I} "
          f"{'bf16' if not code else a.quant}, {T} token(s) x top-{K} = {R} routes; {S} slots "
          f"({pool.numel() * pool.element_size() / GB:.1f} GB); device read (torch sum) "
          f"{ref:.0f} GB/s; {a.calls} calls per graph, median of {a.reps}")
    print(f"{'kernel':<8} {'block':>9} {'warps':>5} {'us':>8} {'GB/s':>7} {'x read':>6}")
    results = {}
    defaults = ((te.BLOCK_I, te.BLOCKS_GATE_UP if code else te.BLOCK_D, te.WARPS_GATE_UP),
                (te.BLOCK_O, te.BLOCKS_DOWN if code else te.BLOCK_H, te.WARPS_DOWN))
    for kernel, spec, nbytes, default in (("gate_up", a.gate_up, R * (p.nbytes[0] + p.nbytes[1]), defaults[0]),
                                          ("down", a.down, R * p.nbytes[2], defaults[1])):
        for b1, b2, nw in sweep(spec):
            nb, cols = (b2, 32 * b2) if code else (1, b2)  # blocks per step, columns per step
            if kernel == "gate_up":
                def launch(i, b1=b1, cols=cols, nb=nb, nw=nw):
                    te._gate_up[(R, triton_cdiv(I, b1))](
                        x, pool, scales, sets[i % len(sets)], weights, h, slot_elems, s_slot,
                        offs[0], offs[1], soffs[0], soffs[1], 0, 0, 1.0, 0.0, K=K, D=D, I=I,
                        BI=b1, BD=cols, NB=nb, QUANT=code, CLAMPED=False, BIAS=False, num_warps=nw)
            else:
                h.copy_(h_ref)

                def launch(i, b1=b1, cols=cols, nb=nb, nw=nw):
                    te._down[(R, triton_cdiv(D, b1))](
                        h, pool, scales, sets[i % len(sets)], weights, y, slot_elems, s_slot,
                        offs[2], soffs[2], 0, D=D, I=I, BO=b1, BH=cols, NB=nb, QUANT=code,
                        BIAS=False, num_warps=nw)
            try:
                launch(0)
                torch.cuda.synchronize()
                got, want = (h, h_ref) if kernel == "gate_up" else (y, y_ref)
                err = ((got - want).abs().max() / want.abs().max()).item()
                if err > 1e-3:
                    print(f"{kernel:<8} {b1:>4}x{b2:<4} {nw:>5}  wrong (max rel error {err:.1e})")
                    continue
                us = per_call_us(launch, a.calls, a.reps)
            except Exception as e:  # a configuration Triton cannot build (registers, shared memory)
                print(f"{kernel:<8} {b1:>4}x{b2:<4} {nw:>5}  failed: {type(e).__name__}")
                continue
            gbs = nbytes / (us * 1e-6) / GB
            mark = " default" if (b1, b2, nw) == default else ""
            results.setdefault(kernel, []).append((us, b1, b2, nw))
            print(f"{kernel:<8} {b1:>4}x{b2:<4} {nw:>5} {us:>8.1f} {gbs:>7.0f} {gbs / ref:>6.2f}{mark}", flush=True)
    for kernel, rows in results.items():
        us, b1, b2, nw = min(rows)
        print(f"# best {kernel}: {b1}x{b2}, {nw} warps, {us:.1f} us")


def triton_cdiv(n: int, b: int) -> int:
    return -(-n // b)


if __name__ == "__main__":
    main()
