"""Decode steps captured in CUDA graphs and replayed per token (cuda, one token per step).

A decode step is a few hundred small kernels; launched one by one from Python their launch
cost is larger than their run time. DecodeGraphs captures the model's forward once per KV span
and replays it: the token and its position are copied into static inputs, the graphs run, the
logits come out of a static output. The expert side of the capture (where the step is cut so
that the host can plan each MoE layer) is experts/captured/graph_step.py.

KV span: a captured step cannot change shape, so attention runs over a fixed span of S cache
slots with a mask (StaticKV): S is the smallest power of two >= the tokens cached so far
(at least MIN_SPAN, at most the KV cache), and each new span is captured on first use.

Not captured (the eager path runs): prefill chunks, dynamic rope scaling (its base depends on
the position on the host), route recording (--trace-out), the reference expert runtime, models with
Gated DeltaNet layers (their per-sequence state is not captured yet; engine.py says so in the run
line).
"""
import time

import torch

MIN_SPAN = 256


class StaticKV:
    """The KV cache as a captured step sees it: the new token's slot is the device tensor
    `pos` [1], and attention covers slots [0, span) with a mask. Stands in for KVCache in the
    model's forward (reserve / store / commit / attention_mask; views)."""

    def __init__(self, kv, pos: torch.Tensor, span: int, sliding_window=None):
        self.kv, self.pos, self.span, self.sliding_window = kv, pos, span, sliding_window
        self.slots = torch.arange(span, device=pos.device)  # [S]

    def reserve(self, n: int) -> torch.Tensor:
        assert n == 1, "a captured step decodes one token"
        return self.pos

    def store(self, layer: int, start: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """k, v [1, KV, hd] into slot `start`; returns keys, values [KV, span, hd] (views)."""
        kv = self.kv.data[layer]  # [2, KV, max, hd]
        kv[0].index_copy_(1, start, k.transpose(0, 1))
        kv[1].index_copy_(1, start, v.transpose(0, 1))
        return self.views(layer)

    def views(self, layer: int):
        """keys, values [KV, span, hd] of `layer` (views, as store returns them) for a forward
        whose kernel writes the new token's k and v itself (fused.qk_rope's cache argument)."""
        kv = self.kv.data[layer]  # [2, KV, max, hd]
        return kv[0, :, :self.span], kv[1, :, :self.span]

    def attention_mask(self) -> torch.Tensor:
        """[1, span] bool: slots up to the new token's (and within the sliding window)."""
        mask = self.slots <= self.pos
        if self.sliding_window is not None:
            mask &= self.slots > self.pos - self.sliding_window
        return mask[None, :]

    def commit(self, n: int) -> None:
        pass  # the caller commits to the real KVCache after the replay


def unsupported_reason(model, runtime, device) -> str:
    """Why decode steps of this model cannot be captured, or '' when they can."""
    if torch.device(device).type != "cuda":
        return "not on cuda"
    if getattr(model.rotary, "is_dynamic", False):
        return "dynamic rope scaling (its base is computed on the host from the position)"
    if not hasattr(runtime, "decode_graph_step"):
        return f"the expert runtime {type(runtime).__name__} has no captured step"
    return ""


class DecodeGraphs:
    """forward(token [1] int64 on the device) -> logits [1, V] fp32 for the next KV slot;
    appends the token to kv like model(token, position, kv). `runtime` is the ExpertRuntime
    (the model's expert_runtime may be a proxy around it that sees begin_step)."""

    def __init__(self, model, kv, runtime, device):
        self.model, self.kv, self.device = model, kv, torch.device(device)
        self.step = runtime.decode_graph_step()
        self.ids = torch.zeros(1, dtype=torch.int64, device=self.device)  # static inputs
        self.pos = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.captured = {}  # span -> (segments, static logits, StaticKV)
        self.side = torch.cuda.Stream(self.device)
        self.capture_s = 0.0  # seconds in the spans' first steps (the inline step + the capture)
        self.min_span = MIN_SPAN

    def span(self, num_tokens: int) -> int:
        s = self.min_span
        while s < num_tokens:
            s *= 2
        return min(s, self.kv.max_tokens)

    @torch.inference_mode()
    def forward(self, token: torch.Tensor) -> torch.Tensor:
        pos = self.kv.reserve(1)
        self.ids.copy_(token.reshape(1))
        self.pos.fill_(pos)
        span = self.span(pos + 1)
        self.model.expert_runtime.begin_step("decode", 1)
        if span not in self.captured:  # this step runs inline, then the span is captured
            logits = self._first_step(span)
        else:
            segments, logits, _ = self.captured[span]
            self.step.replay(segments)
        self.kv.commit(1)
        return logits

    def _first_step(self, span: int) -> torch.Tensor:
        """The step runs for real with the capture's structure (every lazy init, buffer and
        kernel choice happens here), then the same forward is captured (capture runs
        nothing), both on a side stream: graphs are captured off the default stream."""
        t0 = time.perf_counter()
        kv = StaticKV(self.kv, self.pos, span, self.model.config.sliding_window)
        main = torch.cuda.current_stream(self.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            self.step.begin("inline")
            try:
                logits = self.model(self.ids, self.pos, kv, 1).clone()
            finally:
                self.step.end()
            self.step.begin("capture", torch.cuda.graph_pool_handle())
            try:
                captured = self.model(self.ids, self.pos, kv, 1)  # [1, V] fp32, a static output
            except BaseException:
                self.step.abort()
                raise
            # the StaticKV goes with the graphs: they read its slot numbers at every replay
            self.captured[span] = (self.step.end(), captured, kv)
        main.wait_stream(self.side)
        torch.cuda.synchronize(self.device)
        self.capture_s += time.perf_counter() - t0
        return logits
