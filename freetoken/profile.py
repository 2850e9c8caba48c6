"""`freetoken profile`: measures this machine's miss-path bandwidths and stores them as a profile.

B_P  pinned host-to-device copies (one expert slot, one whole layer); CUDA only.
B_H  the real CPU expert kernel at batch 1 on the model's expert shape, over a working set
     larger than the last-level cache (GB/s = unique expert bytes read / time).
Both again while running at once (the copy loop in a Python thread, the kernel in the pool), and
a STREAM-like multi-threaded host read of the same bytes. The hybrid split uses P and C measured concurrently:
q* = m * P / (P + C); the paper's q* = m * B_P / B_H is printed beside it.
Profiles live in $XDG_CACHE_HOME/freetoken/profiles/ (default ~/.cache), keyed by GPU name, CPU
model, pool threads and expert shape/dtype. Owns no engine state: experts/policy.py asks
get_bandwidths(device_type, slot_bytes); bandwidths_for(shape, device) also says which source.
"""
import json
import os
import re
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .errors import ConfigError

# Used when no profile matches (GB/s): a PCIe 4.0 x16 link's pinned copies against a desktop
# CPU reading experts at ~50 GB/s while copies run (so q* = m/3). Same as experts/policy.py.
DEFAULT_P, DEFAULT_C = 25.0, 50.0
MIN_WORKING_SET = 512 << 20  # bytes of experts cycled through, at least 4x the LLC too
MEASURE_SECONDS = 1.0        # per measurement


@dataclass(frozen=True)
class ExpertShape:
    """What the kernel and the copies are measured on. num_experts sizes the 'whole layer' copy."""
    hidden: int = 2048
    expert_hidden: int = 768
    top_k: int = 8
    dtype: str = "bf16"
    num_experts: int = 128
    name: str = "Qwen3-30B-A3B"

    def key(self) -> str:
        return f"{self.hidden}x{self.expert_hidden}-{self.dtype}"


def _round_up(n, m):
    return (n + m - 1) // m * m


def synthetic_layout(shape: ExpertShape):
    """The INTERFACES section 3 slot layout for `shape` (what ftw/convert writes)."""
    from .kernels import DTYPE_SIZES, ExpertLayout
    nbytes = shape.hidden * shape.expert_hidden * DTYPE_SIZES[shape.dtype]
    og, ou = 0, _round_up(nbytes, 64)
    od = ou + _round_up(nbytes, 64)
    return ExpertLayout(_round_up(od + nbytes, 4096), shape.dtype, shape.hidden, shape.expert_hidden, og, ou, od)


def synthetic_bank(layout, num_experts: int, seed: int = 0) -> np.ndarray:
    """num_experts slots of small random weights, page-aligned, no two pages alike.

    A 2 MiB block of normal values is tiled, each copy XOR-ed with a differently shifted random
    pattern in the low 3 bits of every 16-bit word (mantissa bits in bf16, fp16 and fp32: no
    NaN, inf or denormal appears). Identical pages would be merged by KSM-style deduplication
    on virtual machines and then read from cache, inflating the bandwidth measured.
    """
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


def time_stream_read(pool, buf, seconds=None):
    """STREAM-like read GB/s of the pool's threads over `buf` (best pass)."""
    return _timed_passes(lambda: pool.read_sum(buf), buf.nbytes, seconds)


def _timed_passes(fn, nbytes, seconds=None, stop=None):
    fn()  # warm-up: page faults, pool wake-up
    seconds = MEASURE_SECONDS if seconds is None else seconds
    best, total, t_start = 0.0, 0, time.perf_counter()
    while True:
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        best, total = max(best, nbytes / (t1 - t0)), total + nbytes
        if (stop.is_set() if stop is not None else t1 - t_start >= seconds):
            break
    return (total / (t1 - t_start) if stop is not None else best) / 1e9


# ---- host-to-device copies ---------------------------------------------------------------------

def time_h2d(nbytes: int, seconds=None, stop=None, device="cuda", started=None):
    """GB/s of pinned host-to-device copies of `nbytes` (best copy, or the mean until `stop`);
    sets the `started` event once the buffers exist and a first copy is done. The copying thread
    sleeps on a blocking event instead of spinning in a stream sync: a spinning copier takes a
    core from the kernel's pool when both run (as the engine's copies are waited on by nobody)."""
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
    return _timed_passes(once, nbytes, seconds, stop)


def time_gather(nbytes: int, slot_bytes: int, seconds=None, stop=None, device="cuda", started=None,
                per_call: int = 8):
    """GB/s of zero-copy fills (experts/zero_copy.py): the gather kernel copying `per_call`
    distinct experts of a pinned host layer of `nbytes` into device slots per launch (a decode
    layer step's few fills; different experts each launch), like time_h2d otherwise."""
    import torch
    from .experts import zero_copy
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
    return _timed_passes(once, per_call * slot_bytes, seconds, stop)


# The copy loop waits on a blocking (sleeping) event; tools/bench_cpu_experts.py --copy-sync spin
# turns this off to show what a spinning copier costs the kernel.
COPY_SYNC_BLOCKING = True


def concurrent_bandwidths(pool, bank, layout, top_k, copy_bytes, seconds, host_work=None,
                          fills="copy"):
    """(P, C) GB/s with the copy loop in a thread and the kernel in the pool, at the same time.
    host_work: another () -> bytes read to time beside the copies instead of the kernel at
    batch 1 (e.g. the pool's STREAM read). fills: "copy" (pinned copies on a stream) or
    "zero_copy" (the gather kernel, time_gather)."""
    stop, started, result = threading.Event(), threading.Event(), {}
    def copy_loop():
        try:
            if fills == "zero_copy":
                result["P"] = time_gather(copy_bytes, layout.slot_stride, stop=stop, started=started)
            else:
                result["P"] = time_h2d(copy_bytes, stop=stop, started=started)
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
    t_end = time.perf_counter() + seconds
    nbytes, t0 = 0, time.perf_counter()
    while time.perf_counter() < t_end:
        nbytes += host_work()
    C = nbytes / (time.perf_counter() - t0) / 1e9
    stop.set()
    copier.join()
    if "P" not in result:
        raise ConfigError("the pinned host-to-device copy loop failed (see the message above); "
                          "is there enough free pinned memory and GPU memory for one layer?")
    return result["P"], C


# ---- the profile ---------------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or "unknown CPU"


def gpu_name(device=None):
    """The CUDA device's name, or None without CUDA."""
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(device)
    except (ImportError, RuntimeError):
        pass
    return None


def profile_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "freetoken" / "profiles"


def profile_key(gpu, cpu, threads, shape_key) -> str:
    """File-name-safe key: GPU, CPU model, pool threads, expert shape/dtype."""
    raw = f"{gpu or 'nogpu'}__{cpu}__t{threads}__{shape_key}"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", raw)


def load_profile(gpu, cpu, threads, shape_key):
    """The stored profile dict for this key, or None."""
    path = profile_dir() / f"{profile_key(gpu, cpu, threads, shape_key)}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def shape_from_model(path: str):
    """(ExpertShape, ExpertLayout) of a .ftw model's first expert bank."""
    try:
        import ftw
    except ImportError:
        raise ConfigError("--model needs the ftw package, which is not importable here") from None
    from .kernels import layout_from_bank_info
    with ftw.open(path) as f:
        if not f.banks:
            raise ConfigError(f"{path} has no expert banks: nothing to profile")
        info = f.banks[min(f.banks)]
        lay = layout_from_bank_info(info)
        shape = ExpertShape(lay.D, lay.I, int(f.config.get("num_experts_per_tok", 8)), lay.dtype,
                            int(info.num_experts), str(f.config.get("family", Path(path).stem)))
    return shape, lay


def run_profile(model=None, cpu_threads=None, as_json=False, seconds=None, min_working_set=None,
                shape=None, save=True) -> str:
    """Measure, store and format a profile (see the module docstring); returns the text to print.
    The expert shape comes from `model` (.ftw), else `shape`, else Qwen3-30B-A3B's."""
    from . import kernels
    has_gpu = gpu_name() is not None
    if model:
        shape, layout = shape_from_model(model)
    else:
        shape = shape or ExpertShape()
        layout = synthetic_layout(shape)
    pool = kernels.get_pool(cpu_threads or kernels.default_num_threads(has_gpu))
    if has_gpu:  # the kernel as the engine's GPU runs use it (experts/executor.py)
        from .experts.executor import use_gpu_run_tuning
        use_gpu_run_tuning(pool)
    bank = synthetic_bank(layout, working_set_experts(layout, shape.top_k, min_working_set))
    r = {"gpu": gpu_name(), "cpu": cpu_model(), "threads": pool.num_threads, "isa": pool.isa,
         "shape": asdict(shape), "shape_key": shape.key(), "slot_bytes": layout.slot_stride,
         "layer_bytes": layout.slot_stride * shape.num_experts, "working_set_bytes": bank.nbytes,
         "llc_bytes": llc_bytes(), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    # NOTE: read the bank itself, so both see the same pages (on VMs, fresh pages read slower)
    r["stream_read"] = time_stream_read(pool, bank, seconds)
    r["B_H"] = time_kernel(pool, bank, layout, 1, shape.top_k, seconds)
    r["B_P_slot"] = r["B_P"] = r["P"] = r["paper_q_frac"] = None
    if has_gpu:
        layer = min(r["layer_bytes"], 2 << 30)
        r["B_P_slot"] = time_h2d(layout.slot_stride, seconds)
        r["B_P"] = time_h2d(layer, seconds)
        r["P"], r["C"] = concurrent_bandwidths(pool, bank, layout, shape.top_k, layer,
                                     MEASURE_SECONDS if seconds is None else seconds)
        r["q_frac"] = r["P"] / (r["P"] + r["C"])
        r["paper_q_frac"] = r["B_P"] / r["B_H"]
        from .experts import zero_copy
        if zero_copy.available():  # the decode fill path of captured steps
            r["B_Z"] = time_gather(layer, layout.slot_stride, seconds)
            r["P_zc"], r["C_zc"] = concurrent_bandwidths(
                pool, bank, layout, shape.top_k, layer, MEASURE_SECONDS if seconds is None else seconds,
                fills="zero_copy")
            r["q_frac_zc"] = r["P_zc"] / (r["P_zc"] + r["C_zc"])
        r["policy"] = "hybrid"
    else:
        r["C"], r["q_frac"], r["policy"] = r["B_H"], 0.0, "cpu-only (no GPU)"
    if save:
        path = profile_dir() / f"{profile_key(r['gpu'], r['cpu'], r['threads'], r['shape_key'])}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r, indent=1))
        r["path"] = str(path)
    return json.dumps(r, indent=1) if as_json else format_profile(r)


def format_profile(r: dict) -> str:
    """The Table-1-like text of a profile dict."""
    def gb(v):
        return "absent (no GPU)" if v is None else f"{v:7.2f} GB/s"
    s = r["shape"]
    lines = [f"freetoken profile: {r['cpu']} | GPU {r['gpu'] or 'none'} | pool {r['threads']} threads, {r['isa']}",
             f"expert {s['name']}: D={s['hidden']} I={s['expert_hidden']} {s['dtype']} top-{s['top_k']}, "
             f"slot {r['slot_bytes'] / 1e6:.1f} MB, layer {r['layer_bytes'] / 1e9:.2f} GB, "
             f"working set {r['working_set_bytes'] / 1e9:.2f} GB (LLC {r['llc_bytes'] >> 20} MiB)",
             "",
             f"  {'path':<44} {'alone':>15} {'concurrent':>15}",
             f"  {'B_P  pinned H2D copy, one slot':<44} {gb(r['B_P_slot']):>15} {'':>15}",
             f"  {'B_P  pinned H2D copy, whole layer':<44} {gb(r['B_P']):>15} {gb(r['P']) if r['gpu'] else '':>15}",
             *([f"  {'B_P  zero-copy gather kernel, 8 slots':<44} {gb(r['B_Z']):>15} {gb(r['P_zc']):>15}",
                f"  {'B_H  CPU expert kernel beside the gather':<44} {'':>15} {gb(r['C_zc']):>15}"]
               if r.get("P_zc") else []),
             f"  {'B_H  CPU expert kernel, batch 1':<44} {gb(r['B_H']):>15} {gb(r['C']) if r['gpu'] else '':>15}",
             f"  {'host STREAM-like read':<44} {gb(r['stream_read']):>15} {'':>15}", ""]
    if r["gpu"]:
        lines += [f"  q*/m = P/(P+C) = {r['q_frac']:.3f}  (P, C measured concurrently; sum {r['P'] + r['C']:.1f} GB/s)",
                  f"  paper's q*/m = B_P/B_H = {r['paper_q_frac']:.3f}"]
        if r.get("P_zc"):
            lines.append(f"  zero-copy fills (captured decode steps use these): q*/m = "
                         f"{r['q_frac_zc']:.3f}  (sum {r['P_zc'] + r['C_zc']:.1f} GB/s)")
    else:
        lines += ["  no GPU: B_P absent, policy CPU-only (q* = 0)"]
    if r.get("path"):
        lines.append(f"  saved to {r['path']}")
    return "\n".join(lines)


def get_bandwidths(device_type: str, slot_bytes: int = None, num_threads=None, fills="copy"):
    """The miss-split bandwidths experts/policy.py asks for (docs/INTERFACES.md section 6):
    None when no stored profile of this GPU and CPU has an expert slot of `slot_bytes` (any
    slot size when None), else {'P', 'C', 'source'} in GB/s, P and C measured concurrently,
    for the fill path `fills` ("zero_copy": the gather kernel's pair when the profile has it).
    Always None for device_type 'cpu' (no PCIe fills to split against)."""
    if device_type != "cuda":
        return None
    prof = _find_profile(gpu_name(), lambda p: slot_bytes is None or p.get("slot_bytes") == slot_bytes,
                         num_threads)
    if not prof or not prof.get("P"):
        return None
    if fills == "zero_copy" and prof.get("P_zc"):
        return {"P": prof["P_zc"], "C": prof["C_zc"], "source": _source(prof) + ", zero-copy fills"}
    return {"P": prof["P"], "C": prof["C"], "source": _source(prof)}


def bandwidths_for(model_shape, device, num_threads=None, calibrate=False, fills="copy"):
    """(P, C, source) in GB/s for the hybrid split q* = round(m * P / (P + C)).

    model_shape: an ExpertShape, a BankInfo / ExpertLayout (D, I, dtype read from it) or a
    (D, I, dtype) tuple; device: 'cuda'/'cpu' or a torch.device. Uses the stored profile of this
    GPU, CPU and shape (`num_threads` pool threads preferred, else the most threads); with
    `calibrate`, measures a short one (a few seconds) when none exists; else the documented
    DEFAULT_P / DEFAULT_C. Without CUDA, P = 0 (CPU-only) and the source says so. fills:
    "zero_copy" takes the profile's zero-copy gather pair when it has one (get_bandwidths).
    """
    from . import kernels
    D, I, dtype = _shape_triple(model_shape)
    shape_key = f"{D}x{I}-{dtype}"
    is_cuda = str(getattr(device, "type", device)).startswith("cuda")
    gpu = gpu_name() if is_cuda else None
    threads = num_threads or kernels.default_num_threads(is_cuda)
    prof = _find_profile(gpu, lambda p: p.get("shape_key") == shape_key, threads)
    if prof is None and calibrate:
        run_profile(cpu_threads=threads, seconds=0.3, min_working_set=256 << 20,
                    shape=ExpertShape(D, I, 8, dtype, 1, f"{D}x{I}"))
        prof = _find_profile(gpu, lambda p: p.get("shape_key") == shape_key, threads)
    if not is_cuda:
        C = prof["C"] if prof else DEFAULT_C
        return 0.0, C, "no GPU: CPU-only" + (f"; C from {_source(prof)}" if prof else "")
    if prof and fills == "zero_copy" and prof.get("P_zc"):
        return prof["P_zc"], prof["C_zc"], _source(prof) + ", zero-copy fills"
    if prof and prof.get("P"):
        return prof["P"], prof["C"], _source(prof)
    return DEFAULT_P, DEFAULT_C, ("defaults (no profile for this GPU/CPU/shape: run `freetoken profile"
                                  " --model MODEL.ftw`)")


def _source(prof) -> str:
    return (f"profile {prof.get('created', '?')} ({prof.get('threads')} threads, "
            f"{prof.get('shape_key')}, measured concurrently)")


def _find_profile(gpu, match, threads=None):
    """The stored profile of this GPU and CPU that `match`es: `threads` threads if stored, else
    the one with the most threads; None when there is none."""
    found = []
    directory = profile_dir()
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            p = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if p.get("gpu") == gpu and p.get("cpu") == cpu_model() and match(p):
            found.append(p)
    exact = [p for p in found if p.get("threads") == threads]
    return (exact or sorted(found, key=lambda p: p.get("threads", 0)))[-1] if found else None


def _shape_triple(s):
    if isinstance(s, ExpertShape):
        return s.hidden, s.expert_hidden, s.dtype
    if isinstance(s, tuple):
        return int(s[0]), int(s[1]), str(s[2])
    if hasattr(s, "projections"):
        from .kernels import layout_from_bank_info
        s = layout_from_bank_info(s)
    return s.D, s.I, s.dtype
