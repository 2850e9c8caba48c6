"""The captured decode step's attention (cuda): SDPA over the whole span with a mask
(layers._grouped_decode_attention: the cpu path's, and the tests' reference) against
split_attention.decode_attention (split-K over the attended slots only, cuda's), per span S
and position. One table:
µs per call, MB of K/V the call must read (the attended slots [0, pos]; SDPA reads all S),
GB/s of those bytes, that against the device's read rate (a torch sum), and the largest error
against an fp32 torch reference (relative to the largest output). Each kernel's result is
checked against that reference and the Triton ones against SDPA's before anything is timed.

Calls are timed as the decode step runs them: --calls launches captured in one CUDA graph,
replayed --reps times, median per call. Each call reads another layer's cache (as many as it
takes to pass --pool-gb), so its K/V come from device memory, not from the L2 cache.

    python tools/bench_decode_attention.py                    # Qwen3-30B-A3B: H 32, KV 4, hd 128
    python tools/bench_decode_attention.py --chunks 64,128,256,512   # + rows per split size
"""
import argparse
import math

import torch

from bench_device_experts import GB, per_call_us, read_rate
from freetoken.models import fused, split_attention
from freetoken.models.layers import _grouped_decode_attention


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=32, help="H, query heads")
    ap.add_argument("--kv-heads", type=int, default=4, help="KV")
    ap.add_argument("--head-dim", type=int, default=128, help="hd")
    ap.add_argument("--spans", default="256,1024,4096,16384,32768")
    ap.add_argument("--chunks", default="", help="split sizes to time besides decode_chunk's")
    ap.add_argument("--pool-gb", type=float, default=0.5, help="K/V the calls of a graph read")
    ap.add_argument("--calls", type=int, default=32, help="calls per graph at least")
    ap.add_argument("--reps", type=int, default=20, help="graph replays; the median is reported")
    return ap.parse_args(argv)


def reference(q, k, v, pos: int) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd)) v in fp32 over slots [0, pos] -> [1, H * hd]."""
    _, H, hd = q.shape
    G = H // k.shape[0]
    kf = k[:, :pos + 1].float().repeat_interleave(G, dim=0)  # [H, n, hd]
    vf = v[:, :pos + 1].float().repeat_interleave(G, dim=0)
    w = torch.softmax(torch.einsum("hd,hnd->hn", q[0].float(), kf) * hd ** -0.5, dim=-1)
    return torch.einsum("hn,hnd->hd", w, vf).reshape(1, -1)


def rel_err(got, want) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def main(argv=None):
    a = parse_args(argv)
    if not torch.cuda.is_available() or not fused.available():
        raise SystemExit("error: bench_decode_attention needs a CUDA GPU and Triton")
    H, KV, hd, dt = a.heads, a.kv_heads, a.head_dim, torch.bfloat16
    chunks = [int(c) for c in a.chunks.split(",") if c]
    rate = read_rate(2 * 1024 ** 3)
    print(f"# decode attention | {torch.cuda.get_device_name()} | H {H}, KV {KV}, hd {hd}, bf16, "
          f"one token | device read (torch sum) {rate:.0f} GB/s | median of {a.reps} replays")
    print(f"{'span':>6} {'pos':>6} {'path':>10} {'calls':>5} {'us':>8} {'K/V MB':>7} "
          f"{'GB/s':>6} {'x read':>6} {'err':>7}")
    torch.manual_seed(0)
    for span in (int(s) for s in a.spans.split(",")):
        layer_bytes = 2 * KV * span * hd * 2
        calls = max(a.calls, math.ceil(a.pool_gb * GB / layer_bytes))
        data = torch.randn(calls, 2, KV, span, hd, device="cuda", dtype=dt)  # one layer a call
        q = torch.randn(1, H, hd, device="cuda", dtype=dt)
        pos = torch.zeros(1, dtype=torch.int64, device="cuda")
        slots = torch.arange(span, device="cuda")
        for p in (span - 1, span // 2 + 1):
            pos.fill_(p)
            mask = (slots <= pos)[None, :]  # [1, S], as StaticKV.attention_mask (once a step)
            nbytes = 2 * KV * (p + 1) * hd * 2

            def sdpa(i):
                return _grouped_decode_attention(q, data[i % calls, 0], data[i % calls, 1], mask)

            paths = [("sdpa", sdpa)]
            default = split_attention.decode_chunk(span, KV)
            for chunk in [None] + [c for c in chunks if c != default]:
                def triton_call(i, chunk=chunk):
                    return split_attention.decode_attention(
                        q, data[i % calls, 0], data[i % calls, 1], pos, span, hd ** -0.5,
                        chunk=chunk)
                name = f"triton/{chunk or default}"
                paths.append((name, triton_call))
            want = reference(q, data[0, 0], data[0, 1], p)
            outs = {name: launch(0) for name, launch in paths}
            torch.cuda.synchronize()
            errs = {name: rel_err(out, want) for name, out in outs.items()}
            for name, out in outs.items():  # bf16 outputs: a rounding step or two apart
                err_sdpa = rel_err(out, outs["sdpa"])
                if errs[name] > 2 ** -6 or err_sdpa > 2 ** -5:
                    raise SystemExit(f"error: {name} at span {span} pos {p} is off: "
                                     f"{errs[name]:.1e} from fp32, {err_sdpa:.1e} from sdpa")
            for name, launch in paths:
                us = per_call_us(launch, calls, a.reps)
                gbs = nbytes / (us * 1e-6) / GB
                print(f"{span:>6} {p:>6} {name:>10} {calls:>5} {us:>8.1f} {nbytes / 1e6:>7.2f} "
                      f"{gbs:>6.0f} {gbs / rate:>6.2f} {errs[name]:>7.1e}", flush=True)


if __name__ == "__main__":
    main()
