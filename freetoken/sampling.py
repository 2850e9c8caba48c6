"""Token sampling: SamplingParams (validated, frozen) and sample(logits, params, generator, prev).

Knows nothing of the model or tokenizer. Order of the logit transforms, as in HF generate:
repetition penalty -> temperature -> top-k -> top-p -> min-p -> draw. temperature == 0 is greedy.
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch

from .errors import ConfigError

NEG_INF = float("-inf")
TINY = torch.finfo(torch.float32).tiny  # keeps 0 / noise finite
MAX_LOGPROBS = 20  # the most alternatives token_logprobs reports (OpenAI's limit)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. Every field has a `freetoken run` option, named in errors.

    top_k = 0, top_p = 1, min_p = 0 and repetition_penalty = 1 switch that transform off.
    seed None draws a fresh seed per generation; an int makes generation reproducible.
    logprobs None computes none; k (0..20) reports each sampled token's log-probability and the
    k most likely tokens' (token_logprobs), from the model's logits before any transform.
    ignore_eos: an EOS id is sampled and yielded like any token instead of ending the generation,
    so exactly max_tokens come unless the context fills (fixed-length runs: `freetoken bench`).
    """
    max_tokens: int = 256
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    stop: tuple = ()
    logprobs: Optional[int] = None
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        _check_int("max_tokens (-n)", self.max_tokens, 1, ">= 1")
        _check_float("temperature (--temp)", self.temperature, self.temperature >= 0,
                     ">= 0 (0 = greedy)")
        _check_int("top_k (--top-k)", self.top_k, 0, ">= 0 (0 = off)")
        _check_float("top_p (--top-p)", self.top_p, 0 < self.top_p <= 1, "in (0, 1] (1 = off)")
        _check_float("min_p (--min-p)", self.min_p, 0 <= self.min_p <= 1, "in [0, 1] (0 = off)")
        _check_float("repetition_penalty (--repeat-penalty)", self.repetition_penalty,
                     self.repetition_penalty > 0, "> 0 (1 = off)")
        if self.seed is not None:
            _check_int("seed (--seed)", self.seed, 0, "an integer in [0, 2**63)")
            if self.seed >= 2 ** 63:
                raise ConfigError(f"seed (--seed) must be an integer in [0, 2**63), not {self.seed}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, "an integer in [0, 20]")
            if self.logprobs > MAX_LOGPROBS:
                raise ConfigError(f"logprobs must be an integer in [0, 20], not {self.logprobs}")
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"ignore_eos must be true or false, not {self.ignore_eos!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ConfigError(f"stop strings (--stop) must be non-empty text, not {s!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def _check_int(name, value, low, valid):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be {valid}, not {value!r}")


def _check_float(name, value, in_range, valid):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not in_range:
        raise ConfigError(f"{name} must be {valid}, not {value!r}")


def make_generator(seed: Optional[int], device) -> torch.Generator:
    """A torch.Generator on `device`, seeded with `seed` (or a fresh random seed when None)."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def apply_repetition_penalty(logits: torch.Tensor, prev_tokens: torch.Tensor, penalty: float):
    """HF semantics: for every token id seen before, logit / p if positive, else logit * p."""
    seen = logits.gather(-1, prev_tokens)
    seen = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits.scatter(-1, prev_tokens, seen)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (-inf) on logits [V]; always keeps the top token."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of strictly better tokens
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, NEG_INF)
    if params.min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), NEG_INF)
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
           prev_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Next token id as a 0-d int64 tensor on logits' device. logits [V] fp32; prev_tokens [N] int64.

    Never reads a value back to the host: the caller decides when to sync.
    """
    logits = logits.float()
    if params.repetition_penalty != 1 and prev_tokens is not None and prev_tokens.numel():
        logits = apply_repetition_penalty(logits, prev_tokens, params.repetition_penalty)
    if params.is_greedy:
        return torch.argmax(logits, dim=-1)
    probs = torch.softmax(filter_logits(logits, params), dim=-1)
    # Exponential race: argmax(p / Exp(1)) draws from p with no host sync (torch.multinomial syncs).
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator).clamp_min_(TINY)
    return torch.argmax(probs / noise, dim=-1)


def token_logprobs(logits: torch.Tensor, token_id: int, k: int) -> tuple:
    """(log-probability of token_id, [(id, log-probability)] of the k most likely tokens, best
    first) under log_softmax(logits [V]). Reads back to the host: call only when asked."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logp, k) if k else None
    chosen = float(logp[token_id])
    return chosen, list(zip(top.indices.tolist(), top.values.tolist())) if k else []
