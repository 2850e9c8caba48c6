"""Our gated delta rule (freetoken/models/linear_attention.py, torch ops) against fla's Triton
kernels (the `fla-core` package, import name `fla`; issue 34) on one Gated DeltaNet layer of a
tools/bench_shapes.py shape (Qwen3.6-35B-A3B by default: 16 key heads, 32 value heads, key and
value head dims 128): prefill of one sequence (--prefill-lengths, ours chunked against fla's
chunk_gated_delta_rule) and decode of one token per sequence (--decode-batches, ours recurrent,
one call per sequence as Transformer.forward_batch runs the mixer, against one
fused_recurrent_gated_delta_rule call over the batch). Inputs bf16 (q, k, v, beta) and fp32 (g),
state fp32, random from a fixed seed, starting from a nonzero state. One table: per case and
implementation, ms per call (cuda: CUDA events, --warmup calls excluded, median of --repeats;
decode also as --graph-calls calls captured in one CUDA graph, as the decode step runs; cpu:
perf_counter) and the largest absolute difference of the output and of the final state from
ours run on the same values in fp32 (the reference; `ours` itself differs from it only by its
bf16 output). The causal conv1d before the rule is not compared (fla has one too:
fla.modules.convolution). Without fla (or with --no-fla) only ours runs, and the header says so.

How fla's arguments map to ours, read from fla-core 0.6.0's source (gated_delta_rule/chunk.py,
fused_recurrent.py). The recurrent one was run under Triton's interpreter on cpu (fp32 inputs,
GVA 2 key / 4 value heads, batch 2, 1 and 5 tokens, a nonzero initial state): fla's output and
final state within 1.2e-7 of ours, so this mapping holds for it. The chunked one did not run
under the interpreter (its autotuned kernels want a driver): its mapping rests on the source
(the same arguments and flags) until the H200 run's difference columns confirm it:
  layout   fla [B, T, H, D] (q, k: H = nk key heads; v: HV = nv value heads), g and beta
           [B, T, HV]; ours [T, nk, dk], [T, nv, dv], [T, nv] for one sequence: x[None].
  heads    value head h reads key head h // (nv / nk) in both (fla's GVA `i_h // (HV // H)`,
           ours repeat_interleave).
  g        log-space decay per token and value head, S <- exp(g) S, in both (ours
           -exp(A_log) * softplus(a + dt_bias), fp32; fla can fuse that, use_gate_in_kernel=True
           with A_log and dt_bias: not used here).
  beta     after the sigmoid in both (fla's use_beta_sigmoid_in_kernel=False, the default).
  l2 norm  ours normalises q and k inside gated_delta_rule as x * rsqrt(sum x^2 + 1e-6) in fp32;
           fla does it with use_qk_l2norm_in_kernel=True, same eps (chunk: l2norm_fwd, whose
           output keeps the input dtype, so the normalised q, k are bf16 there; recurrent: fp32
           in the kernel).
  scale    dk^-1/2 on q in both (fla's scale=None default is k.shape[-1]^-1/2).
  state    fla initial_state / final state [N, HV, K, V] (state_v_first=False), the final one
           fp32 and newly allocated (not updated in place as ours is: a caller copies it back);
           ours [nv, dk, dv] fp32, the same [K, V] order: state[None].
  output   fla o [B, T, HV, V] in the inputs' dtype; ours [T, nv, dv] in v's dtype (bf16 both).
fla dispatches chunk_gated_delta_rule to an external backend (flash_qla) when that package is
installed; without it (the plan) the Triton kernels run. Whether fla's bf16 matmuls stay within
the bf16 rounding of ours at 8192 tokens is what the difference columns are for.

    python tools/bench_linear_attention.py                 # cuda, Qwen3.6-35B-A3B, fla if installed
    python tools/bench_linear_attention.py --device cpu --tiny --prefill-lengths 16,70 \\
        --decode-batches 1,2 --repeats 3 --warmup 1   # smoke (tests/test_bench_linear_attention.py)
"""
import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from bench_shapes import SHAPES, shape_config
from freetoken.models import linear_attention
from freetoken.models.linear_attention import gated_delta_rule


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    hybrid = [name for name, c in SHAPES.items() if "linear_num_key_heads" in c]
    ap.add_argument("--shape", choices=hybrid, default="qwen3.6-35b-a3b",
                    help="a bench_shapes.py shape with linear attention")
    ap.add_argument("--tiny", action="store_true",
                    help="the shape's test widths (bench_shapes.TINY)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prefill-lengths", default="512,2048,8192", help="tokens of one sequence")
    ap.add_argument("--decode-batches", default="1,4", help="sequences of one decode token")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls first (compiles)")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls; the median is reported")
    ap.add_argument("--graph-calls", type=int, default=32,
                    help="cuda decode: calls captured in one graph (0: no graph rows)")
    ap.add_argument("--no-fla", action="store_true", help="ours alone even if fla is installed")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def load_fla(device: str):
    """(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, None) or (None, None, why)."""
    try:
        import fla
        from fla.ops.gated_delta_rule import (chunk_gated_delta_rule,
                                              fused_recurrent_gated_delta_rule)
    except ImportError as e:
        return None, None, (f"fla is missing ({e}): ours alone; install the fla-core wheel "
                            f"(docs/MEASUREMENTS.md#gated-deltanet-ours-against-fla)")
    if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return None, None, (f"fla {fla.__version__} needs cuda (or TRITON_INTERPRET=1 on cpu): "
                            f"ours alone")
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, None


class Inputs:
    """One layer's inputs for B sequences of T tokens, as GatedDeltaNet.forward hands them to
    gated_delta_rule: q, k [B, T, nk, dk], v [B, T, nv, dv], beta [B, T, nv] bf16 (SiLU'd conv
    outputs, a sigmoid), g [B, T, nv] fp32; state0 [B, nv, dk, dv] fp32, nonzero. The decay
    parameters are drawn as bench_shapes.py draws ssm_a_log (N(-2.5, 1.2)) and ssm_dt.bias
    (N(1, 0.1))."""

    def __init__(self, cfg: dict, B: int, T: int, device: str, seed: int):
        nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        gen = torch.Generator().manual_seed(seed)

        def randn(*shape):
            return torch.randn(*shape, generator=gen)

        bf16 = torch.bfloat16
        self.q, self.k = (F.silu(randn(B, T, nk, dk)).to(device, bf16) for _ in range(2))
        self.v = F.silu(randn(B, T, nv, dv)).to(device, bf16)
        self.beta = randn(B, T, nv).sigmoid().to(device, bf16)
        a_log, dt_bias = randn(nv) * 1.2 - 2.5, randn(nv) * 0.1 + 1.0
        self.g = (-a_log.exp() * F.softplus(randn(B, T, nv) + dt_bias)).to(device)
        self.state0 = (randn(B, nv, dk, dv) * 0.05).to(device)


def ours(x: Inputs, states: torch.Tensor, fp32: bool = False) -> torch.Tensor:
    """gated_delta_rule per sequence (states [B, nv, dk, dv] updated in place) -> o [B, T, nv, dv];
    fp32: on the same values in fp32 (the reference)."""
    cast = (lambda t: t.float()) if fp32 else (lambda t: t)
    return torch.stack([gated_delta_rule(cast(x.q[b]), cast(x.k[b]), cast(x.v[b]), x.g[b],
                                         cast(x.beta[b]), states[b])
                        for b in range(x.q.shape[0])])


def fla_call(fn, x: Inputs, state0: torch.Tensor):
    """fla's fn on x with fla's flags for our semantics (module docstring) -> (o, final state).
    g and beta by keyword: fused_recurrent's 5th and 6th positional arguments are gk and gv."""
    return fn(x.q, x.k, x.v, g=x.g, beta=x.beta, initial_state=state0, output_final_state=True,
              use_qk_l2norm_in_kernel=True)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def median_ms(call, device: str, warmup: int, repeats: int) -> float:
    """Median ms of call() over `repeats` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        call()
    sync(device)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            call()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_ms(call, calls: int, repeats: int) -> float:
    """Median ms per call of `calls` calls captured in one CUDA graph, over `repeats` replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (compiles, autotunes) outside the capture
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            call()
    return median_ms(g.replay, "cuda", 1, repeats) / calls


def max_diff(got, want) -> float:
    return float((got.float() - want.float()).abs().max())


def run_case(kind: str, B: int, T: int, cfg: dict, a, fla_fn) -> list:
    """Rows (case, impl, ms, max |do|, max |dstate|) of one case; the reference first. A part
    that raises gives a FAILED row saying why; the other parts and cases still run."""
    x = Inputs(cfg, B, T, a.device, a.seed)
    ref_state = x.state0.clone()
    ref_o = ours(x, ref_state, fp32=True)
    case = f"{kind} B={B} T={T}"
    rows = [(case, "(reference: max |o|, |state|)", None, float(ref_o.abs().max()),
             float(ref_state.abs().max()))]

    def attempt(impl, row):
        try:
            rows.append((case, impl, *row()))
        except Exception as e:
            rows.append((case, f"{impl} FAILED: {type(e).__name__}: {str(e)[:100]}", None, None,
                         None))

    def measured(call):  # -> (ms, max |do|, max |dstate|) of call(state0 copy) -> (o, state)
        o, st = call(x.state0.clone())
        do, ds = max_diff(o, ref_o), max_diff(st, ref_state)
        scratch = x.state0.clone()  # the timed calls advance a scratch state (ours)
        return median_ms(lambda: call(scratch), a.device, a.warmup, a.repeats), do, ds

    def graphed(call):
        scratch = x.state0.clone()
        return graph_ms(lambda: call(scratch), a.graph_calls, a.repeats), None, None

    def ours_call(state):
        return ours(x, state), state

    def fla_state_call(state):  # fla leaves `state` as it is and returns a new one
        return fla_call(fla_fn, x, state)

    graphs = kind == "decode" and a.device == "cuda" and a.graph_calls > 0
    impls = [("ours", ours_call)] + ([("fla", fla_state_call)] if fla_fn is not None else [])
    for impl, call in impls:
        attempt(impl, lambda: measured(call))
        if graphs and "FAILED" not in rows[-1][1]:
            attempt(f"{impl} (graph)", lambda: graphed(call))
    return rows


def fmt(v, spec):
    return format(v, spec) if v is not None else format("-", f">{spec.split('.')[0]}")


def main(argv=None) -> list:
    """Prints the table; returns its rows (case, impl, ms, max |do|, max |dstate|)."""
    a = parse_args(argv)
    cfg = shape_config(a.shape, tiny=a.tiny)
    # `ours` is the torch ops: the engine's gated_delta_rule would take fla's kernels on cuda in
    # bf16 where fla is installed; fla runs in its own rows here
    linear_attention.fla_for = lambda v: None
    chunk, recurrent, why = (None, None, "--no-fla: ours alone") if a.no_fla else load_fla(a.device)
    torch.manual_seed(a.seed)
    dev = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"# gated delta rule, {a.shape}{' (tiny)' if a.tiny else ''}: nk "
          f"{cfg['linear_num_key_heads']}, nv {cfg['linear_num_value_heads']}, dk "
          f"{cfg['linear_key_head_dim']}, dv {cfg['linear_value_head_dim']} | {dev} | torch "
          f"{torch.__version__} | median of {a.repeats} calls after {a.warmup}")
    if why:
        print(f"# {why}")
    else:
        import fla
        print(f"# fla {fla.__version__} ({fla.__file__})")
    print(f"{'case':<22} {'impl':<34} {'ms/call':>9} {'max|do|':>10} {'max|dstate|':>11}")
    cases = ([("prefill", 1, int(t), chunk) for t in a.prefill_lengths.split(",") if t]
             + [("decode", int(b), 1, recurrent) for b in a.decode_batches.split(",") if b])
    out = []
    for kind, B, T, fn in cases:
        for case, impl, ms, do, ds in run_case(kind, B, T, cfg, a, fn):
            print(f"{case:<22} {impl:<34} {fmt(ms, '9.3f')} {fmt(do, '10.2e')} "
                  f"{fmt(ds, '11.2e')}", flush=True)
            out.append((case, impl, ms, do, ds))
    return out


if __name__ == "__main__":
    main()
