"""One prefill layer's routed experts on cuda: torch's grouped GEMM (experts/compute/grouped_mm.py)
against the grouped Triton kernels (grouped_experts.run_stacked with grouped_mm not chosen), on a
layer buffer of the Qwen3-30B-A3B expert shape (bf16 slots, gate | up | down, one stride) and
uniform routing; ms per layer, TFLOP/s of the expert matmuls, and the largest difference of the
two outputs against the output's largest magnitude. One table.

    python tools/bench_grouped_mm.py                      # 8192 tokens, top-8 of 128 experts
    python tools/bench_grouped_mm.py --tokens 2048,8192 --repeat 50
"""
import argparse
import time

import torch

from freetoken.experts import ffn
from freetoken.experts.compute import grouped_experts, grouped_mm
from freetoken.kernel_args import SILU


def timed(fn, repeat):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeat * 1e3, out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8192", help="comma list of prompt lengths")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_grouped_mm needs cuda")
    E, D, I = a.experts, a.hidden, a.inter
    g = torch.Generator(device="cuda").manual_seed(0)
    stride = (3 * I * D + 2047) // 2048 * 2048  # 4 KiB-aligned slots, as a layer buffer's
    pool = torch.randn(E, stride, device="cuda", dtype=torch.bfloat16, generator=g) * D ** -0.5
    stacks = ffn.ExpertWeights(pool[:, :I * D].view(E, I, D), pool[:, I * D:2 * I * D].view(E, I, D),
                               pool[:, 2 * I * D:3 * I * D].view(E, D, I))
    print(f"# {torch.cuda.get_device_name()} | torch {torch.version.__version__} | experts {E} x "
          f"(gate/up {I}x{D}, down {D}x{I}) bf16, top-{a.top_k}, uniform routing")
    print(f"{'tokens':>7} {'routes':>7} {'GEMM ms':>8} {'TFLOP/s':>8} {'Triton ms':>9} {'TFLOP/s':>8} "
          f"{'x faster':>8} {'max diff':>9}")
    for T in (int(t) for t in a.tokens.split(",")):
        R = T * a.top_k
        expert = torch.randint(0, E, (R,), device="cuda", generator=g).sort().values
        counts = torch.bincount(expert, minlength=E)
        tok = torch.randint(0, T, (R,), device="cuda", generator=g)
        rid = torch.arange(R, device="cuda")
        w = torch.rand(R, device="cuda", generator=g)
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        n_tiles = int((-(-counts.cpu() // grouped_experts.BM)).sum())
        assert grouped_mm.chosen(x, list(stacks[:3]), SILU)
        gemm_ms, y_gemm = timed(lambda: grouped_mm.run(x, tok, rid, w, list(stacks[:3]), 0, counts), a.repeat)
        chosen = grouped_mm.chosen
        grouped_mm.chosen = lambda *args: False
        try:
            tri_ms, y_tri = timed(lambda: grouped_experts.run_stacked(x, tok, rid, w, stacks, 0, counts, n_tiles,
                                                                      SILU), a.repeat)
        finally:
            grouped_mm.chosen = chosen
        flop = 2.0 * R * 3 * I * D
        diff = ((y_gemm - y_tri).abs().max() / y_tri.abs().max()).item()
        print(f"{T:>7} {R:>7} {gemm_ms:>8.2f} {flop / gemm_ms / 1e9:>8.0f} {tri_ms:>9.2f} "
              f"{flop / tri_ms / 1e9:>8.0f} {tri_ms / gemm_ms:>8.2f} {diff:>9.1e}")


if __name__ == "__main__":
    main()
