"""Decode steps captured in CUDA graphs and replayed per token (cuda): one sequence's step, or
a batched step of B sequences (a token each, MoETransformer.forward_batch).

A decode step is a few hundred small kernels; launched one by one from Python their launch
cost is larger than their run time. DecodeGraphs captures the model's forward once per KV span
and replays it: the token and its position are copied into static inputs, the graphs run, the
logits come out of a static output. The expert side of the capture (each MoE layer planned on
the GPU, for one token or a batch; or the step cut so that the host plans it) is
experts/captured/graph_step.py.

KV span: a captured step cannot change shape, so attention runs over a fixed span of S positions
with a mask (StaticKV): S is the smallest power of two >= the tokens cached so far (at least
MIN_SPAN, at most a sequence's max tokens), and each new span is captured on first use. The
K/V are read and written through a static device page table (kv_cache.py's paging), so every
sequence shares the captured steps. A batched step is captured per (B, span), span covering its
longest row; row b reads its own StaticKV (position pos[b], page table row b).

Gated DeltaNet layers: each row of a captured step advances a static copy of a sequence's
recurrent state (StaticState); the sequence's StateCache is copied in before the replay (unless
the row still holds it as it was left) and out after it.

Not captured (the eager path runs): prefill chunks, dynamic rope scaling (its base depends on
the position on the host), route recording (--trace-out), the reference expert runtime.
"""
import time

import torch

MIN_SPAN = 256


class StaticKV:
    """A sequence's K/V as a captured step sees it: the new token's position is the device tensor
    `pos` [1], its flat slot is read from the device page table `page_table` [>= span / P]
    (static tensors the caller fills before each replay), and attention covers positions
    [0, span) with a mask. Stands in for SequenceKV in the model's forward (reserve / store /
    commit / attention_mask). kv: the SequenceKV the step runs on (its storage and page size;
    its page table is copied into page_table when none is given)."""

    def __init__(self, kv, pos: torch.Tensor, span: int, sliding_window=None, page_table=None):
        self.pages, self.pos, self.span, self.sliding_window = kv.pages, pos, span, sliding_window
        self.page_size = kv.page_size
        if page_table is None:
            page_table = torch.tensor(kv.table.page_table, dtype=torch.int64, device=pos.device)
        assert page_table.numel() * self.page_size >= span, "the page table does not cover the span"
        self.page_table = page_table
        self.positions = torch.arange(span, device=pos.device)  # [S]
        self.slot = None  # [1] the new token's flat slot, computed on the device by reserve
        self._span_slots = None  # [S] flat slots of positions [0, span), for the SDPA path

    def reserve(self, n: int) -> torch.Tensor:
        assert n == 1, "a captured step decodes one token"
        P = self.page_size
        self.slot = self.page_table[self.pos // P] * P + self.pos % P  # [1], inside the graph
        self._span_slots = None
        return self.pos

    def store(self, layer: int, start: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """k, v [1, KV, hd] into the new token's slot; returns the layer's keys, values
        [KV, slots, hd] (the whole storage: views, read through page_table)."""
        kv = self.pages.data[layer]  # [2, KV, slots, hd]
        kv[0].index_copy_(1, self.slot, k.transpose(0, 1))
        kv[1].index_copy_(1, self.slot, v.transpose(0, 1))
        return self.views(layer)

    def views(self, layer: int):
        """keys, values [KV, slots, hd] of `layer`: the whole storage (as store returns them),
        for a forward whose kernel writes the new token's k and v itself at `slot`
        (fused.qk_rope's cache argument)."""
        kv = self.pages.data[layer]  # [2, KV, slots, hd]
        return kv[0], kv[1]

    def gather(self, keys: torch.Tensor, values: torch.Tensor):
        """keys, values [KV, span, hd] in position order (copies through the page table)."""
        if self._span_slots is None:
            P = self.page_size
            self._span_slots = self.page_table[self.positions // P] * P + self.positions % P
        return keys.index_select(1, self._span_slots), values.index_select(1, self._span_slots)

    def attention_mask(self) -> torch.Tensor:
        """[1, span] bool: positions up to the new token's (and within the sliding window)."""
        mask = self.positions <= self.pos
        if self.sliding_window is not None:
            mask &= self.positions > self.pos - self.sliding_window
        return mask[None, :]

    def commit(self, n: int) -> None:
        pass  # the caller commits to the sequence's SequenceKV after the replay


class StaticState:
    """A captured step's row of recurrent state: the StateCache layout (conv, recurrent) at
    fixed addresses. The graphs copy a sequence's state in and out (DecodeGraphs)."""

    def __init__(self, template):
        self.index = template.index
        self.conv = torch.zeros_like(template.conv)
        self.recurrent = torch.zeros_like(template.recurrent)

    def layer(self, layer: int):
        j = self.index[layer]
        return self.conv[j], self.recurrent[j]

    def commit(self, n: int) -> None:  # the sequence's StateCache counts (DecodeGraphs)
        pass


def unsupported_reason(model, runtime, device) -> str:
    """Why decode steps of this model cannot be captured, or '' when they can."""
    if torch.device(device).type != "cuda":
        return "not on cuda"
    if model.config.is_mla:  # TODO(#34): capture it once a GPU has checked it against eager
        return "multi-head latent attention (its decode step is not captured in graphs yet)"
    if getattr(model.rotary, "is_dynamic", False):
        return "dynamic rope scaling (its base is computed on the host from the position)"
    if not hasattr(runtime, "decode_graph_step"):
        return f"the expert runtime {type(runtime).__name__} has no captured step"
    return ""


class DecodeGraphs:
    """forward(token [1] int64 on the device, kv: SequenceKV) -> logits [1, V] fp32 for the next
    position of kv's sequence; appends the token to kv like model(token, position, kv).
    forward_batch(tokens [B], kvs) does it for B sequences at once (B <= max_batch). Every
    sequence of at most max_tokens tokens on `pages` shares the graphs: its page table is
    copied into a static one when it changed. `runtime` is the ExpertRuntime (the model's
    expert_runtime may be a proxy around it that sees begin_step)."""

    def __init__(self, model, pages, max_tokens: int, runtime, device, max_batch: int = 1,
                 state=None):
        """state: a StateCache of the model (linear-attention layers; its layout is copied for
        the static rows), else None."""
        self.model, self.pages, self.device = model, pages, torch.device(device)
        self.states = [StaticState(state) for _ in range(max_batch)] if state is not None else None
        self.state_on_device = [None] * max_batch  # per row: (StateCache, its version) held
        self.page_size = pages.page_size
        self.max_tokens, self.max_batch = max_tokens, max_batch
        self.runtime = runtime
        self.step = runtime.decode_graph_step()
        self.ids = torch.zeros(max_batch, dtype=torch.int64, device=self.device)  # static inputs
        self.pos = torch.zeros(max_batch, dtype=torch.int64, device=self.device)
        num_pages = -(-max_tokens // pages.page_size)
        self.page_table = torch.zeros(max_batch, num_pages, dtype=torch.int64, device=self.device)
        self.table_on_device = [None] * max_batch  # per row: (table object, its length) copied in
        self.captured = {}  # (B, span) -> (segments, static logits, [StaticKV] per row)
        self.side = torch.cuda.Stream(self.device)
        self.capture_s = 0.0  # seconds in the spans' first steps (the inline step + the capture)
        self.captures = 0  # steps captured so far (a resize that keeps them adds none)
        self.min_span = MIN_SPAN

    def release(self) -> None:
        """Drop every captured step and the expert step (before the expert cache is resized:
        they read its old slots); reset() after the resize makes them ready again."""
        self.captured.clear()
        self.table_on_device = [None] * self.max_batch
        self.step = None

    def reset(self) -> None:
        """After release() and the resize: each (B, span) is captured again on first use."""
        self.step = self.runtime.decode_graph_step()

    def span(self, num_tokens: int) -> int:
        s = self.min_span
        while s < num_tokens:
            s *= 2
        return min(s, self.max_tokens)

    def warm_spans(self) -> int:
        """Compiles the decode attention's kernels for every KV span a capture may take (span
        sets their block sizes: split_attention.decode_chunk), on scratch tensors; the captures
        themselves still come on first use. Without it the first step at a new span waits for
        Triton's compiler (1.4 s on the H200 at span 16384, docs/MEASUREMENTS.md#warm-up).
        Returns the variants compiled."""
        from .models import split_attention
        from .models.layers import Attention, _triton_decode_attention
        keys, values = self.pages.data[0][0], self.pages.data[0][1]  # [KV, slots, hd]
        seen, n = set(), 0
        table = torch.zeros_like(self.page_table[0])  # every position on page 0
        pos = torch.zeros(1, dtype=torch.int64, device=self.device)  # reads slot 0 only
        for att in (m for m in self.model.modules() if isinstance(m, Attention)):
            if att.window is not None or att.has_sinks or att.chunk is not None:
                continue  # those take the masked path (layers.Attention._attend_stored)
            q = torch.zeros(1, att.num_heads, att.head_dim, dtype=keys.dtype, device=self.device)
            if not _triton_decode_attention(q) or keys.shape[-1] != att.head_dim:
                continue
            span = self.span(1)  # the shortest (min_span, or the context when shorter)
            while True:
                key = (att.num_heads, att.head_dim, att.scale,
                       split_attention.decode_variant(span, keys.shape[0]))
                if key not in seen:
                    seen.add(key)
                    split_attention.decode_attention(q, keys, values, pos, span, att.scale,
                                                     pages=(table, self.page_size))
                    n += 1
                if span >= self.max_tokens:
                    break
                span = self.span(span + 1)
        torch.cuda.synchronize(self.device)
        return n

    def ready(self, kvs: list) -> bool:
        """Whether the next step of kvs' sequences replays a captured graph, without a capture
        (which a decode thread beside a prefill forward must not run: beside.Thread)."""
        return (len(kvs), self.span(max(kv.num_tokens for kv in kvs) + 1)) in self.captured

    @torch.inference_mode()
    def forward(self, token: torch.Tensor, kv, state=None) -> torch.Tensor:
        return self.forward_batch(token.reshape(1), [kv], None if state is None else [state])

    @torch.inference_mode()
    def forward_batch(self, tokens: torch.Tensor, kvs: list, states=None) -> torch.Tensor:
        """states: each row's StateCache (models with linear-attention layers), else None."""
        B = len(kvs)
        assert 0 < B <= self.max_batch and tokens.shape[0] == B
        assert (states is None) == (self.states is None), "states iff linear-attention layers"
        for b, st in enumerate(states or ()):
            assert st.num_tokens == kvs[b].num_tokens, "states and KV caches apart"
            if self.state_on_device[b] != (st, st.version):
                self.states[b].conv.copy_(st.conv)
                self.states[b].recurrent.copy_(st.recurrent)
        positions = []
        for b, kv in enumerate(kvs):
            assert kv.pages is self.pages and kv.max_tokens <= self.max_tokens
            positions.append(kv.reserve(1))
            self._copy_page_table(b, kv)
        self.ids[:B].copy_(tokens)
        if B == 1:  # the per-token path of one sequence: a fill, no host tensor to copy
            self.pos[:1].fill_(positions[0])
        else:
            self.pos[:B].copy_(torch.tensor(positions, dtype=torch.int64), non_blocking=True)
        key = (B, self.span(max(positions) + 1))
        self.model.expert_runtime.begin_step("decode", B)
        if key not in self.captured:  # this step runs inline, then the key is captured
            logits = self._first_step(key)
        else:
            segments, logits, _ = self.captured[key]
            self.step.replay(segments, B)
        for kv in kvs:
            kv.commit(1)
        for b, st in enumerate(states or ()):
            st.conv.copy_(self.states[b].conv)
            st.recurrent.copy_(self.states[b].recurrent)
            st.commit(1)
            self.state_on_device[b] = (st, st.version)
        return logits

    def _copy_page_table(self, b: int, kv) -> None:
        """kv's page table into row b of the static one, when it is another sequence's or has
        grown (a new page every page_size tokens)."""
        table = kv.table.page_table
        seen = self.table_on_device[b]
        if seen is not None and seen[0] is kv.table and seen[1] == len(table):
            return
        self.page_table[b, :len(table)].copy_(torch.tensor(table, dtype=torch.int64))
        self.table_on_device[b] = (kv.table, len(table))

    def _forward(self, B: int, rows: list):
        states = self.states[:B] if self.states is not None else None
        if B == 1:
            return self.model(self.ids[:1], self.pos[:1], rows[0], 1,
                              state=states[0] if states else None)
        return self.model.forward_batch(self.ids[:B], rows, states)

    def _first_step(self, key) -> torch.Tensor:
        """The step runs for real with the capture's structure (every lazy init, buffer and
        kernel choice happens here), then the same forward is captured (capture runs
        nothing), both on a side stream: graphs are captured off the default stream."""
        t0 = time.perf_counter()
        B, span = key
        window = self.model.config.sliding_window
        rows = [_static_row(self, b, span, window) for b in range(B)]
        main = torch.cuda.current_stream(self.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            self.step.begin("inline", T=B)
            try:
                logits = self._forward(B, rows).clone()
            finally:
                self.step.end()
            self.step.begin("capture", torch.cuda.graph_pool_handle(), T=B)
            try:
                captured = self._forward(B, rows)  # [B, V] fp32, a static output
            except BaseException:
                self.step.abort()
                raise
            # the StaticKVs go with the graphs: they read their slot numbers at every replay
            self.captured[key] = (self.step.end(), captured, rows)
        main.wait_stream(self.side)
        torch.cuda.synchronize(self.device)
        self.capture_s += time.perf_counter() - t0
        self.captures += 1
        return logits


def _static_row(graphs: DecodeGraphs, b: int, span: int, window) -> StaticKV:
    """Row b of a captured step: a StaticKV on the static position pos[b] and page table row b."""
    return StaticKV(graphs, graphs.pos[b:b + 1], span, window, graphs.page_table[b])
