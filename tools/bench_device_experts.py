"""Device expert kernels at decode batch (experts/compute/triton_experts.py, cuda): GB/s of expert weights
each kernel reads, against the device's own read rate (a torch sum over a large bf16 tensor), for
each block configuration in a sweep. The default configuration is marked; every configuration's
result is checked against torch before it is timed.

Slots live in a pool larger than the L2 cache and each call reads a different random set of
them, so every call reads from device memory. Calls are timed as the decode step runs them:
--calls launches captured in one CUDA graph, replayed --reps times, median per call (the gap
between graph nodes included).

    python tools/bench_device_experts.py                       # Qwen3-30B-A3B expert, batch 1
    python tools/bench_device_experts.py --tokens 4 --hidden 7168 --inter 2048
"""
import argparse
import itertools
import statistics

import torch

from freetoken.experts.compute import triton_experts as te

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
    ap.add_argument("--gate-up", default="4,8,16,32/128,256,512/2,4,8",
                    help="gate_up sweep: BLOCK_I values / BLOCK_D values / num_warps values")
    ap.add_argument("--down", default="16,32,64/128,256,512/2,4,8",
                    help="down sweep: BLOCK_O values / BLOCK_H values / num_warps values")
    return ap.parse_args(argv)


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


def main(argv=None):
    a = parse_args(argv)
    if not torch.cuda.is_available() or not te.available():
        raise SystemExit("error: bench_device_experts needs a CUDA GPU and Triton")
    D, I, K, T = a.hidden, a.inter, a.top_k, a.tokens
    R = T * K
    slot_elems = 3 * I * D
    offs = (0, I * D, 2 * I * D)  # gate [I, D], up [I, D], down [D, I]
    S = max(2 * R, int(a.pool_gb * GB) // (slot_elems * 2))
    torch.manual_seed(0)
    pool = (torch.randn(S, slot_elems, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(T, D, device="cuda").to(torch.bfloat16)
    weights = torch.rand(R, device="cuda") + 0.1
    sets = [torch.randperm(S, device="cuda")[:R] for _ in range(a.calls)]
    h = torch.empty(R, I, device="cuda")
    y = torch.empty(R, D, device="cuda")

    # torch reference for sets[0]
    w = pool[sets[0]].float()
    gate, up, down = w[:, :I * D].view(R, I, D), w[:, I * D:2 * I * D].view(R, I, D), w[:, 2 * I * D:].view(R, D, I)
    xr = x.float().repeat_interleave(K, dim=0)  # route r = t*K + k
    g_ref = torch.einsum("rid,rd->ri", gate, xr)
    h_ref = torch.nn.functional.silu(g_ref) * torch.einsum("rid,rd->ri", up, xr)
    y_ref = torch.einsum("rdi,ri->rd", down, h_ref) * weights[:, None]

    ref = read_rate(2 * 1024 ** 3)
    print(f"# device expert kernels | {torch.cuda.get_device_name()} | D {D} x I {I} bf16, {T} token(s) x "
          f"top-{K} = {R} routes; {S} slots ({S * slot_elems * 2 / GB:.1f} GB); device read (torch sum) "
          f"{ref:.0f} GB/s; {a.calls} calls per graph, median of {a.reps}")
    print(f"{'kernel':<8} {'block':>9} {'warps':>5} {'us':>8} {'GB/s':>7} {'x read':>6}")
    results = {}
    for kernel, spec, nbytes, default in (
            ("gate_up", a.gate_up, R * 2 * I * D * 2, (te.BLOCK_I, te.BLOCK_D, te.WARPS_GATE_UP)),
            ("down", a.down, R * D * I * 2, (te.BLOCK_O, te.BLOCK_H, te.WARPS_DOWN))):
        for b1, b2, nw in sweep(spec):
            if kernel == "gate_up":
                def launch(i, b1=b1, b2=b2, nw=nw):
                    te._gate_up[(R, triton_cdiv(I, b1))](x, pool, sets[i % len(sets)], weights, h,
                                                       slot_elems, offs[0], offs[1], K=K, D=D, I=I,
                                                       BI=b1, BD=b2, num_warps=nw)
            else:
                h.copy_(h_ref)

                def launch(i, b1=b1, b2=b2, nw=nw):
                    te._down[(R, triton_cdiv(D, b1))](h, pool, sets[i % len(sets)], weights, y,
                                                    slot_elems, offs[2], D=D, I=I, BO=b1, BH=b2,
                                                    num_warps=nw)
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
