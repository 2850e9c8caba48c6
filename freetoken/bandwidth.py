"""Bandwidth measurements behind `freetoken profile` (profile.py) and the benches in tools/:
the CPU expert kernel over a working set larger than the last-level cache, a STREAM-like read
by the same pool, pinned host-to-device copies, the zero-copy gather fills, and a fill path
beside the kernel at the same time. Synthetic expert banks of a given shape to measure on.
All GB/s are 1e9 bytes per second of unique bytes moved.
"""
import re
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .errors import ConfigError

MIN_WORKING_SET = 512 << 20  # bytes of experts cycled through, at least 4x the LLC too
MEASURE_SECONDS = 1.0        # per measurement
# A concurrent measurement is cut into this many windows, after a discarded warm-up window of the
# same length, and keeps each path's median window: one short mean was fragile (thread wake-up,
# clock ramp, a noisy neighbour: one short calibration on the H200 host read C at 40% of normal)
CONCURRENT_WINDOWS = 5

_clock = time.perf_counter  # the measurements' clock (tests replace it)


@dataclass(frozen=True)
class ExpertShape:
    """What the kernel and the copies are measured on. num_experts sizes the 'whole layer' copy.
    quant: "none" (elements of dtype) or the experts' quant type (kernel_args.KERNEL_QUANTS;
    dtype then the model's compute dtype)."""
    hidden: int = 2048
    expert_hidden: int = 768
    top_k: int = 8
    dtype: str = "bf16"
    num_experts: int = 128
    name: str = "Qwen3-30B-A3B"
    quant: str = "none"

    def key(self) -> str:
        """"DxI-dtype", and "-quant" after it for quantized experts (unquantized keys are those
        of the profiles stored before quant types: "2048x768-bf16")."""
        key = f"{self.hidden}x{self.expert_hidden}-{self.dtype}"
        return key if self.quant == "none" else f"{key}-{self.quant}"


def _round_up(n, m):
    return (n + m - 1) // m * m


def synthetic_layout(shape: ExpertShape):
    """The INTERFACES section 3 slot layout for `shape` (what ftw/convert writes; a quantized
    shape's: convert --quant's, ftw/SPEC.md section 9.2)."""
    from .kernels import DTYPE_SIZES, ExpertLayout
    if shape.quant != "none":
        from .kernel_args import layout_from_bank_info
        from .quant_banks import plain_info, quant_info
        info = quant_info(plain_info(shape.hidden, shape.expert_hidden, 1), shape.quant)
        return replace(layout_from_bank_info(info), dtype=shape.dtype)
    nbytes = shape.hidden * shape.expert_hidden * DTYPE_SIZES[shape.dtype]
    og, ou = 0, _round_up(nbytes, 64)
    od = ou + _round_up(nbytes, 64)
    return ExpertLayout(_round_up(od + nbytes, 4096), shape.dtype, shape.hidden, shape.expert_hidden, og, ou, od)


def synthetic_bank(layout, num_experts: int, seed: int = 0) -> np.ndarray:
    """num_experts slots of small random weights, page-aligned, no two pages alike. A quantized
    layout's: quant_banks.synthetic_quant_bank (convert --quant's bytes for such weights).

    A 2 MiB block of normal values is tiled, each copy XOR-ed with a differently shifted random
    pattern in the low 3 bits of every 16-bit word (mantissa bits in bf16, fp16 and fp32: no
    NaN, inf or denormal appears). Identical pages would be merged by KSM-style deduplication
    on virtual machines and then read from cache, inflating the bandwidth measured.
    """
    if layout.quant != "none":
        from .quant_banks import synthetic_quant_bank
        return synthetic_quant_bank(layout, num_experts, lambda lay, n: synthetic_bank(lay, n, seed),
                                    seed)
    import torch
    from .experts.bank import TORCH_DTYPES
    n = 1 << 20  # 16-bit words per block
    block = (torch.randn(n // 2 if layout.dtype == "fp32" else n,
                         generator=torch.Generator().manual_seed(seed)) * 0.02)
    block = block.to(TORCH_DTYPES[layout.dtype]).view(torch.int16).numpy().view(np.uint16)
    noise = np.random.default_rng(seed).integers(0, 8, 2 * n, dtype=np.uint16)
    total = num_experts * layout.slot_stride
    raw = np.empty(total + 4096, np.uint8)
    start = (-raw.ctypes.data) % 4096
    bank = raw[start:start + total]
    words = bank[: total // 2 * 2].view(np.uint16)
    for c, off in enumerate(range(0, words.size, n)):
        m = min(n, words.size - off)
        shift = (c * 2731) % n
        np.bitwise_xor(block[:m], noise[shift:shift + m], out=words[off:off + m])
    return bank


def llc_bytes() -> int:
    """Size of the largest CPU cache (sysfs), 32 MiB when unknown."""
    best = 0
    for p in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        m = re.fullmatch(r"(\d+)([KMG]?)", p.read_text().strip())
        if m:
            best = max(best, int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)])
    return best or 32 << 20


def working_set_experts(layout, top_k: int, min_bytes: int = None) -> int:
    """Experts to cycle through: >= max(min_bytes, 4 x LLC) bytes, a multiple of top_k."""
    want = max(min_bytes or MIN_WORKING_SET, 4 * llc_bytes())
    n = max(2 * top_k, -(-want // layout.slot_stride))
    return _round_up(n, top_k)


def route_sets(num_experts: int, batch: int, top_k: int, num_calls: int, seed: int = 0):
    """Routes of num_calls calls: batch 1 walks the bank top_k experts at a time; larger batches
    draw top_k distinct experts per token. Yields (token_ids, expert_ids, weights, unique)."""
    rng = np.random.default_rng(seed)
    sets = []
    for c in range(num_calls):
        if batch == 1:
            exp = (np.arange(top_k) + c * top_k) % num_experts
        else:
            exp = np.concatenate([rng.choice(num_experts, top_k, replace=False) for _ in range(batch)])
        tok = np.repeat(np.arange(batch), top_k)
        w = rng.random(batch * top_k, dtype=np.float32)
        sets.append((tok.astype(np.int32), exp.astype(np.int32), w, len(np.unique(exp))))
    return sets


def time_kernel(pool, bank, layout, batch, top_k, seconds=None, stop=None):
    """GB/s of unique expert bytes the kernel reads at `batch` (best pass over the bank, or the
    mean while `stop` is unset when stop is given)."""
    num_experts = bank.nbytes // layout.slot_stride
    calls = route_sets(num_experts, batch, top_k, max(1, num_experts // top_k))
    x = np.random.default_rng(1).standard_normal((batch, layout.D)).astype(np.float32)
    x.view(np.uint32)[:] &= 0xFFFF0000  # bf16-exact, as a bf16 compute dtype hands it over
    out = np.zeros_like(x)
    return _timed_passes(lambda: [pool.run(x, bank, layout, t, e, w, out) for t, e, w, _ in calls],
                         sum(u for *_, u in calls) * layout.expert_nbytes, seconds, stop)


def time_route_flops(pool, bank, layout, tokens=32, seconds=None):
    """GFLOP/s of the kernel's arithmetic per route when an expert has many tokens (a prefill
    chunk's CPU experts; experts/prefill/choice.py's F): jobs of 8 experts x 1 token and x
    `tokens` tokens, best pass each; (t_many - t_one) / (8 (tokens - 1)) is one route's time,
    its arithmetic 2 x 3 x D x I flops (gate, up, down)."""
    n_exp = min(8, bank.nbytes // layout.slot_stride)
    rng = np.random.default_rng(2)
    best = {}
    for n in (1, tokens):
        x = rng.standard_normal((n, layout.D)).astype(np.float32)
        x.view(np.uint32)[:] &= 0xFFFF0000  # bf16-exact, as the engine hands it over
        tok = np.tile(np.arange(n, dtype=np.int32), n_exp)
        exp = np.repeat(np.arange(n_exp, dtype=np.int32), n)
        w = np.full(n * n_exp, 0.5, dtype=np.float32)
        out = np.zeros_like(x)
        # _timed_passes of "1 byte" per pass: its best rate is 1e-9 / the best pass's seconds
        best[n] = 1e-9 / _timed_passes(lambda: pool.run(x, bank, layout, tok, exp, w, out), 1,
                                       seconds)
    route_s = max(best[tokens] - best[1], 1e-9) / (n_exp * (tokens - 1))
    return 6 * layout.D * layout.I / route_s / 1e9


def time_stream_read(pool, buf, seconds=None):
    """STREAM-like read GB/s of the pool's threads over `buf` (best pass)."""
    return _timed_passes(lambda: pool.read_sum(buf), buf.nbytes, seconds)


def _timed_passes(fn, nbytes, seconds=None, stop=None, log=None):
    """GB/s of fn() moving `nbytes` a call: the best call over `seconds`, or the mean until `stop`
    is set when stop is given; after one discarded warm-up call. log: a list that receives
    (start time, 0) and then (end time, nbytes) of each timed call (window_rates reads it)."""
    fn()  # warm-up: page faults, pool wake-up
    seconds = MEASURE_SECONDS if seconds is None else seconds
    best, total, t_start = 0.0, 0, _clock()
    if log is not None:
        log.append((t_start, 0))
    while True:
        t0 = _clock()
        fn()
        t1 = _clock()
        if log is not None:
            log.append((t1, nbytes))
        best, total = max(best, nbytes / (t1 - t0)), total + nbytes
        if (stop.is_set() if stop is not None else t1 - t_start >= seconds):
            break
    return (total / (t1 - t_start) if stop is not None else best) / 1e9


# ---- host-to-device copies ---------------------------------------------------------------------

def time_h2d(nbytes: int, seconds=None, stop=None, device="cuda", started=None, log=None):
    """GB/s of pinned host-to-device copies of `nbytes` (best copy, or the mean until `stop`);
    sets the `started` event once the buffers exist and a first copy is done. The copying thread
    sleeps on a blocking event instead of spinning in a stream sync: a spinning copier takes a
    core from the kernel's pool when both run (as the engine's copies are waited on by nobody).
    log: as _timed_passes's."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    done = torch.cuda.Event(blocking=COPY_SYNC_BLOCKING)

    def once():
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            done.record(stream)
        done.synchronize()
        if started is not None:
            started.set()
    return _timed_passes(once, nbytes, seconds, stop, log)


def time_gather(nbytes: int, slot_bytes: int, seconds=None, stop=None, device="cuda", started=None,
                per_call: int = 8, log=None):
    """GB/s of zero-copy fills (experts/transfer/zero_copy.py): the gather kernel copying `per_call`
    distinct experts of a pinned host layer of `nbytes` into device slots per launch (a decode
    layer step's few fills; different experts each launch), like time_h2d otherwise."""
    import torch
    from .experts.transfer import zero_copy
    E = max(per_call, nbytes // slot_bytes)
    host = torch.empty(E * slot_bytes, dtype=torch.uint8, pin_memory=True)
    words = zero_copy.host_words(host, E, slot_bytes)
    storage = torch.empty((per_call, slot_bytes // 4), dtype=torch.int32, device=device)
    dst = torch.arange(per_call, device=device)
    srcs = [(torch.arange(per_call, device=device) + i * per_call) % E for i in range(max(1, E // per_call))]
    done, turn = torch.cuda.Event(blocking=COPY_SYNC_BLOCKING), [0]

    def once():
        zero_copy.gather(words, storage, srcs[turn[0] % len(srcs)], dst, slot_bytes)
        turn[0] += 1
        done.record()
        done.synchronize()
        if started is not None:
            started.set()
    return _timed_passes(once, per_call * slot_bytes, seconds, stop, log)


# The copy loop waits on a blocking (sleeping) event; tools/bench_cpu_experts.py --copy-sync spin
# turns this off to show what a spinning copier costs the kernel.
COPY_SYNC_BLOCKING = True


def concurrent_bandwidths(pool, bank, layout, top_k, copy_bytes, seconds, host_work=None,
                          fills="copy", windows=CONCURRENT_WINDOWS, per_window=None):
    """(P, C) GB/s with the copy loop in a thread and the kernel in the pool, at the same time:
    each the median over `windows` windows of seconds / windows, measured after a warm-up window
    of the same length that is discarded (window_rates). host_work: another () -> bytes read to
    time beside the copies instead of the kernel at batch 1 (e.g. the pool's STREAM read).
    fills: "copy" (pinned copies on a stream) or "zero_copy" (the gather kernel, time_gather).
    per_window: a list that receives each kept window's (P, C)."""
    stop, started, result, copies = threading.Event(), threading.Event(), {}, []
    def copy_loop():
        try:
            if fills == "zero_copy":
                result["P"] = time_gather(copy_bytes, layout.slot_stride, stop=stop, started=started,
                                          log=copies)
            else:
                result["P"] = time_h2d(copy_bytes, stop=stop, started=started, log=copies)
        finally:
            started.set()  # also when the copies failed: the kernel loop must not wait forever

    if host_work is None:
        calls = route_sets(bank.nbytes // layout.slot_stride, 1, top_k,
                           max(1, bank.nbytes // layout.slot_stride // top_k))
        x = np.random.default_rng(1).standard_normal((1, layout.D)).astype(np.float32)
        x.view(np.uint32)[:] &= 0xFFFF0000  # bf16-exact, as in time_kernel
        out = np.zeros_like(x)

        def host_work():
            n = 0
            for t, e, w, u in calls:
                pool.run(x, bank, layout, t, e, w, out)
                n += u * layout.expert_nbytes
            return n
    copier = threading.Thread(target=copy_loop)
    copier.start()
    started.wait()  # pinned buffers allocated and copying before the kernel starts
    try:
        spans = host_windows(host_work, seconds / windows, windows + 1)
    finally:
        stop.set()  # also when the kernel failed: the copy loop must end
        copier.join()
    if "P" not in result:
        raise ConfigError("the pinned host-to-device copy loop failed (see the message above); "
                          "is there enough free pinned memory and GPU memory for one layer?")
    return window_rates(spans[1:], copies, per_window)


def host_windows(work, window_s, num_windows):
    """[(t_start, t_end, bytes)] of num_windows back-to-back windows of work() calls (each returns
    the bytes it read), a window closing at the first call ending window_s or more after it began."""
    spans, t0 = [], _clock()
    for _ in range(num_windows):
        nbytes = 0
        while True:
            nbytes += work()
            t1 = _clock()
            if t1 - t0 >= window_s:
                break
        spans.append((t0, t1, nbytes))
        t0 = t1
    return spans


def window_rates(spans, copies, per_window=None):
    """(P, C) GB/s: the medians over `spans` (host_windows) of the copy loop's rate and the host's
    in the same window. copies: the copy loop's _timed_passes log; its bytes at a window's edges
    are interpolated between the completions around them (a whole-layer copy can take 40 ms of
    a 200 ms window). E.g. completions (0 s, 0), (1 s, 4e9), (2 s, 4e9) and the window 0.5-1.5 s:
    P = (6e9 - 2e9) / 1 s = 4 GB/s."""
    t = np.array([c[0] for c in copies], dtype=np.float64)
    done = np.cumsum([c[1] for c in copies], dtype=np.float64)
    rates = [((np.interp(t1, t, done) - np.interp(t0, t, done)) / (t1 - t0) / 1e9,
              n / (t1 - t0) / 1e9) for t0, t1, n in spans]
    if per_window is not None:
        per_window.extend(rates)
    return float(np.median([p for p, _ in rates])), float(np.median([c for _, c in rates]))
