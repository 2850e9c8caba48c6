"""PrefillChoice: per MoE layer of a prefill forward, stream the whole expert layer (stream.py)
or take the slot path (plan -> fills + CPU experts, as decode does), from a time model of both
fed by the measured bandwidths. Pure arithmetic over what it is shown; it moves nothing and
reads the cache only through the residency mask the runtime hands it.

Per layer: u distinct routed experts, h of them resident in the cache, m = u - h misses:

    stream(l) = E * s / B_P                 its copy is not issued (or was withdrawn)
              = what is left of its copy     issued ahead (stream.py: 0 once the copy is done)
    slot(l)   = max(gpu, cpu)                both paths at the split's bandwidths (split.py),
      gpu     = q * s / P  + min(left, q * s / P)   ... with the link shared with a copy of this
                                                    layer still in flight (sunk: below)
      cpu     = (m - q) * s / C  + r_cpu * f / F    ... plus the CPU's arithmetic
    stream the layer  iff  stream(l) <= slot(l)     (ties stream: it leaves the cache alone)

s: slot stride; E * s: the layer's bytes; q: the misses the hybrid split fills (MissSplit.decide,
exactly as the plan will); r_cpu: the routes of the m - q CPU experts (the plan fills the misses
with the most routes, so the CPU gets the rest); f: flops of one route (2 x gate, up, down);
F: the CPU experts' GFLOP/s with many tokens per expert (Tuning.prefill_cpu_gflops; default
DEFAULT_CPU_GFLOPS_PER_THREAD x the CPU threads). B_P: whole-layer pinned copies alone (Tuning.
prefill_stream_gbps; default the profile's one-slot copy alone, P_alone); P, C: the split's.
The F term matters: a prefill CPU expert has T*K/E tokens, and at 4 or more tokens it is
compute-bound (docs/MEASUREMENTS.md#prefill-choice), where the bandwidth model alone would
send an 8K prompt's misses to the CPU. On the cpu device the "device tier" is the CPU itself: every route costs the
same arithmetic on either path, so the F term is left out there.

Worked example (Qwen3-30B-A3B bf16, s = 9.44 MB, E = 128, B_P = P = 50, C = 90 GB/s, F = 600;
uniform routing, 32 of each layer's experts cached, no overlap credited): a 32-token chunk routes
105 experts, m = 77, q = 28: 49 CPU experts with 75 routes -> slot 6.3 ms < stream 24.2 ms; 256
tokens: m = 96, q = 34, 860 CPU routes -> 20.0 ms, still slot; 384 tokens: 1317 routes -> 27.2
ms: stream; 1024 tokens: 3711 routes -> 64.9 ms: stream. tests/test_prefill_choice.py checks
crossovers like these.

The copy of a layer that takes the slot path may already be issued: it is sunk, not undone
(stream.py skip: on cuda a queued copy cannot be withdrawn and the copies behind it wait for it
anyway, so letting it land is the cheapest; the cpu tier withdraws one that has not started). The
choice counts only what is still to pay: the copy's rest against the slot path slowed by sharing
the link with it. The copy of the layer N places later is then not issued ahead (predicted: the
slot path again); a later layer that streams anyway pays its whole copy, as its stream(l) said.

Per forward (forward_mode, from T alone): below prefill_stream_min_tokens nothing streams; when
even the worst chunk of T tokens (u = min(E, T*K) distinct experts, none cached, routes spread
evenly) takes the slot path against a full, unoverlapped copy, the forward streams nothing and
no copy is issued ("slot"); else "auto": the first copies are issued ahead and each layer
decides on its real counts. Tuning.prefill_choice "stream" / "slot" force either (the threshold
still applies to "stream").
"""
from dataclasses import dataclass

import numpy as np

from ...errors import ConfigError

CHOICES = ("auto", "stream", "slot")

# CPU expert GFLOP/s per pool thread with many tokens per expert, until measured (bench_prefill
# measures it; measured 2-core EPYC avx512bf16, bf16 2048x768, 64 tokens per expert: 88 GFLOP/s
# on 2 threads)
DEFAULT_CPU_GFLOPS_PER_THREAD = 40.0


@dataclass(frozen=True)
class LayerCost:
    """One layer's decision and what the model said (µs)."""
    layer: int
    distinct: int      # u: routed experts
    misses: int        # m: routed experts not resident
    filled: int        # q: misses the slot path would fill
    cpu_routes: int    # routes of the slot path's CPU experts
    stream_us: float   # what streaming would still cost (the copy left, or all of it)
    slot_us: float
    copy_us: float     # the layer's whole copy, E * s / B_P
    streamed: bool


class PrefillChoice:
    def __init__(self, mode: str, split, stream_gbps: float, cpu_gflops: float, top_k: int,
                 min_tokens: int, with_flops: bool = True):
        """split: the runtime's MissSplit (its q rule and bandwidths); with_flops False: no
        F term (the cpu device)."""
        if mode not in CHOICES:
            raise ConfigError(f"prefill_choice must be one of {', '.join(CHOICES)} (auto: per "
                              f"layer from the routed experts and the bandwidths), not {mode!r}")
        for name, v in (("prefill_stream_gbps", stream_gbps), ("prefill_cpu_gflops", cpu_gflops)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ConfigError(f"{name} must be a number > 0 (GB/s or GFLOP/s measured on "
                                  f"this machine; tools/bench_prefill.py prints both), not {v!r}")
        self.mode, self.split = mode, split
        self.stream_gbps, self.cpu_gflops = float(stream_gbps), float(cpu_gflops)
        self.top_k, self.min_tokens, self.with_flops = top_k, min_tokens, with_flops
        self.log = None  # [LayerCost] of the current forward when set to a list (the bench)
        self._modes = {}  # (T, infos id) -> forward mode

    # ---- the model ------------------------------------------------------------------------

    def copy_us(self, info) -> float:
        return info.num_experts * info.slot_stride / (self.stream_gbps * 1e3)

    def route_us(self, info) -> float:
        """µs of CPU arithmetic per route: 2 flops per weight of gate, up and down (their
        matrices; an expert's biases, 1-D, are noise beside them)."""
        if not self.with_flops:
            return 0.0
        flops = 2 * sum(p.shape[0] * p.shape[1] for p in getattr(info, "projections", ())
                        if len(p.shape) == 2)
        return flops / (self.cpu_gflops * 1e3)

    def slot_us(self, info, m: int, q: int, cpu_routes: float, left_us: float = 0.0) -> float:
        """µs of the slot path's expert phase on the layer `info`: q of m misses filled (sharing
        the link with left_us of a copy still in flight), m - q on the CPU with cpu_routes
        routes; each path at its concurrent rate while both run, else alone."""
        if m == 0:
            return 0.0
        bw, us = self.split.bw, info.slot_stride / 1e3  # µs per slot = us / GB/s
        fill = q * us / (bw.P_alone if q == m else bw.P)
        gpu = fill + min(left_us, fill)
        cpu = (m - q) * us / (bw.C_alone if q == 0 else bw.C) + cpu_routes * self.route_us(info)
        return max(gpu, cpu)

    # ---- decisions ------------------------------------------------------------------------

    def forward_mode(self, num_tokens: int, infos: dict, capacity: int) -> str:
        """'stream', 'slot' or 'auto' for a prefill forward of num_tokens tokens (docstring)."""
        if num_tokens < self.min_tokens or self.mode == "slot":
            return "slot"
        if self.mode == "stream":
            return "stream"
        key = (num_tokens, capacity)
        mode = self._modes.get(key)
        if mode is None:
            if len(self._modes) >= 4096:  # chunk lengths of a long-running server
                self._modes.clear()
            mode = "slot"
            for info in infos.values():
                R = num_tokens * self.top_k
                u = min(info.num_experts, R)
                q = self.split.decide(u, capacity)[0]
                worst = self.slot_us(info, u, q, R * (u - q) / u)
                if worst >= self.copy_us(info):
                    mode = "auto"
                    break
            self._modes[key] = mode
        return mode

    def choose(self, layer: int, info, counts: np.ndarray, resident: np.ndarray, capacity: int,
               left_us, mode: str) -> LayerCost:
        """The layer's decision. counts: int [E] routes per expert; resident: bool [E];
        left_us: µs left of the layer's copy (0: done), None when it was not issued; mode: the
        forward's ('stream' and 'slot' are kept, 'auto' decides)."""
        routed = counts > 0
        miss_counts = counts[routed & ~resident]
        m = len(miss_counts)
        h = int(routed.sum()) - m
        q = self.split.decide(m, capacity - h)[0]
        cpu_routes = int(np.sort(miss_counts)[::-1][q:].sum())
        copy = self.copy_us(info)
        stream = copy if left_us is None else left_us
        slot = self.slot_us(info, m, q, cpu_routes, left_us or 0.0)
        streamed = mode == "stream" or (mode == "auto" and stream <= slot)
        cost = LayerCost(layer, h + m, m, q, cpu_routes, stream, slot, copy, streamed)
        if self.log is not None:
            self.log.append(cost)
        return cost

    def describe(self) -> str:
        f = f", F = {self.cpu_gflops:.4g} GFLOP/s" if self.with_flops else ""
        return (f"prefill {self.mode}: B_P = {self.stream_gbps:.4g} GB/s{f}, streams from "
                f"{self.min_tokens} tokens")
