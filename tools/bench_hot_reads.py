"""Bench PCIe reads of host experts the CPU has just read (cuda only): what an admission costs,
and what it costs the CPU job beside it, by where its expert is in the host's caches.

A decode step's CPU job reads one expert (batch 1, the engine's pool and GPU tuning); an
admission then copies a CPU-run expert into the device cache, over PCIe, either as the
engine's background gather (zero_copy.gather with 8 looping programs, captured/control.py) or as a
copy-engine copy (torch's copy_ from the pinned bank). Each row times one of these against
the CPU jobs, by which experts the background reads:

  none       no background read: the job alone
  cold       two experts no job read lately
  same       the job's own expert and the previous job's, started with the job (an admission
             started with its layer's plan)
  prev       the previous two jobs' experts (an admission started after its CPU job)
  after job  (no job running) one expert right after a job read it (hot) or another (cold)

Columns: the CPU job's median and mean µs, the background's µs (two experts beside a job, one
after it), medians over --jobs jobs, --rounds interleaved rounds. One table.

    python tools/bench_hot_reads.py
    python tools/bench_hot_reads.py --jobs 300 --rounds 3

Measured on the H200 host (docs/MEASUREMENTS.md#hot-expert-reads).
"""
import argparse
import sys
import time
from statistics import median

import numpy as np
import torch

GB = 1e9
PROGRAMS = 8  # the admissions' looping programs (experts/captured/admissions.py ADMIT_PROGRAMS)


class Bench:
    def __init__(self, bank_gb: float, seed: int = 0):
        from freetoken import bandwidth as bw, kernels
        from freetoken.experts.transfer import zero_copy
        from freetoken.experts.executor import GPU_SPIN_US, use_gpu_run_tuning
        self.zc = zero_copy
        self.layout = bw.synthetic_layout(bw.ExpertShape())
        S = self.S = self.layout.slot_stride
        N = self.N = max(16, int(bank_gb * GB) // S)
        self.host = torch.empty(N * S, dtype=torch.uint8, pin_memory=True)
        self.bank = self.host.numpy()
        B = min(64, N)
        block = bw.synthetic_bank(self.layout, B)  # bf16-safe values, no two pages alike
        for i in range(0, N, B):
            k = min(B, N - i)
            self.bank[i * S:(i + k) * S] = block[:k * S]
        self.words = zero_copy.host_words(self.host, N, S)
        self.store = torch.empty((2, S // 4), dtype=torch.int32, device="cuda")
        self.idx = [torch.tensor([e], device="cuda") for e in range(N)]
        self.dst = [torch.tensor([s], device="cuda") for s in range(2)]
        self.side = torch.cuda.Stream()
        self.rng = np.random.default_rng(seed)
        self.pool = kernels.get_pool(kernels.default_num_threads(True), spin_us=GPU_SPIN_US)
        use_gpu_run_tuning(self.pool)
        x = self.rng.standard_normal((1, self.layout.D)).astype(np.float32)
        x.view(np.uint32)[:] &= 0xFFFF0000  # bf16-exact, as the engine hands it over
        self.x, self.out = x, np.zeros_like(x)
        self.tok, self.w = np.zeros(1, dtype=np.int32), np.ones(1, dtype=np.float32)

    def expert(self) -> int:
        return int(self.rng.integers(self.N))

    def job(self, e: int) -> float:
        """One CPU job on expert e: µs."""
        t0 = time.perf_counter()
        self.pool.run(self.x, self.bank, self.layout, self.tok, np.array([e], dtype=np.int32),
                      self.w, self.out)
        return (time.perf_counter() - t0) * 1e6

    def background(self, experts: list, copy: bool):
        """Read `experts` into the device on the side stream: (start, end) events."""
        with torch.cuda.stream(self.side):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for slot, e in enumerate(experts):
                if copy:
                    self.store[slot].view(torch.uint8).copy_(
                        self.host[e * self.S:(e + 1) * self.S], non_blocking=True)
                else:
                    self.zc.gather(self.words, self.store, self.idx[e], self.dst[slot], self.S,
                                   programs=PROGRAMS)
            b.record()
        return a, b

    def beside(self, which: str, copy: bool, jobs: int) -> tuple:
        """(job µs list, background µs list) over `jobs` jobs (which: none, cold, same, prev)."""
        times, bgs = [], []
        prev = [self.expert(), self.expert()]
        for _ in range(jobs):
            e = self.expert()
            if which == "cold":
                reads = [self.expert(), self.expert()]
            else:
                reads = {"none": None, "same": [e, prev[0]], "prev": prev}[which]
            ev = self.background(reads, copy) if reads else None
            time.sleep(20e-6)  # the background under way before the job starts
            times.append(self.job(e))
            if ev:
                ev[1].synchronize()
                bgs.append(ev[0].elapsed_time(ev[1]) * 1e3)
            prev = [e, prev[0]]
        return times, bgs

    def after(self, hot: bool, copy: bool, jobs: int) -> list:
        """µs of one background read right after a job read that expert (hot) or another."""
        out = []
        for _ in range(jobs):
            e = self.expert()
            self.job(e)
            ev = self.background([e if hot else self.expert()], copy)
            ev[1].synchronize()
            out.append(ev[0].elapsed_time(ev[1]) * 1e3)
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bank-gb", type=float, default=6.0,
                    help="pinned host bank the experts come from")
    ap.add_argument("--jobs", type=int, default=150, help="jobs (or reads) per row and round")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    a = ap.parse_args(argv)
    from freetoken.experts.transfer import zero_copy
    if not torch.cuda.is_available() or not zero_copy.available():
        print("bench_hot_reads needs cuda and Triton (the gather is a GPU kernel)", file=sys.stderr)
        return 2
    b = Bench(a.bank_gb)
    skip = min(10, a.jobs // 5)  # warm-up jobs of each row
    rows = [("none", False)] + [(w, c) for c in (False, True) for w in ("cold", "same", "prev")]
    after = [(hot, c) for c in (False, True) for hot in (False, True)]
    res = {}
    for _ in range(a.rounds):
        for which, copy in rows:
            t, g = b.beside(which, copy, a.jobs)
            r = res.setdefault((which, copy), ([], []))
            r[0].extend(t[skip:])
            r[1].extend(g[skip:])
        for hot, copy in after:
            res.setdefault((hot, copy), []).extend(b.after(hot, copy, a.jobs)[skip:])
    print(f"# bench_hot_reads | {torch.cuda.get_device_name()} | pool {b.pool.num_threads} threads "
          f"({b.pool.tuning}) | expert {b.S / 1e6:.2f} MB, {b.N} in a pinned bank | "
          f"{a.rounds} rounds x {a.jobs} jobs")
    hdr = (f"{'background':<22} {'reads':<16} {'job p50 us':>10} {'job mean':>9} "
           f"{'background us':>13}")
    print(hdr + "\n" + "-" * len(hdr))
    for which, copy in rows:
        t, g = res[(which, copy)]
        how = "-" if which == "none" else "copy engine" if copy else f"gather, {PROGRAMS} programs"
        bg = f"{median(g):>13.0f}" if g else f"{'-':>13}"
        print(f"{how:<22} {which:<16} {median(t):>10.1f} {np.mean(t):>9.1f} {bg}")
    for hot, copy in after:
        how = "copy engine" if copy else f"gather, {PROGRAMS} programs"
        print(f"{how:<22} {'after job, hot' if hot else 'after job, cold':<16} {'-':>10} {'-':>9} "
              f"{median(res[(hot, copy)]):>13.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
