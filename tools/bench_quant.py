"""Bench the CPU expert kernels on quantized experts: GB/s of q8_0 / q4_0 / mxfp4 / nvfp4 /
fp8_e4m3 bytes
read beside bf16 at the same shapes, and what that buys in experts per second. One run, one
table.

Each type's bank is the same (D, I) experts in the bank layout convert writes (ftw/SPEC.md
§5.2, §9.2), random bytes (no two pages alike), cycled through a working set of at least 4x
the last-level cache (bandwidth.working_set_experts). GB/s counts the unique expert bytes a
call reads (a quantized expert: its blocks and scales); "experts/s x bf16" is the rate of
whole experts against bf16's, the speed-up a bandwidth-bound decode step sees. Each kernel is
checked against ftw.quant's dequantize then a numpy fp32 reference before it is timed (the
int8 path within 3e-2 of the output's scale: its inputs' rounding, cython/qdot.h; fp32 1e-3).
STREAM read is measured in rounds alternating with the kernel on the same bank (as
bench_cpu_experts.py does). --qdot int8,fp32 (the default) gives each quantized type one row per
path (KernelTuning.qdot), one after the other on the same bank; nvfp4 and fp8_e4m3 have the
fp32 path only.

    python tools/bench_quant.py                          # Qwen3-30B-A3B and DeepSeek-V3 shapes
    python tools/bench_quant.py --shapes small --seconds 1 --threads 2   # a small CI VM
    python tools/bench_quant.py --isa generic,avx2       # each ISA path this CPU runs
    python tools/bench_quant.py --qdot fp32              # the fp32-widening kernels alone
    python tools/bench_quant.py --types fp8_e4m3         # one type (beside bf16, the baseline)
    python tools/bench_quant.py --cpu-time               # also GB per CPU-second (a shared VM)
"""
import argparse
import platform
import sys
import time

import numpy as np

from dataclasses import replace

from freetoken import bandwidth as bw
from freetoken import kernels
from freetoken import profile as prof
from ftw import quant as Q
from ftw.layout import BankEntry

SHAPES = {
    "small": prof.ExpertShape(1024, 512, 8, "bf16", 64, "small"),
    "qwen3": prof.ExpertShape(2048, 768, 8, "bf16", 128, "Qwen3-30B-A3B"),
    "deepseek": prof.ExpertShape(7168, 2048, 8, "bf16", 256, "DeepSeek-V3"),
}
TYPES = ("bf16", *kernels.KERNEL_QUANTS)
INT8_QUANTS = ("q8_0", "q4_0", "mxfp4")  # the types KernelTuning.qdot="int8" runs (cython/qdot.h)


def quant_layout(shape, quant):
    """The ExpertLayout convert writes for `shape`'s experts quantized as `quant`."""
    entry = BankEntry(0, shape.dtype, 1, shape.expert_hidden, shape.hidden, None, quant=quant)
    og, ou, od = (p["offset"] for p in entry.projections)
    return kernels.ExpertLayout(entry.slot_stride, shape.dtype, shape.hidden, shape.expert_hidden,
                                og, ou, od, quant)


def quant_bank(layout, num_experts, seed=0):
    """num_experts slots of random elements and block scales in [2^-10, 2^-6) (fp16; mxfp4's
    e8m0 powers of two; nvfp4's e4m3 in [1, 16) times g = 2^-10; fp8_e4m3's fp32 tile scales in
    [2^-14, 2^-10), its elements any finite e4m3), page-aligned."""
    rng = np.random.default_rng(seed)
    total = num_experts * layout.slot_stride
    raw = np.empty(total + 4096, np.uint8)
    bank = raw[(-raw.ctypes.data) % 4096:][:total]
    bank[:] = rng.integers(0, 256, total, dtype=np.uint8)
    slots = bank.reshape(num_experts, layout.slot_stride)
    for off, (rows, cols) in zip((layout.offset_gate, layout.offset_up, layout.offset_down),
                                 ((layout.I, layout.D),) * 2 + ((layout.D, layout.I),)):
        r = Q.regions(layout.quant, (rows, cols))
        n = r.scales_shape[0] * r.scales_shape[1]
        if layout.quant == "mxfp4":
            scales = rng.integers(127 - 10, 127 - 6, (num_experts, n), dtype=np.uint8)
        elif layout.quant == "fp8_e4m3":
            qs = slots[:, off:off + r.qs_nbytes]
            qs[(qs & 0x7F) == 0x7F] ^= 1  # no NaN codes (0x7f, 0xff)
            scales = rng.uniform(2.0 ** -14, 2.0 ** -10, (num_experts, n)).astype("<f4")
        elif layout.quant == "nvfp4":
            scales = Q.e4m3_encode(rng.uniform(1, 16, (num_experts, n)))
            g = np.full((num_experts, 1), 2.0 ** -10, "<f4").view(np.uint8)
            slots[:, off + r.tensor_scale_offset:off + r.tensor_scale_offset + 4] = g
        else:
            scales = rng.uniform(2.0 ** -10, 2.0 ** -6, (num_experts, n)).astype("<f2")
        scales = scales.view(np.uint8)
        slots[:, off + r.scales_offset:off + r.scales_offset + scales.shape[1]] = scales
    return bank


def make_bank(shape, quant):
    """(layout, bank): the type's own working set, >= 4 x LLC bytes (bw.working_set_experts), so
    that neither the kernel nor the STREAM read beside it is served from the cache. (One expert
    count for every type, bf16's, left a 4-bit bank at 1.2 x LLC: on the H200 host its STREAM
    read 286-314 GB/s against bf16's 179.)"""
    layout = bw.synthetic_layout(shape) if quant == "bf16" else quant_layout(shape, quant)
    num_experts = bw.working_set_experts(layout, shape.top_k)
    if quant == "bf16":
        return layout, bw.synthetic_bank(layout, num_experts)
    return layout, quant_bank(layout, num_experts)


def dequantized(bank, layout, e):
    """Expert e's (gate, up, down) as fp32 numpy arrays."""
    slot = bank[e * layout.slot_stride:(e + 1) * layout.slot_stride]
    out = []
    for off, nbytes, shape in zip((layout.offset_gate, layout.offset_up, layout.offset_down),
                                  layout.proj_nbytes, ((layout.I, layout.D),) * 2 + ((layout.D, layout.I),)):
        raw = slot[off:off + nbytes]
        if layout.quant == "none":  # bf16 bits
            out.append((raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape))
        else:
            out.append(Q.dequantize(raw, layout.quant, shape))
    return out


def check(pool, bank, layout, isa, qdot="fp32"):
    """The kernel on 4 tokens x top-8 against dequantize then numpy fp32; the max error relative
    to the output's scale (exits when above 1e-3; the int8 path 3e-2)."""
    tok, exp, w, _ = bw.route_sets(bank.nbytes // layout.slot_stride, 4, 8, 1, seed=3)[0]
    x = np.random.default_rng(2).standard_normal((4, layout.D)).astype(np.float32)
    got = pool.run(x, bank, layout, tok, exp, w, np.zeros_like(x), isa=isa)
    want = np.zeros_like(x)
    for t, e, wt in zip(tok, exp, w):
        gate, up, down = dequantized(bank, layout, e)
        g = gate @ x[t]
        with np.errstate(over="ignore"):  # silu of a large negative g: exp overflows, g / inf = -0
            h = g / (1 + np.exp(-g)) * (up @ x[t])
        want[t] += wt * (down @ h)
    err = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-6))
    limit = 2e-2 if isa == "avx512bf16" and layout.quant == "none" else 1e-3
    if qdot == "int8" and layout.quant in INT8_QUANTS:
        limit = 3e-2
    if not err <= limit:
        sys.exit(f"FAIL: {isa} {layout.kernel_dtype} kernel differs from the reference: "
                 f"rel. error {err:.3g} > {limit} (qdot {qdot})")
    return err


def interleaved(pool, bank, layout, batch, top_k, seconds, rounds=5):
    """(STREAM, kernel) GB/s: medians over rounds alternating the two on the same bank."""
    pairs = [(bw.time_stream_read(pool, bank, seconds / rounds),
              bw.time_kernel(pool, bank, layout, batch, top_k, seconds / rounds)) for _ in range(rounds)]
    return float(np.median([p[0] for p in pairs])), float(np.median([p[1] for p in pairs]))


def cpu_rate(pool, bank, layout, batch, top_k, seconds):
    """GB of unique expert bytes per CPU-second of this process (all its threads) over passes
    like time_kernel's: on a machine shared with other work, what the kernel costs rather than
    the wall time it got."""
    num_experts = bank.nbytes // layout.slot_stride
    calls = bw.route_sets(num_experts, batch, top_k, max(1, num_experts // top_k))
    x = np.random.default_rng(1).standard_normal((batch, layout.D)).astype(np.float32)
    out = np.zeros_like(x)
    nbytes = sum(u for *_, u in calls) * layout.expert_nbytes
    c0, t0, passes = time.process_time(), time.perf_counter(), 0
    while not passes or time.perf_counter() - t0 < seconds:
        for t, e, w, _ in calls:
            pool.run(x, bank, layout, t, e, w, out)
        passes += 1
    return passes * nbytes / (time.process_time() - c0) / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="pool threads [all physical cores]")
    ap.add_argument("--isa", default=None, help="ISA path or a comma list of them [the best]")
    ap.add_argument("--shapes", default="qwen3,deepseek", help="comma list of " + ",".join(SHAPES))
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--seconds", type=float, default=2.0, help="per measurement (split in 5 rounds)")
    ap.add_argument("--types", default=",".join(TYPES[1:]),
                    help="comma list of the quantized types to bench (bf16 always runs: the baseline)")
    ap.add_argument("--qdot", default="int8,fp32", help="KernelTuning.qdot paths, a row each [int8,fp32]")
    ap.add_argument("--tunings", default="default",
                    help="';'-separated KernelTuning texts (FREETOKEN_KERNEL_TUNE's form), a row each over "
                         "the same bank, e.g. 'default;down_rows=2;item_kb=1024,down_rows=2' [default]")
    ap.add_argument("--cpu-time", action="store_true",
                    help="also GB per CPU-second at each batch (cpu_rate; the waiting thread does not help)")
    args = ap.parse_args()

    threads = args.threads or kernels.default_num_threads(has_gpu=False)
    isas = args.isa.split(",") if args.isa else [kernels.CpuExpertPool(1).isa]
    pool = kernels.CpuExpertPool(threads, isa=isas[0], spin_us=0)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"# {prof.cpu_model()} | {len(kernels.physical_cores())} physical cores, pool {threads} "
          f"threads | LLC {bw.llc_bytes() >> 20} MiB | ISAs {kernels.available_isas()} | int8 "
          f"kernels on avx512: {'the vnni form' if kernels.qdot8_has_vnni() else 'no vnni'} | "
          f"python {platform.python_version()}", flush=True)
    cols = " ".join(f"{f'b={b} GB/s':>10} {'xS':>5}" for b in batches)
    if args.cpu_time:
        cols += " " + " ".join(f"{f'b={b} GB/cpu-s':>13}" for b in batches)
    qdots = args.qdot.split(",")
    tunings = [t.strip() for t in args.tunings.split(";") if t.strip()] or ["default"]
    for t in tunings:
        kernels.KernelTuning.parse(t)  # a bad one fails here, before any bank is built
    base_tuning = pool.tuning
    hdr = (f"{'shape':<14} {'D x I':>10} {'type':>8} {'qdot':>4} {'tuning':>20} {'isa':>10} {'MB/expert':>9} {'STREAM':>7} "
           f"{cols} {'experts/s x bf16 (b=1)':>22} {'rel err':>8}")
    rows = [hdr, "-" * len(hdr)]
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        base = {}
        for quant in ("bf16", *(t for t in args.types.split(",") if t != "bf16")):
            if quant not in TYPES:
                sys.exit(f"--types: unknown type {quant!r}; choose from {', '.join(TYPES[1:])}")
            t0 = time.perf_counter()
            layout, bank = make_bank(shape, quant)
            E = bank.nbytes // layout.slot_stride
            print(f"# {shape.name} {quant}: {E} experts x {layout.slot_stride / 1e6:.2f} MB = "
                  f"{bank.nbytes / 1e9:.2f} GB (built in {time.perf_counter() - t0:.1f} s)", flush=True)
            paths = [q for q in qdots if quant in INT8_QUANTS or q == "fp32"] if quant != "bf16" else ["-"]
            for isa in isas:
                for qdot, tuning in ((q, t) for q in paths or ["fp32"]
                                     for t in (tunings if quant != "bf16" else tunings[:1])):
                    pool.tuning = replace(kernels.KernelTuning.parse(tuning, base_tuning),
                                          qdot="fp32" if qdot == "-" else qdot)
                    if args.cpu_time:
                        pool.tuning = replace(pool.tuning, help=0)
                    err = check(pool, bank, layout, isa, qdot)
                    pool.isa = isa
                    cells, rate1 = [], None
                    for batch in batches:
                        stream, kgb = interleaved(pool, bank, layout, batch, shape.top_k, args.seconds)
                        cells.append(f"{kgb:>10.2f} {kgb / stream:>5.2f}")
                        rate1 = rate1 or kgb * 1e9 / layout.expert_nbytes
                    if args.cpu_time:
                        cells += [f"{cpu_rate(pool, bank, layout, b, shape.top_k, args.seconds / 2):>13.2f}"
                                  for b in batches]
                    base.setdefault(isa, rate1)
                    rows.append(f"{shape.name:<14} {f'{shape.hidden}x{shape.expert_hidden}':>10} {quant:>8} "
                                f"{qdot:>4} {tuning:>20} {pool.last_isa:>10} {layout.expert_nbytes / 1e6:>9.3f} {stream:>7.2f} "
                                f"{' '.join(cells)} {rate1 / base[isa]:>22.2f} {err:>8.1e}")
                    print(rows[-1], flush=True)
            del bank
    print("\n".join(["", "# GB/s: expert bytes read (quantized: blocks and scales); xS: x STREAM "
                     "read (the last batch's)", *rows]))


if __name__ == "__main__":
    main()
