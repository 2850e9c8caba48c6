"""Bench the CPU expert kernels: kernel GB/s vs STREAM read vs torch's bf16 CPU experts.

One run, one table. Shapes: Qwen3-30B-A3B (hidden 2048, expert 768) and DeepSeek-V3 (7168 /
2048), top-8, batches 1, 4 and 16. GB/s counts the unique expert bytes each call reads; the
experts cycled through are several times the last-level cache. Every path is checked against a
torch fp32 reference before it is timed.

    python tools/bench_cpu_experts.py                  # all physical cores, best ISA path
    python tools/bench_cpu_experts.py --threads 15 --isa all
    python tools/bench_cpu_experts.py --variants ab    # kernel tunings side by side (A/B)
    python tools/bench_cpu_experts.py --call-experts 1,2,4,8,16
                                                       # the fixed cost of one call
    python tools/bench_cpu_experts.py --beside-copies --variants "default;prefetch=0"
                                                       # cuda: each tuning beside PCIe copies

--variants takes ';'-separated kernel tunings (freetoken.kernels.KernelTuning, e.g.
"default;prefetch=0;rows=2") or "ab" for the standard set (AB_VARIANTS), each over the defaults
and FREETOKEN_KERNEL_TUNE; fields left auto take the ISA path's default (the header lines show
the values used). Each variant is checked against torch fp32, then its kernel GB/s and
x STREAM are measured in rounds alternating with one STREAM read (the base tuning's, same
pool and threads), so drifts of the machine's memory speed hit all columns alike.
"""
import argparse
import os
import platform
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from freetoken import kernels
from freetoken import bandwidth as bw
from freetoken import profile as prof

SHAPES = {
    "qwen3": prof.ExpertShape(2048, 768, 8, "bf16", 128, "Qwen3-30B-A3B"),
    "deepseek": prof.ExpertShape(7168, 2048, 8, "bf16", 256, "DeepSeek-V3"),
}


def torch_views(bank, layout):
    """bf16 tensors [E, I, D], [E, I, D], [E, D, I] sharing the bank's memory."""
    E = bank.nbytes // layout.slot_stride
    slots = torch.from_numpy(bank).view(E, layout.slot_stride)
    n = layout.D * layout.I * 2

    def proj(off, shape):
        return slots[:, off:off + n].view(torch.bfloat16).view(E, *shape)
    return (proj(layout.offset_gate, (layout.I, layout.D)), proj(layout.offset_up, (layout.I, layout.D)),
            proj(layout.offset_down, (layout.D, layout.I)))


def torch_experts(x, views, tok, exp, w, out, dtype=torch.bfloat16):
    """The torch CPU expert path: per unique expert, F.linear on `dtype` tensors."""
    gate, up, down = views
    xt, tok_t, w_t = torch.from_numpy(x), torch.from_numpy(tok).long(), torch.from_numpy(w)
    exp_t = torch.from_numpy(exp)
    for e in torch.unique(exp_t).tolist():
        sel = (exp_t == e).nonzero().flatten()
        rows = tok_t[sel]
        xe = xt[rows].to(dtype)
        h = F.silu(F.linear(xe, gate[e].to(dtype))) * F.linear(xe, up[e].to(dtype))
        y = F.linear(h, down[e].to(dtype)).float() * w_t[sel, None]
        torch.from_numpy(out).index_add_(0, rows, y)
    return out


def check(pool, bank, layout, views, isa):
    """Kernel vs torch fp32 on a batch of 4; returns the max error relative to the output scale."""
    tok, exp, w, _ = bw.route_sets(bank.nbytes // layout.slot_stride, 4, 8, 1, seed=3)[0]
    x = np.random.default_rng(2).standard_normal((4, layout.D)).astype(np.float32)
    got = pool.run(x, bank, layout, tok, exp, w, np.zeros_like(x), isa=isa)
    want = torch_experts(x, views, tok, exp, w, np.zeros_like(x), dtype=torch.float32)
    err = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-6))
    limit = 2e-2 if isa == "avx512bf16" else 1e-3
    if not err <= limit:
        sys.exit(f"FAIL: {isa} kernel differs from the torch fp32 reference: rel. error {err:.3g} > {limit}")
    return err


def time_torch(views, bank, layout, batch, top_k, seconds):
    num_experts = bank.nbytes // layout.slot_stride
    calls = bw.route_sets(num_experts, batch, top_k, max(1, num_experts // top_k))
    x = np.random.default_rng(1).standard_normal((batch, layout.D)).astype(np.float32)
    out = np.zeros_like(x)
    return bw._timed_passes(lambda: [torch_experts(x, views, t, e, w, out) for t, e, w, _ in calls],
                              sum(u for *_, u in calls) * layout.expert_nbytes, seconds)


def interleaved(pool, bank, layout, batch, top_k, seconds, rounds=5):
    """(STREAM, kernel) GB/s, medians over rounds that alternate the two on the same bank pages,
    so slow drifts of the machine's memory speed (seen on VMs) hit both alike."""
    pairs = [(bw.time_stream_read(pool, bank, seconds / rounds),
              bw.time_kernel(pool, bank, layout, batch, top_k, seconds / rounds)) for _ in range(rounds)]
    return float(np.median([p[0] for p in pairs])), float(np.median([p[1] for p in pairs]))


# Tunings worth comparing on a new machine (--variants ab): the defaults, each knob alone.
AB_VARIANTS = ("default;help=0;help=1;prefetch=0;prefetch=1024;prefetch=2048;prefetch=4096;prefetch_hint=t0;"
               "rows=1;rows=4;down_rows=1;down_rows=4;item_kb=64;item_kb=192;item_kb=1024;spread=16")


def parse_variants(text):
    """{label: KernelTuning} from ';'-separated tunings ("ab": AB_VARIANTS), each over the
    defaults (and FREETOKEN_KERNEL_TUNE)."""
    base = kernels.tuning_from_env()
    text = AB_VARIANTS if text == "ab" else text
    return {t.strip() or "default": kernels.KernelTuning.parse(t, base) for t in text.split(";")}


def interleaved_variants(pool, bank, layout, batch, top_k, seconds, tunings, rounds=5):
    """STREAM GB/s and {label: kernel GB/s}: medians over rounds of one STREAM read (the pool's
    own tuning) then every variant, seconds per measurement split over the rounds."""
    base, per = pool.tuning, seconds / rounds
    streams, kern = [], {label: [] for label in tunings}
    try:
        for _ in range(rounds):
            pool.tuning = base
            streams.append(bw.time_stream_read(pool, bank, per))
            for label, tuning in tunings.items():
                pool.tuning = tuning
                kern[label].append(bw.time_kernel(pool, bank, layout, batch, top_k, per))
    finally:
        pool.tuning = base
    return float(np.median(streams)), {label: float(np.median(v)) for label, v in kern.items()}


def variants_table(pool, args, batches):
    """--variants: one row per shape and batch, kernel GB/s and x STREAM per tuning."""
    tunings = parse_variants(args.variants)
    labels = [f"v{i}" for i in range(len(tunings))]
    for label, (name, tuning) in zip(labels, tunings.items()):
        auto = kernels.path_defaults(pool.isa, num_threads=pool.num_threads)
        print(f"# {label} = {name}  ({tuning.resolved(auto)})", flush=True)
    hdr = f"{'shape':<14} {'batch':>5} {'experts':>7} {'STREAM':>7} " + " ".join(f"{l + ' GB/s xS':>14}" for l in labels)
    rows = [hdr, "-" * len(hdr)]
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        layout = bw.synthetic_layout(shape)
        E = bank_experts(shape, layout, args.max_bank_gb)
        bank = bw.synthetic_bank(layout, E)
        print(f"# {shape.name}: {E} experts, {bank.nbytes / 1e9:.2f} GB", flush=True)
        views, base = torch_views(bank, layout), pool.tuning
        for tuning in tunings.values():
            pool.tuning = tuning
            check(pool, bank, layout, views, pool.isa)
        pool.tuning = base
        for batch in batches:
            stream, kgb = interleaved_variants(pool, bank, layout, batch, shape.top_k, args.seconds, tunings)
            uniq = np.mean([u for *_, u in bw.route_sets(E, batch, shape.top_k, 8)])
            rows.append(f"{shape.name:<14} {batch:>5} {uniq:>7.1f} {stream:>7.2f} " +
                        " ".join(f"{kgb[t]:>8.2f} {kgb[t] / stream:>5.2f}" for t in tunings))
            print(rows[-1], flush=True)
        del bank, views
    print("\n".join(["", *rows]))


def beside_copies_table(pool, args):
    """--beside-copies: per tuning, the kernel at batch 1 alone and while pinned host-to-device
    copies of one layer run in a loop (as during hybrid decode), with the copies' GB/s."""
    if not torch.cuda.is_available():
        sys.exit("error: --beside-copies needs a CUDA GPU (it runs pinned host-to-device copies "
                 "beside the kernel); run it on the GPU host")
    tunings = parse_variants(args.variants or "default")
    hdr = (f"{'shape':<14} {'tuning':<40} {'alone GB/s':>10} {'beside GB/s':>11} {'copies GB/s':>11} "
           f"{'sum':>7}")
    rows = [hdr, "-" * len(hdr)]
    base = pool.tuning
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        layout = bw.synthetic_layout(shape)
        bank = bw.synthetic_bank(layout, bank_experts(shape, layout, args.max_bank_gb))
        layer = shape.num_experts * layout.slot_stride
        try:
            pool.tuning = base
            alone = bw.time_stream_read(pool, bank, args.seconds)
            P, C = bw.concurrent_bandwidths(pool, bank, layout, shape.top_k, layer, args.seconds,
                                            host_work=lambda bank=bank: (pool.read_sum(bank), bank.nbytes)[1])
            rows.append(f"{shape.name:<14} {'STREAM read (the bound)':<40} {alone:>10.2f} {C:>11.2f} "
                        f"{P:>11.2f} {P + C:>7.2f}")
            print(rows[-1], flush=True)
            for label, tuning in tunings.items():
                pool.tuning = tuning
                alone = bw.time_kernel(pool, bank, layout, 1, shape.top_k, args.seconds)
                P, C = bw.concurrent_bandwidths(pool, bank, layout, shape.top_k, layer, args.seconds)
                rows.append(f"{shape.name:<14} {label[:40]:<40} {alone:>10.2f} {C:>11.2f} {P:>11.2f} "
                            f"{P + C:>7.2f}")
                print(rows[-1], flush=True)
        finally:
            pool.tuning = base
        del bank
    print("\n".join(["", *rows]))


def model_distinct(num_experts: int, batch: int, top_k: int) -> float:
    """Expected distinct experts of `batch` tokens each routing to top_k of num_experts
    uniformly: an expert is missed by one token with probability 1 - top_k / num_experts."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def crowding_note(shape, E, batches) -> str:
    """What a bank of E < the model's experts does to the batches: tokens per expert here and
    in the model (more tokens per expert: more arithmetic per byte read)."""
    parts = []
    for b in batches:
        here, model = model_distinct(E, b, shape.top_k), model_distinct(shape.num_experts, b, shape.top_k)
        parts.append(f"batch {b} {b * shape.top_k / here:.2f} ({b * shape.top_k / model:.2f})")
    return (f"the bank holds {E} of the model's {shape.num_experts} experts; routes per expert here "
            f"(in the model): {', '.join(parts)}; --max-bank-gb for more")


def bank_experts(shape, layout, max_bank_gb):
    """The model's own expert count when it fits in max_bank_gb (so batches route over as many
    experts as the real model), never fewer than 4x the LLC's worth."""
    fit = int(max_bank_gb * 1e9) // layout.slot_stride
    return max(bw.working_set_experts(layout, shape.top_k), min(shape.num_experts, fit))


def call_size_table(pool, args):
    """--call-experts: batch 1 calls of n experts each, per shape: ms per call, GB/s and
    x STREAM, and the least-squares fit ms = fixed + n x per-expert, whose fixed part (submit,
    wake-up, the last items' tail, the return) is what short decode calls pay over STREAM."""
    sizes = [int(n) for n in args.call_experts.split(",")]
    hdr = f"{'shape':<14} {'experts/call':>12} {'ms/call':>8} {'GB/s':>7} {'x STREAM':>8}"
    rows = [hdr, "-" * len(hdr)]
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        layout = bw.synthetic_layout(shape)
        bank = bw.synthetic_bank(layout, bank_experts(shape, layout, args.max_bank_gb))
        ms = []
        for n in sizes:
            stream, kgb = interleaved(pool, bank, layout, 1, n, args.seconds)
            ms.append(n * layout.expert_nbytes / kgb / 1e6)
            rows.append(f"{shape.name:<14} {n:>12} {ms[-1]:>8.3f} {kgb:>7.2f} {kgb / stream:>8.2f}")
            print(rows[-1], flush=True)
        if len(sizes) > 1:
            per, fixed = np.polyfit(sizes, ms, 1)
            rows.append(f"# {shape.name}: ms/call = {fixed * 1e3:.0f} us + n x {per * 1e3:.0f} us "
                        f"({layout.expert_nbytes / per / 1e6:.1f} GB/s per added expert)")
            print(rows[-1], flush=True)
        del bank
    print("\n".join(["", *rows]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="pool threads [all physical cores]")
    ap.add_argument("--isa", default=None,
                    help="ISA path, a comma list of them, or 'all' for every path this CPU runs [best]")
    ap.add_argument("--shapes", default="qwen3,deepseek", help="comma list of " + ",".join(SHAPES))
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--seconds", type=float, default=2.0, help="per measurement (split in 5 rounds)")
    ram_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    ap.add_argument("--max-bank-gb", type=float, default=min(32.0, 0.6 * ram_gb),
                    help="largest bank to build [min(32, 0.6 x RAM)]; the model's full expert count "
                         "when it fits (fewer experts crowd a batch's routes onto fewer of them)")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch bf16 baseline")
    ap.add_argument("--variants", default=None,
                    help="compare kernel tunings: ';'-separated (see above) or 'ab' [off]")
    ap.add_argument("--beside-copies", action="store_true",
                    help="cuda: the kernel at batch 1 alone and beside a loop of pinned H2D layer "
                         "copies, per tuning of --variants (default: the defaults)")
    ap.add_argument("--copy-sync", choices=("blocking", "spin"), default="blocking",
                    help="--beside-copies: the copy thread sleeps on a blocking event, or spins in "
                         "the sync as a default CUDA wait does [blocking]")
    ap.add_argument("--call-experts", default=None, metavar="N,N,...",
                    help="batch 1 calls of N experts each: ms per call and its fixed cost [off]")
    args = ap.parse_args()

    threads = args.threads or kernels.default_num_threads(has_gpu=False)
    isas = (kernels.available_isas()[::-1] if args.isa == "all"
            else args.isa.split(",") if args.isa else [kernels.CpuExpertPool(1).isa])
    pool = kernels.CpuExpertPool(threads, isa=isas[0])
    torch.set_num_threads(threads)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"# {prof.cpu_model()} | {len(kernels.physical_cores())} physical cores, pool {threads} threads "
          f"pinned {pool.pinned_cpus} | LLC {bw.llc_bytes() >> 20} MiB | ISAs {kernels.available_isas()} | "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads) | python {platform.python_version()}",
          flush=True)
    auto = kernels.path_defaults(pool.isa, num_threads=threads)
    print(f"# kernel tuning: {pool.tuning} ({pool.isa} bf16: {pool.tuning.resolved(auto)})",
          flush=True)
    bw.COPY_SYNC_BLOCKING = args.copy_sync == "blocking"
    if args.beside_copies:
        beside_copies_table(pool, args)
        return
    if args.call_experts:
        call_size_table(pool, args)
        return
    if args.variants:
        variants_table(pool, args, batches)
        return

    hdr = (f"{'shape':<14} {'D x I':>11} {'batch':>5} {'isa':>10} {'experts':>7} {'STREAM GB/s':>11} "
           f"{'kernel GB/s':>11} {'x STREAM':>8} {'torch bf16 GB/s':>15} {'x torch':>7} {'ms/call':>8} {'max rel err':>11}")
    rows = [hdr, "-" * len(hdr)]
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        layout = bw.synthetic_layout(shape)
        E = bank_experts(shape, layout, args.max_bank_gb)
        t0 = time.perf_counter()
        bank = bw.synthetic_bank(layout, E)
        print(f"# {shape.name}: {E} experts x {layout.slot_stride / 1e6:.1f} MB = "
              f"{bank.nbytes / 1e9:.2f} GB working set (built in {time.perf_counter() - t0:.1f} s)", flush=True)
        if E < shape.num_experts:
            print(f"# {crowding_note(shape, E, batches)}", flush=True)
        views = torch_views(bank, layout)
        errs = {isa: check(pool, bank, layout, views, isa) for isa in isas}
        for batch in batches:
            tgb = None if args.no_torch else time_torch(views, bank, layout, batch, shape.top_k, args.seconds)
            for isa in isas:
                pool.isa = isa
                stream, kgb = interleaved(pool, bank, layout, batch, shape.top_k, args.seconds)
                uniq = np.mean([u for *_, u in bw.route_sets(E, batch, shape.top_k, 8)])
                ms = uniq * layout.expert_nbytes / kgb / 1e6
                rows.append(f"{shape.name:<14} {f'{shape.hidden}x{shape.expert_hidden}':>11} {batch:>5} "
                            f"{isa:>10} {uniq:>7.1f} {stream:>11.2f} {kgb:>11.2f} {kgb / stream:>8.2f} "
                            f"{'-' if tgb is None else f'{tgb:.2f}':>15} "
                            f"{'-' if tgb is None else f'{kgb / tgb:.1f}':>7} {ms:>8.2f} {errs[isa]:>11.2e}")
                print(rows[-1], flush=True)
        del bank, views
    print("\n".join(["", *rows]))


if __name__ == "__main__":
    main()
