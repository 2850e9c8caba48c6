"""The decoder skeleton every supported family shares: embedding -> blocks (pre-norm attention,
pre-norm MoE or dense MLP) -> final norm -> output head (or the tied embedding). A family file
subclasses MoETransformer and names its MoE block, and where it differs its norm, its token
mixer per layer (the hybrid families: Gated DeltaNet layers, gated attention; deepseek: MLA),
its block and its head (granitemoe: scaled outputs and logits).

Shape legend: T tokens of this forward, D hidden, V vocabulary.
"""
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelError
from .layers import Attention, DenseMLP, Embedding, Linear, RMSNorm, attention_mask
from .rope import Rotary

# Containers inside a block whose attribute names are already the canonical FTW suffixes:
# parameter path blk.{i}.attn.attn_q.weight <-> canonical name blk.{i}.attn_q.weight.
_CONTAINERS = ("attn", "ffn")


@dataclass
class Step:
    """What every layer of one forward shares; built once per forward in MoETransformer.forward."""
    start: Any  # first KV-cache slot of this forward's tokens: an int, or a [1] int64 device
                # tensor in a captured decode step (graphs.StaticKV)
    cos: torch.Tensor  # [T, 1, hd]
    sin: torch.Tensor  # [T, 1, hd], first half negated (rope.apply_rotary)
    mask: Any  # [T, S] bool, "causal" or None (see layers.attention_mask); [1, S] from StaticKV
    kv_cache: Any
    experts: Any  # ExpertRuntime
    state: Any = None  # the sequence's StateCache (linear-attention layers), else None
    between: Any = None  # between(layer) after each block: other work run inside this forward
    snapshots: tuple = ()  # StateSnapshots the linear-attention layers fill (see forward)


@dataclass
class BatchStep:
    """One forward of B sequences: a decode step, one token each (MoETransformer.forward_batch),
    or a packed prefill, a chunk each (forward_packed: `bounds` set). The position-wise layers
    (norms, MLPs, the MoE block: one expert step for all the tokens, so a streamed prefill moves
    each layer's experts once for every chunk) run on all rows at once; a token mixer runs per
    sequence, each on its own Step in `rows`, unless (decode) it has forward_rows(x, layer, step)
    (Attention: the projections batched)."""
    rows: list  # [B] Step: sequence b's start, cos/sin, mask, KV and state
    cos: Any  # decode: [B, 1, hd], the rows' cos/sin stacked; packed: None (each row's own)
    sin: Any
    experts: Any
    bounds: Optional[list] = None  # packed: sequence b's tokens are x[bounds[b]:bounds[b + 1]]
    between: Any = None  # as Step.between


def mix_rows(mixer: nn.Module, x: torch.Tensor, layer: int, step: BatchStep) -> torch.Tensor:
    """A token mixer over a BatchStep's rows x [T, D] -> [T, D]."""
    if step.bounds is not None:
        b = step.bounds
        return torch.cat([mixer(x[b[i]:b[i + 1]], layer, row) for i, row in enumerate(step.rows)])
    forward_rows = getattr(mixer, "forward_rows", None)
    if forward_rows is not None:
        return forward_rows(x, layer, step)
    return torch.cat([mixer(x[b:b + 1], layer, row) for b, row in enumerate(step.rows)])


def _check_config(c) -> None:
    """ModelError for a config no model of this package can be built from."""
    problems = []
    if c.hidden_act != "silu":
        problems.append(f"activation {c.hidden_act!r} is not supported (only silu)")
    if c.num_kv_heads < 1 or c.num_heads % c.num_kv_heads:
        problems.append(f"num_heads {c.num_heads} is not a multiple of num_kv_heads {c.num_kv_heads}")
    if c.head_dim % 2:
        problems.append(f"head_dim {c.head_dim} is odd (rotary needs pairs)")
    elif c.rotary_dim % 2 or not 0 < c.rotary_dim <= c.head_dim:
        problems.append(f"{c.rotary_dim} rotary dims of head_dim {c.head_dim} (partial_rotary_factor "
                        f"{c.partial_rotary_factor}): rotary needs pairs")
    if not 1 <= c.num_experts_per_tok <= c.num_experts:
        problems.append(f"num_experts_per_tok {c.num_experts_per_tok} is not within 1..{c.num_experts}")
    bad = [i for i in c.moe_layers if not 0 <= i < c.num_layers]
    if bad:
        problems.append(f"moe_layers {bad} are outside 0..{c.num_layers - 1}")
    if problems:
        raise ModelError(f"the model's config cannot be run: {'; '.join(problems)}; "
                         "re-convert it with this version of `freetoken convert`")


class Block(nn.Module):
    def __init__(self, config, layer: int, moe_block, mixer: nn.Module, norm=RMSNorm):
        super().__init__()
        self.layer = layer
        self.attn_norm = norm(config.hidden_size, config.rms_norm_eps)
        self.attn = mixer  # attention, or the family's other token mixer for this layer
        self.ffn_norm = norm(config.hidden_size, config.rms_norm_eps)
        if config.is_moe_layer(layer):
            self.ffn = moe_block(config)
        else:
            self.ffn = DenseMLP(config.hidden_size, config.intermediate_size)

    def forward(self, h: torch.Tensor, step: Step, pending=None):
        """h [T, D] the residual stream and pending [T, D] (or None) the previous block's MLP
        output not yet added to it -> (h, pending) alike: this block's output is h + pending.
        Deferring the add lets it share a kernel with the next norm on cuda (add_forward)."""
        h, x = self.attn_norm.add_forward(h, pending)
        mixed = (mix_rows(self.attn, x, self.layer, step) if isinstance(step, BatchStep)
                 else self.attn(x, self.layer, step))
        h, x = self.ffn_norm.add_forward(h, mixed)
        return h, self.ffn(x, self.layer, step)


class MoETransformer(nn.Module):
    """model(input_ids [T] int64, positions [T] int64, kv_cache[, num_logits]) -> logits [T, V] fp32.
    Appends the T tokens to kv_cache; calls expert_runtime.begin_step once per forward.
    NOTE: expert_runtime must not be an nn.Module (its weights are not model parameters)."""

    moe_block = None  # the family's MoEBlock subclass
    block = Block  # the decoder block (granitemoe: its outputs scaled)
    output_bias_with_qkv = True  # attention_bias also gives attn_output a bias (not qwen2_moe)
    norm = RMSNorm  # every RMSNorm of the blocks and the output norm

    def __init__(self, config, expert_runtime):
        super().__init__()
        _check_config(config)
        self.config = config
        self.expert_runtime = expert_runtime
        self.token_embd = Embedding(config.vocab_size, config.hidden_size)
        self.blk = nn.ModuleList(self.block(config, i, self.moe_block, self.mixer(config, i), self.norm)
                                 for i in range(config.num_layers))
        self.output_norm = self.norm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.output = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(config)

    def mixer(self, config, layer: int) -> nn.Module:
        """The token mixer of `layer`: GQA attention here; hybrid families override it."""
        return Attention(config, config.attention_bias and self.output_bias_with_qkv)

    def canonical_names(self) -> dict:
        """{canonical FTW tensor name: parameter path} of every parameter of the model."""
        names = {}
        for path in dict(self.named_parameters()):
            parts = path.split(".")
            if parts[0] == "blk" and parts[2] in _CONTAINERS:
                del parts[2]
            names[".".join(parts)] = path
        return names

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache,
                num_logits: Optional[int] = None, state=None, between=None,
                snapshots=()) -> torch.Tensor:
        """num_logits: compute logits only for the last num_logits tokens (None: all T); a
        prefill chunk only needs its last row, and [T, V] fp32 is large for real vocabularies.
        state: the sequence's StateCache (state_cache.py) when the model has linear-attention
        layers; it must hold exactly the tokens kv_cache holds, and is advanced with it.
        between: None, or between(layer) called after each block (the scheduler's decode steps
        beside a prefill forward: they must leave this forward's state as they found it).
        snapshots: empty StateSnapshots of state (state.snapshots_at), sorted, each after a token
        of this forward: each gets the state after its num_tokens, taken inside this forward."""
        T = input_ids.shape[0]
        start = kv_cache.reserve(T)
        if self.config.linear_layers:
            if state is None:
                raise ModelError("this model has linear-attention layers: pass the sequence's "
                                 "StateCache (state_cache.create_state_cache) as state")
            assert isinstance(start, torch.Tensor) or state.num_tokens == start, \
                (state.num_tokens, start)  # reset with the KV cache, never apart
        ends = [s.num_tokens for s in snapshots]
        assert not ends or (state is not None and ends == sorted(set(ends))
                            and start < ends[0] and ends[-1] <= start + T), (ends, start, T)
        self.expert_runtime.begin_step("prefill" if T > 1 else "decode", T)
        h = self.token_embd(input_ids)  # [T, D]
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        if isinstance(start, torch.Tensor):  # a captured decode step: the KV view masks a fixed span
            mask = kv_cache.attention_mask()
        else:
            mask = attention_mask(start, T, self.config.sliding_window, h.device)
        step = Step(start, cos, sin, mask, kv_cache, self.expert_runtime, state, between,
                    tuple(snapshots))
        logits = self._blocks_and_head(h, step, num_logits)
        kv_cache.commit(T)
        if state is not None:
            state.commit(T)
        return logits

    def forward_batch(self, input_ids: torch.Tensor, kv_caches: list, states=None) -> torch.Tensor:
        """One decode step of B sequences: input_ids [B] int64, token b appended to sequence b
        (kv_caches[b], and states[b] when the model has linear-attention layers) at its next
        position -> logits [B, V] fp32. Row b's logits equal model(input_ids[b:b+1], ...) on
        sequence b alone; the MoE layers run one expert step for the B tokens."""
        B = input_ids.shape[0]
        assert len(kv_caches) == B > 0
        starts = [kv.reserve(1) for kv in kv_caches]
        if states is None:
            states = [None] * B
        static = torch.is_tensor(starts[0])  # a captured step: each row a graphs.StaticKV
        if self.config.linear_layers:
            if any(s is None for s in states):
                raise ModelError("this model has linear-attention layers: pass each sequence's "
                                 "StateCache as states")
            assert static or [s.num_tokens for s in states] == starts, "states and KV caches apart"
        self.expert_runtime.begin_step("decode", B)
        h = self.token_embd(input_ids)  # [B, D]
        device = h.device
        if static:
            positions = torch.cat(starts)
        else:
            positions = torch.tensor(starts, dtype=torch.int64).to(device, non_blocking=True)
        if self.rotary.is_dynamic:  # the base depends on each row's own position
            rows = [self.rotary.cos_sin(positions[b:b + 1], h.dtype) for b in range(B)]
            cos, sin = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        else:
            cos, sin = self.rotary.cos_sin(positions, h.dtype)  # [B, 1, hd] x2
        window = self.config.sliding_window
        masks = ([kv.attention_mask() for kv in kv_caches] if static
                 else [attention_mask(start, 1, window, device) for start in starts])
        rows = [Step(start, cos[b:b + 1], sin[b:b + 1], mask, kv, self.expert_runtime, state)
                for b, (start, mask, kv, state) in enumerate(zip(starts, masks, kv_caches, states))]
        logits = self._blocks_and_head(h, BatchStep(rows, cos, sin, self.expert_runtime), None)
        for kv, state in zip(kv_caches, states):
            kv.commit(1)
            if state is not None:
                state.commit(1)
        return logits

    def forward_packed(self, chunks: list, kv_caches: list, states=None, between=None,
                       snapshots=None) -> torch.Tensor:
        """One prefill forward of B sequences' chunks: chunks[b] [T_b] int64 appended to sequence
        b (kv_caches[b], and states[b] with linear-attention layers) at its next positions ->
        logits [B, V] fp32 of each chunk's last token. Row b equals the last row of
        model(chunks[b], ...) on sequence b alone; each MoE layer runs one expert step over all
        the tokens (a streamed prefill moves its experts once). between: as forward's;
        snapshots: per sequence, forward's snapshots of its state (None: none)."""
        B = len(chunks)
        assert len(kv_caches) == B > 0
        lens = [int(c.shape[0]) for c in chunks]
        starts = [kv.reserve(n) for kv, n in zip(kv_caches, lens)]
        states = [None] * B if states is None else states
        if self.config.linear_layers:
            if any(s is None for s in states):
                raise ModelError("this model has linear-attention layers: pass each sequence's "
                                 "StateCache as states")
            assert [s.num_tokens for s in states] == starts, "states and KV caches apart"
        T = sum(lens)
        self.expert_runtime.begin_step("prefill" if T > 1 else "decode", T)
        h = self.token_embd(torch.cat(chunks))  # [T, D]
        snapshots = [()] * B if snapshots is None else snapshots
        rows, bounds = [], [0]
        for start, n, kv, state, snaps in zip(starts, lens, kv_caches, states, snapshots):
            ends = [s.num_tokens for s in snaps]
            assert not ends or (state is not None and ends == sorted(set(ends))
                                and start < ends[0] and ends[-1] <= start + n), (ends, start, n)
            cos, sin = self.rotary.cos_sin(torch.arange(start, start + n, device=h.device), h.dtype)
            mask = attention_mask(start, n, self.config.sliding_window, h.device)
            rows.append(Step(start, cos, sin, mask, kv, self.expert_runtime, state,
                             snapshots=tuple(snaps)))
            bounds.append(bounds[-1] + n)
        step = BatchStep(rows, None, None, self.expert_runtime, bounds, between)
        last = torch.tensor(bounds[1:], device=h.device) - 1
        logits = self._blocks_and_head(h, step, None, rows=last)
        for kv, state, n in zip(kv_caches, states, lens):
            kv.commit(n)
            if state is not None:
                state.commit(n)
        return logits

    def _blocks_and_head(self, h: torch.Tensor, step, num_logits: Optional[int],
                         rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The blocks over h [T, D], then the head: logits [T or num_logits, V] fp32 (rows: only
        those rows' logits)."""
        T = h.shape[0]
        pending = None
        between = getattr(step, "between", None)
        for blk in self.blk:
            h, pending = blk(h, step, pending)
            if between is not None:
                between(blk.layer)
        if rows is not None:
            h, pending = h[rows], pending[rows]
        elif num_logits is not None:
            h, pending = h[T - num_logits:], pending[T - num_logits:]
        _, h = self.output_norm.add_forward(h, pending)
        return self.head(h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The output head over the normed h [T, D] -> logits [T, V] fp32 (a family may scale
        them or add a bias)."""
        weight = self.token_embd.weight if self.config.tie_word_embeddings else self.output.weight
        return F.linear(h, weight).float()  # [T, V]
