"""Bench the zero-copy gather (freetoken/experts/transfer/zero_copy.py) as a background copy: how fast a
few looping programs (programs=G, the admissions' mode) gather one expert alone, and what they
cost a full gather (one program per 16 KiB block, the critical fills' mode) running beside them.
cuda only. One table.

    python tools/bench_gather.py                        # Qwen3-30B-A3B slot (9.44 MB)
    python tools/bench_gather.py --programs 2,8,32 --slot-mb 88.1

Each timing is the median of --reps launches on distinct experts of a pinned host bank (cuda
events). "beside": the background gather of G programs is launched on a low-priority stream,
then a full gather of another expert on a high-priority one; the full gather's time against its
time alone says how much of the link the background took while both ran.
"""
import argparse
import sys
from statistics import median_high

import torch

SLOT_MB = 9.437184  # one Qwen3-30B-A3B expert slot (MB, 1e6 bytes)


class Bench:
    def __init__(self, slot_bytes: int, experts: int, reps: int):
        from freetoken.experts.transfer import zero_copy
        self.zc, self.S, self.E, self.reps = zero_copy, slot_bytes, experts, reps
        host = torch.empty(experts * slot_bytes, dtype=torch.uint8).pin_memory()
        host.view(torch.int32)[::1024] = 7  # touched: no page is gathered for the first time
        self.host = host
        self.words = zero_copy.host_words(host, experts, slot_bytes)
        self.storage = torch.empty((2, slot_bytes // 4), dtype=torch.int32, device="cuda")
        self.high = torch.cuda.Stream(priority=-1)
        self.low = torch.cuda.Stream(priority=0)
        self.dst = [torch.tensor([i], device="cuda") for i in range(2)]
        self.srcs = [torch.tensor([e], device="cuda") for e in range(experts)]
        self.turn = 0

    def _next(self):
        self.turn = (self.turn + 1) % self.E
        return self.srcs[self.turn]

    def _gather(self, stream, slot, programs):
        with torch.cuda.stream(stream):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            self.zc.gather(self.words, self.storage, self._next(), self.dst[slot], self.S,
                           programs=programs)
            b.record()
        return a, b

    def alone(self, programs) -> float:
        """µs per expert, median."""
        for _ in range(3):
            self._gather(self.high, 0, programs)
        evs = [self._gather(self.high, 0, programs) for _ in range(self.reps)]
        torch.cuda.synchronize()
        return median_high([a.elapsed_time(b) * 1e3 for a, b in evs])

    def beside(self, programs) -> tuple:
        """(full gather µs, background gather µs), medians over pairs started together."""
        pairs = []
        for _ in range(self.reps):
            torch.cuda.synchronize()
            bg = self._gather(self.low, 0, programs)
            full = self._gather(self.high, 1, None)
            torch.cuda.synchronize()
            pairs.append((full[0].elapsed_time(full[1]) * 1e3, bg[0].elapsed_time(bg[1]) * 1e3))
        return median_high([p[0] for p in pairs]), median_high([p[1] for p in pairs])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", default="1,2,4,8,16,32", help="comma list of G (looping programs per fill)")
    ap.add_argument("--slot-mb", type=float, default=SLOT_MB, help="expert slot size, MB [Qwen3-30B-A3B's]")
    ap.add_argument("--bank-gb", type=float, default=1.5, help="pinned host bank the experts come from")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args(argv)
    from freetoken.experts.transfer import zero_copy
    if not torch.cuda.is_available() or not zero_copy.available():
        print("bench_gather needs cuda and Triton (the zero-copy gather is a GPU kernel)", file=sys.stderr)
        return 2
    S = int(a.slot_mb * 1e6) // 4096 * 4096
    E = max(4, int(a.bank_gb * 1e9) // S)
    b = Bench(S, E, a.reps)
    full = b.alone(None)
    print(f"# {torch.cuda.get_device_name()} | slot {S / 1e6:.2f} MB, {E} experts pinned | "
          f"full gather alone {full:.0f} µs = {S / full / 1e3:.1f} GB/s | medians of {a.reps}")
    hdr = f"{'G':>4} {'alone us':>9} {'alone GB/s':>10} {'full beside us':>14} {'x alone':>7} {'background us':>13}"
    print(hdr + "\n" + "-" * len(hdr))
    for G in [int(g) for g in a.programs.split(",")]:
        us = b.alone(G)
        f, bg = b.beside(G)
        print(f"{G:>4} {us:>9.0f} {S / us / 1e3:>10.1f} {f:>14.0f} {f / full:>7.2f} {bg:>13.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
