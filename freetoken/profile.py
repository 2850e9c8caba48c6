"""`freetoken profile`: measures this machine's miss-path bandwidths (the measurements are in
bandwidth.py) and stores them as a profile.

B_P  pinned host-to-device copies (one expert slot, one whole layer) and the zero-copy gather
     fills (experts/transfer/zero_copy.py, with Triton); CUDA only.
B_H  the real CPU expert kernel at batch 1 on the model's expert shape, over a working set
     larger than the last-level cache (GB/s = unique expert bytes read / time).
F    the same kernel's arithmetic rate when each expert has 32 tokens (GFLOP/s): what a
     prefill chunk's CPU experts run at (experts/prefill/choice.py reads it, prefill_rates).
Both again while running at once (the copy loop in a Python thread, the kernel in the pool), and
a STREAM-like multi-threaded host read of the same bytes. The hybrid split uses P and C measured concurrently:
q* = m * P / (P + C); the paper's q* = m * B_P / B_H is printed beside it.
Concurrent pairs are medians of short windows (bandwidth.concurrent_bandwidths); a pair whose C
lost more than the copies explain is measured again once, then flagged (consistency_problem).
Where profiles live, their keys and which one a lookup takes: profile_store.py (a full profile
of a key wins over bandwidths_for's calibration, KEY.calibration.json); the printed table:
profile_table.py. Both re-exported here. Owns no engine state: the engine (and the benches)
read the stored profile through expert_rates and hand the rates to the expert runtime, which
reads no profile; bandwidths_for(shape, device) also says which source.
Quantized experts (issue 35): a profile measures one quant type (the model's, or --quant's:
synthetic banks of that type, quant_banks.py), its key and record name it (ExpertShape.key:
"2048x768-bf16-q4_0"; unquantized keys unchanged), and a lookup takes the bank's type; without
one of that type, the bf16 profile of the same shape through quant_fallback (FALLBACK_RULE).
"""
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

from . import bandwidth as bw
from .bandwidth import ExpertShape
from .errors import ConfigError
from .experts.split import ExpertRates, MissBandwidths, default_rates
# Re-exported: callers and tests import these from freetoken.profile. gpu_name is called by its
# name here, so tests that monkeypatch profile.gpu_name still reach measure/lookup below.
from .profile_store import (cpu_model, find_profile, gpu_name, load_profile,  # noqa: F401
                            profile_dir, profile_key, save_profile)
from .profile_table import format_profile  # noqa: F401

_find_profile = find_profile  # its name before the split (tests use it)

# Used when no profile matches (GB/s): a PCIe 4.0 x16 link's pinned copies against a desktop
# CPU reading experts at ~50 GB/s while copies run (so q* = m/3). Same as experts/split.py.
DEFAULT_P, DEFAULT_C = 25.0, 50.0
# bandwidths_for's calibration: seconds per alone measurement, the concurrent pairs' total (five
# 0.2 s windows after a 0.2 s warm-up one), the working set: 3 s on a 2-core VM without a GPU
# (half of it building the bank), about 5 s with one (estimated), 2.4 s more when re-measured.
CALIBRATION = dict(seconds=0.3, concurrent_seconds=1.0, min_working_set=256 << 20)
# A concurrent C below C_FLOOR x the kernel alone is inconsistent unless P + C reaches SUM_FLOOR x
# it (the copies then took the memory bandwidth C lost). H200 host: C/alone 0.69-0.79, P + C >=
# 1.0 x; the bad calibration: C 32 of ~117 alone, P + C ~70.
C_FLOOR, SUM_FLOOR = 0.5, 0.8


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
                            int(info.num_experts), str(f.config.get("family", Path(path).stem)),
                            lay.quant)
    return shape, lay


def run_profile(model=None, cpu_threads=None, as_json=False, seconds=None, min_working_set=None,
                shape=None, save=True, quant=None) -> str:
    """Measure, store and format a profile (see the module docstring); returns the text to print.
    The expert shape comes from `model` (.ftw), else `shape`, else Qwen3-30B-A3B's; `quant`
    (a type of kernel_args.KERNEL_QUANTS, or "none") replaces its quant type."""
    if quant is not None:
        if model:
            shape, _ = shape_from_model(model)
        shape, model = replace(shape or ExpertShape(), quant=quant), None
    r = measure_profile(model, cpu_threads, seconds, min_working_set, shape)
    r["calibrated"] = False
    if save:
        r["path"] = save_profile(r)
    return json.dumps(r, indent=1) if as_json else format_profile(r)


def run_calibration(threads, shape) -> dict:
    """The short profile bandwidths_for measures when none is stored (CALIBRATION), marked
    "calibrated". Stored unless a pair stayed inconsistent after its re-measure: then only
    returned (its source says so), and the next run measures again."""
    r = measure_profile(cpu_threads=threads, shape=shape, **CALIBRATION)
    r["calibrated"] = True
    if not r.get("inconsistent"):
        r["path"] = save_profile(r)
    return r


def measure_profile(model=None, cpu_threads=None, seconds=None, min_working_set=None, shape=None,
                    concurrent_seconds=None) -> dict:
    """The profile dict: `seconds` per alone measurement, `concurrent_seconds` per concurrent
    pair (both bandwidth.MEASURE_SECONDS when None, the pair's default `seconds`)."""
    from . import kernels
    t_begin = time.perf_counter()
    has_gpu = gpu_name() is not None
    if model:
        shape, layout = shape_from_model(model)
    else:
        shape = shape or ExpertShape()
        layout = bw.synthetic_layout(shape)
    pool = kernels.get_pool(cpu_threads or kernels.default_num_threads(has_gpu))
    if has_gpu:  # the kernel as the engine's GPU runs use it (experts/executor.py)
        from .experts.executor import use_gpu_run_tuning
        use_gpu_run_tuning(pool)
    bank = bw.synthetic_bank(layout, bw.working_set_experts(layout, shape.top_k, min_working_set))
    r = {"gpu": gpu_name(), "cpu": cpu_model(), "threads": pool.num_threads, "isa": pool.isa,
         "shape": asdict(shape), "shape_key": shape.key(), "quant": shape.quant,
         "slot_bytes": layout.slot_stride,
         "layer_bytes": layout.slot_stride * shape.num_experts, "working_set_bytes": bank.nbytes,
         "llc_bytes": bw.llc_bytes(), "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
         "measure_seconds": bw.MEASURE_SECONDS if seconds is None else seconds}
    # NOTE: read the bank itself, so both see the same pages (on VMs, fresh pages read slower)
    r["stream_read"] = bw.time_stream_read(pool, bank, seconds)
    r["B_H"] = bw.time_kernel(pool, bank, layout, 1, shape.top_k, seconds)
    r["cpu_gflops"] = bw.time_route_flops(pool, bank, layout, seconds=seconds)
    r["B_P_slot"] = r["B_P"] = r["P"] = r["paper_q_frac"] = None
    if has_gpu:
        layer = min(r["layer_bytes"], 2 << 30)
        pair_s = concurrent_seconds or r["measure_seconds"]
        r["concurrent_seconds"], r["concurrent_windows"] = pair_s, bw.CONCURRENT_WINDOWS
        r["B_P_slot"] = bw.time_h2d(layout.slot_stride, seconds)
        r["B_P"] = bw.time_h2d(layer, seconds)
        _measure_pair(r, "", lambda w: bw.concurrent_bandwidths(
            pool, bank, layout, shape.top_k, layer, pair_s, per_window=w))
        r["paper_q_frac"] = r["B_P"] / r["B_H"]
        from .experts.transfer import zero_copy
        if zero_copy.available():  # the decode fill path of captured steps
            r["B_Z"] = bw.time_gather(layer, layout.slot_stride, seconds)
            _measure_pair(r, "_zc", lambda w: bw.concurrent_bandwidths(
                pool, bank, layout, shape.top_k, layer, pair_s, fills="zero_copy", per_window=w))
        r["policy"] = "hybrid"
    else:
        r["C"], r["q_frac"], r["policy"] = r["B_H"], 0.0, "cpu-only (no GPU)"
    r["wall_seconds"] = round(time.perf_counter() - t_begin, 2)
    return r


def _measure_pair(r, suffix, measure):
    """Sets r's P, C, q_frac (+ suffix) from measure(per_window) -> (P, C), and each kept
    window's pair as windows (+ suffix); measures once more when the pair is inconsistent with
    the kernel alone (consistency_problem), and if still so says it in r["inconsistent"]."""
    for attempt in range(2):
        windows = []
        P, C = measure(windows)
        fills = "gather" if suffix else "copies"
        problem = consistency_problem(P, C, r["B_H"], fills)
        if problem is None:
            break
    r["P" + suffix], r["C" + suffix], r["q_frac" + suffix] = P, C, P / (P + C)
    r["windows" + suffix] = [[round(p, 2), round(c, 2)] for p, c in windows]
    if attempt:
        r["remeasured"] = r.get("remeasured", []) + [f"beside the {fills}"]
    if problem:
        r["inconsistent"] = "; ".join(filter(None, [r.get("inconsistent"), problem]))


def consistency_problem(P, C, C_alone, fills="copies"):
    """None, or what is wrong: the kernel beside the fills lost more than C_FLOOR of its alone
    rate, more than the fills' own memory traffic explains (P + C < SUM_FLOOR x alone)."""
    if C_alone and C < C_FLOOR * C_alone and P + C < SUM_FLOOR * C_alone:
        return (f"C beside the {fills} {C:.1f} GB/s < {C_FLOOR} x the kernel alone ({C_alone:.1f}), "
                f"P + C {P + C:.1f} GB/s")
    return None


# FALLBACK_RULE: a quantized bank without a profile of its type takes its shape's bf16 profile,
# the fills' P as they are (the link moves bytes, whatever they hold) and the CPU kernel's C (and
# B_H) times its bytes per expert over bf16's: the quantized kernel is taken to run as many
# experts per second as bf16's, not as many bytes (it is compute-bound dequantizing on a few
# cores, docs/MEASUREMENTS.md#quantized-experts-on-the-cpu); F (GFLOP/s) stays for the same reason.
FALLBACK_RULE = "C x {ratio:.2f} ({quant} / bf16 bytes per expert)"


def quant_fallback(prof: dict, shape: ExpertShape) -> dict:
    """bf16 profile `prof` as the stand-in for quantized `shape` (FALLBACK_RULE), with a
    "fallback" line saying so and how to measure the type."""
    plain = replace(shape, quant="none")
    ratio = (bw.synthetic_layout(shape).expert_nbytes / bw.synthetic_layout(plain).expert_nbytes)
    out = dict(prof)
    for k in ("C", "C_zc", "B_H"):
        if out.get(k):
            out[k] = out[k] * ratio
    out["fallback"] = (f"no {shape.quant} profile: {plain.key()}'s with "
                       + FALLBACK_RULE.format(ratio=ratio, quant=shape.quant)
                       + " - run `freetoken profile --model MODEL.ftw`")
    return out


def bank_profile(gpu, slot_bytes: int = None, shape: ExpertShape = None, threads=None,
                 fallback=True):
    """The stored profile (find_profile) of this GPU and CPU for a bank of slot_bytes and
    ExpertShape `shape`: one of shape's quant type ("none" without a shape; profiles stored
    before quant types are "none") whose slot_bytes or shape key match (any when both are None);
    else, for a quantized shape and with `fallback`, its shape's bf16 profile through
    quant_fallback; else None."""
    quant, key = (shape.quant, shape.key()) if shape else ("none", None)
    prof = find_profile(gpu, lambda p: p.get("quant", "none") == quant and (
        (slot_bytes is None and key is None) or p.get("slot_bytes") == slot_bytes
        or (key is not None and p.get("shape_key") == key)), threads)
    if prof is None and fallback and quant != "none":
        plain = replace(shape, quant="none").key()
        prof = find_profile(gpu, lambda p: p.get("quant", "none") == "none"
                            and p.get("shape_key") == plain, threads)
        return quant_fallback(prof, shape) if prof else None
    return prof


def bank_shape(info) -> ExpertShape:
    """The ExpertShape a bank's profile is keyed by (D, I, dtype, quant of a BankInfo)."""
    from .kernels import layout_from_bank_info
    lay = layout_from_bank_info(info)
    return ExpertShape(lay.D, lay.I, dtype=lay.dtype, num_experts=int(info.num_experts),
                       quant=lay.quant)


def get_bandwidths(device_type: str, slot_bytes: int = None, num_threads=None, fills="copy",
                   shape: ExpertShape = None):
    """The miss-split bandwidths experts/policy.py asks for (docs/INTERFACES.md section 6):
    None when no stored profile of this GPU and CPU fits a bank of `slot_bytes` and ExpertShape
    `shape` (bank_profile: its quant type, or bf16's by FALLBACK_RULE), else {'P', 'C',
    'P_alone', 'C_alone', 'source', 'fallback'} in GB/s: P and C measured concurrently, for the
    fill path `fills` ("zero_copy": the gather kernel's pair when the profile has it), and each
    path alone (one slot's copy or the gather; the kernel); fallback: "" or quant_fallback's
    line. Always None for device_type 'cpu' (no PCIe fills to split against). A profile of
    `shape`'s key matches any slot size (a slot with biases is a few KB larger than the
    profile's synthetic one of the same shape)."""
    if device_type != "cuda":
        return None
    prof = bank_profile(gpu_name(), slot_bytes, shape, num_threads)
    if not prof or not prof.get("P"):
        return None
    C_alone = prof.get("B_H") or prof["C"]
    fallback = prof.get("fallback", "")
    if fills == "zero_copy" and prof.get("P_zc"):
        return {"P": prof["P_zc"], "C": prof["C_zc"], "P_alone": prof.get("B_Z") or prof["P_zc"],
                "C_alone": C_alone, "source": _source(prof) + ", zero-copy fills",
                "fallback": fallback}
    return {"P": prof["P"], "C": prof["C"], "P_alone": prof.get("B_P_slot") or prof["P"],
            "C_alone": C_alone, "source": _source(prof), "fallback": fallback}


def prefill_rates(device_type: str, slot_bytes: int = None, num_threads=None,
                  shape: ExpertShape = None) -> dict:
    """What the prefill choice (experts/prefill/choice.py) takes from the stored profile of this
    GPU and CPU for the bank (bank_profile): {'B_P': whole-layer pinned copies alone, GB/s (cuda
    only), 'F': the CPU experts' GFLOP/s at many tokens per expert}; keys absent where not
    measured."""
    gpu = gpu_name() if device_type == "cuda" else None
    prof = bank_profile(gpu, slot_bytes, shape, num_threads)
    out = {}
    if prof and prof.get("B_P") and device_type == "cuda":
        out["B_P"] = prof["B_P"]
    if prof and prof.get("cpu_gflops"):
        out["F"] = prof["cpu_gflops"]
    return out


def expert_rates(banks: dict, engine_config, device) -> ExpertRates:
    """The stored profile's rates for an expert runtime over `banks` ({layer: HostBank}) run by
    engine_config on `device`: the split's bandwidths for the fill path decode will use (the
    zero-copy gather's pair with captured decode steps on cuda, else the copies'), and the
    prefill choice's B_P and F, from the profile of the banks' quant type (or bf16's by
    FALLBACK_RULE: the rates' note says so). Where nothing is stored: experts/split.py's
    defaults."""
    from .cpu_topology import default_num_threads
    from .experts.transfer import zero_copy
    device_type = str(getattr(device, "type", device)).split(":")[0]
    slot_bytes = max((b.info.slot_stride for b in banks.values()), default=0)
    fills = "zero_copy" if zero_copy.enabled(device, engine_config.cuda_graphs) else "copy"
    rates = default_rates(device_type)
    shape = bank_shape(next(iter(banks.values())).info) if banks else None
    got = get_bandwidths(device_type, slot_bytes, fills=fills, shape=shape)
    if got is not None and got["P"] > 0 and got["C"] > 0:
        rates = ExpertRates(MissBandwidths(float(got["P"]), float(got["C"]),
                                           float(got["P_alone"] or got["P"]),
                                           float(got["C_alone"] or got["C"])),
                            measured=True, source=got["source"], note=got["fallback"])
    threads = engine_config.cpu_threads or default_num_threads(device_type == "cuda")
    extra = prefill_rates(device_type, slot_bytes, threads, shape)
    return replace(rates, stream_gbps=extra.get("B_P"), cpu_gflops=extra.get("F"))


def bandwidths_for(model_shape, device, num_threads=None, calibrate=False, fills="copy"):
    """(P, C, source) in GB/s for the hybrid split q* = round(m * P / (P + C)).

    model_shape: an ExpertShape, a BankInfo / ExpertLayout (D, I, dtype, quant read from it) or
    a (D, I, dtype) tuple; device: 'cuda'/'cpu' or a torch.device. Uses the stored profile of
    this GPU, CPU, shape and quant type (bank_profile); with `calibrate`, measures a short one
    of that type (a few seconds, run_calibration) when none exists; else a quantized shape takes
    bf16's by FALLBACK_RULE (the source says so), else the documented DEFAULT_P / DEFAULT_C.
    Without CUDA, P = 0 (CPU-only) and the source says so. fills: "zero_copy" takes the
    profile's zero-copy gather pair when it has one (get_bandwidths)."""
    from . import kernels
    D, I, dtype, quant = _shape_fields(model_shape)
    shape = ExpertShape(D, I, 8, dtype, 1, f"{D}x{I}", quant)
    is_cuda = str(getattr(device, "type", device)).startswith("cuda")
    gpu = gpu_name() if is_cuda else None
    threads = num_threads or kernels.default_num_threads(is_cuda)
    prof = bank_profile(gpu, shape=shape, threads=threads, fallback=not calibrate)
    if prof is None and calibrate:
        prof = run_calibration(threads, shape)
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
    s = (f"{'calibration' if prof.get('calibrated') else 'profile'} {prof.get('created', '?')} "
         f"({prof.get('threads')} threads, {prof.get('shape_key')}"
         f"{', measured concurrently' if prof.get('P') else ''})")
    if prof.get("fallback"):
        s += f"; {prof['fallback']}"
    if prof.get("inconsistent"):
        s += f"; INCONSISTENT twice: {prof['inconsistent']}" + (
            "; not stored: run `freetoken profile`" if prof.get("calibrated") else "")
    return s


def _shape_fields(s):
    """(D, I, dtype, quant) of an ExpertShape, (D, I, dtype[, quant]) tuple, BankInfo or layout."""
    if isinstance(s, ExpertShape):
        return s.hidden, s.expert_hidden, s.dtype, s.quant
    if isinstance(s, tuple):
        return int(s[0]), int(s[1]), str(s[2]), str(s[3]) if len(s) > 3 else "none"
    if hasattr(s, "projections"):
        from .kernels import layout_from_bank_info
        s = layout_from_bank_info(s)
    return s.D, s.I, s.dtype, s.quant
