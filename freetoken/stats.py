"""Timing, prefix-cache and expert counters of one generation, and their llama.cpp-style
summary lines.

The engine fills GenerationStats with wall-clock stamps at token boundaries (each already a host
sync); nothing here runs inside the token loop except those assignments.
"""
import time
from dataclasses import dataclass, field
from typing import Optional

GB = 1e9


@dataclass
class GenerationStats:
    """Seconds are wall-clock (time.perf_counter). decode counts forward+sample cycles after the
    first token, so decode tok/s = num_decoded / decode_s."""
    load_s: float = 0.0
    num_prompt_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0  # generate() called -> first token id on the host
    num_decoded: int = 0
    decode_s: float = 0.0
    num_generated: int = 0  # tokens sampled, EOS included
    stop_reason: str = ""  # eos | stop | length | context | interrupted
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (not prefilled)
    num_prefill_forwards: int = 0  # model forwards (chunks) that prefilled the rest
    kv: Optional["KVSnapshot"] = None  # the KV pool and prefix cache as the request ended
    experts: dict = field(default_factory=dict)  # the expert runtime's counters for this generation
    split: Optional[str] = None  # how the hybrid miss split was set (profile or defaults)
    logprobs: list = field(default_factory=list)  # per sampled token, when params.logprobs asked
    device: str = ""
    t_start: float = field(default_factory=time.perf_counter, repr=False)

    @property
    def num_prefilled(self) -> int:
        """Prompt tokens forwarded (those not taken from the prefix cache)."""
        return self.num_prompt_tokens - self.cached_tokens

    @property
    def prefill_tok_s(self) -> float:
        return self.num_prefilled / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.num_decoded / self.decode_s if self.decode_s > 0 else 0.0

    def lines(self, detail: bool = False) -> list:
        """The summary printed to stderr at the end of `freetoken run`."""
        out = [f"load time      = {self.load_s * 1e3:10.2f} ms",
               _rate("prompt eval", self.prefill_s, self.num_prefilled, "tokens"),
               f"time to first  = {self.ttft_s * 1e3:10.2f} ms (TTFT)",
               _rate("eval", self.decode_s, self.num_decoded, "runs  "),
               f"stopped by     = {self.stop_reason or '-'} after {self.num_generated} tokens"]
        if self.kv is not None:
            out += self.kv.lines()
        out += expert_lines(self.experts, self.split, detail)
        return [f"freetoken: {line}" for line in out]


@dataclass
class KVSnapshot:
    """One request's prefix-cache numbers and the page pool as it ended (before its release)."""
    prefix_cache: bool
    num_prompt_tokens: int
    cached_tokens: int
    num_requests: int  # so far, this one included
    total_prompt_tokens: int
    total_cached_tokens: int
    pages_in_use: int  # held by running sequences (this one included)
    pages_evictable: int  # held only by the prefix cache
    pages_free: int
    num_pages: int
    page_size: int
    num_states: int = 0  # recurrent-state snapshots kept at anchors (hybrid models)
    state_bytes: int = 0  # their bytes
    state_budget: int = 0  # their budget in bytes (0: no states are kept)

    @property
    def hit_rate(self) -> float:
        """Cached / prompt tokens over every request so far."""
        total = self.total_prompt_tokens
        return self.total_cached_tokens / total if total else 0.0

    def lines(self) -> list:
        out = []
        if self.prefix_cache:
            n = self.num_prompt_tokens
            pct = 100.0 * self.cached_tokens / n if n else 0.0
            out.append(f"prompt cache   = {self.cached_tokens} of {self.num_prompt_tokens} prompt "
                       f"tokens cached ({pct:.1f}%); hit rate {100.0 * self.hit_rate:.1f}% over "
                       f"{self.num_requests} requests")
        out.append(f"KV pages       = {self.pages_in_use} in use, {self.pages_evictable} cached, "
                   f"{self.pages_free} free of {self.num_pages} ({self.page_size} tokens each)")
        if self.state_budget:
            out.append(f"KV states      = {self.num_states} kept at anchors, "
                       f"{self.state_bytes / 1e6:.1f} MB of {self.state_budget / 1e6:.1f} MB")
        return out


class KVStats:
    """Prefix-cache counters over an engine's requests."""

    def __init__(self):
        self.num_requests = self.prompt_tokens = self.cached_tokens = 0

    def request(self, num_prompt_tokens: int, cached_tokens: int, manager) -> KVSnapshot:
        """Counts one request; manager: the engine's kv.manager.KVManager, read only."""
        self.num_requests += 1
        self.prompt_tokens += num_prompt_tokens
        self.cached_tokens += cached_tokens
        pool, evictable, radix = manager.pool, manager.num_evictable_pages, manager.radix
        states = (radix.num_states, radix.num_state_bytes, radix.state_budget or 0) \
            if radix is not None and manager.needs_state else (0, 0, 0)
        return KVSnapshot(radix is not None, num_prompt_tokens, cached_tokens,
                          self.num_requests, self.prompt_tokens, self.cached_tokens,
                          pool.num_used - evictable, evictable, pool.num_free, pool.num_pages,
                          pool.page_size, *states)


def _rate(name: str, seconds: float, n: int, unit: str) -> str:
    ms = seconds * 1e3
    per = ms / n if n else 0.0
    tps = n / seconds if seconds > 0 else 0.0
    return (f"{name:<14} = {ms:10.2f} ms / {n:5d} {unit} ({per:8.2f} ms per token, "
            f"{tps:8.2f} tokens per second)")


def expert_lines(s: dict, split: Optional[str], detail: bool) -> list:
    """Cache hit rate, bytes filled, CPU experts; every raw counter too when `detail`."""
    if not s:
        return []
    hits, misses = s.get("hits", 0), s.get("misses", 0)
    rate = 100.0 * hits / (hits + misses) if hits + misses else 0.0
    filled = s.get("bytes_filled", 0) / GB
    behind = s.get("fills_behind", 0)  # admissions: CPU-run misses also copied in, for later
    fills = f"{s.get('fills', 0)} fills" + (f", {behind} of them admissions" if behind else "")
    lines = [f"expert cache   = {rate:5.1f}% hit rate ({hits} hits, {misses} misses), "
             f"{filled:.4f} GB filled ({fills}), "
             f"{s.get('cpu_experts', 0)} experts run on the CPU ({s.get('cpu_routes', 0)} routes)"]
    if s.get("prefill_layers_streamed"):
        lines.append(f"prefill stream = {s['bytes_streamed'] / GB:.4f} GB in "
                     f"{s['prefill_layers_streamed']} expert layers")
    if split:
        lines.append(f"miss split     = {split}")
    if detail:
        lines.append("expert stats   = " + ", ".join(f"{k}={_num(v)}" for k, v in sorted(s.items())))
    return lines


def _num(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)
