"""Decode-shaped CPU expert jobs: what the kernel pool reads per job when, as in a decode step,
each MoE layer hands it one job of a few experts picked at random out of a large bank, with the
GPU's part of the layer (a gap) between jobs. Against the steady state `freetoken profile`
measures (back-to-back calls walking a bank a little larger than the last-level cache).

One table, one run: rows = bank size x huge pages x experts per job x gap; columns = µs per job
(mean, median, 90th percentile), the median µs the submit() call itself took (the driver
thread's cost before it can go on), GB/s of expert bytes per job, and that over the profile's
steady state.

    python tools/bench_cpu_jobs.py                          # 2 GB and 16 GB banks
    python tools/bench_cpu_jobs.py --bank-gb 2,48 --threads 15 --jobs 400
    python tools/bench_cpu_jobs.py --trace --bank-gb 16 --experts 1,2,4,8 --gpu-tuning
    python tools/bench_cpu_jobs.py --bank-gb 56 --huge yes --tunings "default;prefetch=8192"

--tunings runs every row under each FREETOKEN_KERNEL_TUNE-style tuning (semicolon list) over the
pool's own, on the same bank: one bank fill serves the whole sweep.

--trace prints instead where a job's time goes, from the kernel's own per-item timeline
(kernels.CpuExpertPool.set_trace; medians over the jobs): the ideal (the job's bytes at the
steady state's best GB/s), the wake-up (submit to a thread's first item: median thread, last
thread), per-thread GB/s inside gate/up (G) and down (D) items, the time a thread spends waiting
for an expert's G items before its D item can start, how far apart the threads finish, the
signal (last item's end to wait() returning) and the busy share (item time over threads x job).

--gap-wait spin idles the driver between jobs on the pause instruction, as the decode server
waits for a layer. Measured on the H200 host (--gpu-tuning --threads 15 --bank-gb 16 --experts
1,2 --gaps-us 100, one run each): mean µs per job sleep/spin 113.3/93.8 (1 expert) and
188.9/166.9 (2), with huge pages 98.7/96.4 and 160.9/169.3: jobs after a pausing wait are no
slower, so pause-loop exits do not explain the serve's longer job ends (cython/serve_impl.c).
"""
import argparse
import mmap
import os
import platform
import sys
import threading
import time

import numpy as np

from bench_host_banks import huge_bytes, hugetlb_map
from freetoken import bandwidth as bw
from freetoken import kernels

GB = 1e9


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bank-gb", default="2,16", help="bank sizes in GB (comma list)")
    ap.add_argument("--experts", default="2,4,6,8", help="experts per job (comma list)")
    ap.add_argument("--gaps-us", default="0,300", help="idle µs between jobs (comma list)")
    ap.add_argument("--jobs", type=int, default=300, help="jobs per row")
    ap.add_argument("--threads", type=int, default=None, help="pool threads (default: the engine's)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--seconds", type=float, default=1.0, help="per steady-state measurement")
    ap.add_argument("--steady-gb", type=float, default=None,
                    help="the steady state's bank (default: the profile's working set)")
    ap.add_argument("--gpu-tuning", action="store_true",
                    help="the pool as the engine's GPU runs have it (help=0: the driver thread "
                         "waits; workers spin 2 ms after a job before parking)")
    ap.add_argument("--trace", action="store_true",
                    help="where a job's time goes, from the kernel's per-item timeline (see above)")
    ap.add_argument("--gap-wait", choices=("sleep", "spin"), default="sleep",
                    help="how the driver idles between jobs: sleep, or spin on the pause "
                         "instruction as the decode server waits for a layer (a virtual machine "
                         "may stop a vCPU that pauses in a loop: compare the two)")
    ap.add_argument("--huge", default="both",
                    help="page kinds of the banks, comma list of no (4 KiB pages), yes (transparent "
                         "huge pages, MADV_HUGEPAGE) and 1g (1 GiB hugetlb pages, reserved first: "
                         "/sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages); both = no,yes")
    ap.add_argument("--tunings", default="default",
                    help="kernel tunings to run each row under, 'key=value,...' over the pool's "
                         "own, separated by ';' (default: the pool's alone)")
    ap.add_argument("--spin-us", type=int, default=None,
                    help="µs the workers spin after a job before parking (default: the engine's)")
    return ap.parse_args(argv)


def thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def make_bank(nbytes: int, huge):
    """An anonymous mapping of nbytes (MADV_HUGEPAGE when `huge` is True or "yes"; 1 GiB hugetlb
    pages when it is "1g"), filled with bf16-sized noise that keeps every value finite. Returns
    (mmap, uint8 view, huge bytes it got)."""
    if huge == "1g":
        m = hugetlb_map(nbytes)
        a = np.frombuffer(m, dtype=np.uint8)[:nbytes]
        _noise(a)
        return m, a, len(m)
    huge = huge in (True, "yes")
    before = huge_bytes()
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    a = np.frombuffer(m, dtype=np.uint8)
    _noise(a)
    return m, a, huge_bytes() - before


def _noise(a):
    words = a.view(np.uint16)
    rng = np.random.default_rng(0)
    block = (rng.integers(0x3000, 0x3C00, size=1 << 20, dtype=np.uint16)
             | (rng.integers(0, 2, size=1 << 20, dtype=np.uint16) << 15))
    for i in range(0, len(words), len(block)):
        n = min(len(block), len(words) - i)
        words[i:i + n] = block[:n]


def wait_us(us: float, how: str = "sleep"):
    """Idle between jobs: sleep (the default), or spin on the pause instruction in native code
    as the decode server does while it waits for a layer's ready (--gap-wait spin)."""
    if us > 0 and how == "spin":
        kernels.spin_pause_us(us)
    elif us > 0:
        time.sleep(us / 1e6)


WARMUP_JOBS = 5


def job_inputs(bank, layout, k, jobs, seed=0):
    """(x, out, token_ids, weights, expert id sets) of WARMUP_JOBS + jobs jobs of k distinct
    random experts at batch 1."""
    num = bank.nbytes // layout.slot_stride
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, layout.D)).astype(np.float32)
    x.view(np.uint32)[:] &= 0xFFFF0000  # bf16-exact, as the engine hands it over
    w = rng.random(k, dtype=np.float32)
    sets = [rng.choice(num, k, replace=False).astype(np.int32) for _ in range(jobs + WARMUP_JOBS)]
    return x, np.zeros_like(x), np.zeros(k, dtype=np.int32), w, sets


def run_jobs(pool, bank, layout, k, gap_us, jobs, seed=0, gap_wait="sleep", clock=time.perf_counter):
    """(µs per job [jobs], µs in submit() [jobs]) for jobs of k distinct random experts at
    batch 1, timed by clock() (seconds)."""
    x, out, tok, w, sets = job_inputs(bank, layout, k, jobs, seed)
    times, submits = [], []
    for i, e in enumerate(sets):
        wait_us(gap_us, gap_wait)
        t0 = clock()
        h = pool.submit(x, bank, layout, tok, e, w, out)
        t1 = clock()
        h.wait()
        if i >= WARMUP_JOBS:
            times.append((clock() - t0) * 1e6)
            submits.append((t1 - t0) * 1e6)
    return np.array(times), np.array(submits)


def job_breakdown(trace: dict, threads: int) -> dict:
    """One traced job's figures in µs (and GB/s): see the module docstring's --trace."""
    r = trace["records"]
    sub, done, n_g = trace["submit_ns"], trace["done_ns"], trace["g_items"]
    is_g = r["item"] < n_g
    first = {t: r["claim_ns"][r["tid"] == t].min() for t in np.unique(r["tid"])}
    last = np.array([r["end_ns"][r["tid"] == t].max() for t in first])
    wake = np.array([v - sub for v in first.values()]) / 1e3
    busy = (r["end_ns"] - r["ready_ns"]) / 1e3
    gbs = lambda m, nbytes: m.sum() * nbytes / max(busy[m].sum(), 1e-9) / 1e3
    return {"job": (done - sub) / 1e3, "wake_p50": np.median(wake), "wake_max": wake.max(),
            "g_gbs": gbs(is_g, trace["g_item_bytes"]), "d_gbs": gbs(~is_g, trace["d_item_bytes"]),
            "dep_wait": ((r["ready_ns"] - r["claim_ns"]) / 1e3).sum() / threads,
            "spread": (last.max() - last.min()) / 1e3, "signal": (done - last.max()) / 1e3,
            "busy": busy.sum() / (threads * (done - sub) / 1e3)}


def trace_jobs(pool, bank, layout, k, gap_us, jobs, seed=0, gap_wait="sleep"):
    """Medians of job_breakdown over `jobs` traced jobs of k random distinct experts (batch 1)."""
    x, out, tok, w, sets = job_inputs(bank, layout, k, jobs, seed)
    threads = pool.num_threads + (1 if pool.tuning.helps(pool.num_threads) else 0)
    pool.set_trace(1 << 16)
    traces = []
    try:  # nothing but the jobs between jobs (as run_jobs): the breakdowns come after
        for i, e in enumerate(sets):
            wait_us(gap_us, gap_wait)
            pool.run(x, bank, layout, tok, e, w, out)
            if i >= WARMUP_JOBS:
                traces.append(pool.last_trace())
    finally:
        pool.set_trace(0)
    rows = [job_breakdown(t, threads) for t in traces]
    return {key: float(np.median([r[key] for r in rows])) for key in rows[0]}


def trace_table(pool, a, layout, steady_best):
    """--trace: one row per bank x experts per job x gap (module docstring)."""
    hdr = (f"{'bank GB':>7} {'k':>3} {'gap us':>6} {'job us':>7} {'ideal':>6} {'wake p50':>8} "
           f"{'wake max':>8} {'G GB/s/thr':>10} {'D GB/s/thr':>10} {'D wait us':>9} {'spread us':>9} "
           f"{'signal us':>9} {'busy':>5}")
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for gb in [float(g) for g in a.bank_gb.split(",")]:
        n = int(gb * GB) // layout.slot_stride * layout.slot_stride
        m, bank, _ = make_bank(n, True)
        for k in [int(v) for v in a.experts.split(",")]:
            for gap in [float(v) for v in a.gaps_us.split(",")]:
                b = trace_jobs(pool, bank, layout, k, gap, a.jobs, gap_wait=a.gap_wait)
                ideal = k * layout.expert_nbytes / steady_best / 1e3
                print(f"{gb:>7.1f} {k:>3} {gap:>6.0f} {b['job']:>7.1f} {ideal:>6.1f} {b['wake_p50']:>8.1f} "
                      f"{b['wake_max']:>8.1f} {b['g_gbs']:>10.2f} {b['d_gbs']:>10.2f} {b['dep_wait']:>9.1f} "
                      f"{b['spread']:>9.1f} {b['signal']:>9.1f} {b['busy']:>5.2f}", flush=True)
        del bank
        m.close()


def main(argv=None, clock=time.perf_counter):
    """The bench; clock() (seconds) times the jobs of the main table (tests pass their own)."""
    a = parse_args(argv)
    from freetoken.experts.executor import GPU_SPIN_US, use_gpu_run_tuning
    spin = a.spin_us if a.spin_us is not None else (GPU_SPIN_US if a.gpu_tuning else kernels.DEFAULT_SPIN_US)
    pool = kernels.get_pool(a.threads or kernels.default_num_threads(a.gpu_tuning), spin_us=spin)
    if a.gpu_tuning:
        use_gpu_run_tuning(pool)
    shape = bw.ExpertShape(a.hidden, a.inter, 8, "bf16", 1, f"{a.hidden}x{a.inter}")
    layout = bw.synthetic_layout(shape)
    eb = layout.expert_nbytes
    print(f"# bench_cpu_jobs | {platform.processor() or platform.machine()} | {os.cpu_count()} CPUs | "
          f"pool {pool.num_threads} threads, {pool.isa}, spin {spin} us | THP: {thp_mode()} | python {sys.version.split()[0]}")
    print(f"# expert {a.hidden}x{a.inter} bf16, {eb / 1e6:.2f} MB; jobs of k random distinct experts at "
          f"batch 1, {a.jobs} per row after {WARMUP_JOBS} warm-up; gap = idle µs before each job "
          f"({a.gap_wait})")
    ws = bw.MIN_WORKING_SET if a.steady_gb is None else int(a.steady_gb * GB)
    ref_bank = bw.synthetic_bank(layout, bw.working_set_experts(layout, 8, ws))
    steady_best = bw.time_kernel(pool, ref_bank, layout, 1, 8, seconds=a.seconds)
    ev = threading.Event()
    threading.Timer(a.seconds, ev.set).start()
    steady_mean = bw.time_kernel(pool, ref_bank, layout, 1, 8, stop=ev)
    stream = bw.time_stream_read(pool, ref_bank, a.seconds)
    print(f"# steady state (the profile's B_H, {ref_bank.nbytes / GB:.2f} GB walked 8 experts a call): "
          f"best pass {steady_best:.1f} GB/s, mean {steady_mean:.1f} GB/s; STREAM read {stream:.1f} GB/s")
    del ref_bank
    if a.trace:
        trace_table(pool, a, layout, steady_best)
        return
    own = pool.tuning
    tunings = [kernels.KernelTuning.parse(t, base=own) for t in a.tunings.split(";")]
    names = [t.strip() or "default" for t in a.tunings.split(";")]
    w = max(7, *(len(n) for n in names))
    hdr = (f"{'bank GB':>7} {'huge':>5} {'got GB':>6} {'tuning':<{w}} {'k':>3} {'gap us':>6} {'mean us':>8} "
           f"{'p50 us':>7} {'p90 us':>7} {'sub us':>7} {'GB/s':>6} {'x best':>6} {'x mean':>6}")
    print()
    print(hdr)
    print("-" * len(hdr))
    pages = ["no", "yes"] if a.huge == "both" else [p.strip() for p in a.huge.split(",")]
    bad = [p for p in pages if p not in ("no", "yes", "1g")]
    if bad:
        raise SystemExit(f"--huge: unknown page kind {bad[0]!r}; use no, yes, 1g or both")
    for gb in [float(g) for g in a.bank_gb.split(",")]:
        for huge in pages:
            n = int(gb * GB) // layout.slot_stride * layout.slot_stride
            m, bank, got = make_bank(n, huge)
            for k in [int(v) for v in a.experts.split(",")]:
                for gap in [float(v) for v in a.gaps_us.split(",")]:
                    for name, tuning in zip(names, tunings):
                        pool.tuning = tuning
                        t, sub = run_jobs(pool, bank, layout, k, gap, a.jobs, gap_wait=a.gap_wait,
                                            clock=clock)
                        gbs = k * eb / (t.mean() / 1e6) / GB
                        print(f"{gb:>7.1f} {huge:>5} {max(got, 0) / GB:>6.1f} "
                              f"{name:<{w}} {k:>3} {gap:>6.0f} {t.mean():>8.1f} {np.median(t):>7.1f} "
                              f"{np.percentile(t, 90):>7.1f} {np.median(sub):>7.1f} {gbs:>6.1f} "
                              f"{gbs / steady_best:>6.2f} {gbs / steady_mean:>6.2f}", flush=True)
                    pool.tuning = own
            del bank
            m.close()

if __name__ == "__main__":
    main()
