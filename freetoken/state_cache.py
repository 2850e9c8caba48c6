"""Per-sequence recurrent state of the linear-attention (Gated DeltaNet) layers, beside the KV
cache: each such layer's causal-conv window and delta-rule state. Sized per sequence, not per
token. Owns the storage and its token count, not the math (models/linear_attention.py).

Unlike the KV cache it cannot be cut back to an earlier token: it is reset to empty, advanced
by each forward (the model commits it with the KV cache), or restored from a StateSnapshot taken
at an earlier token (the prefix cache keeps them at anchors: anchors.py, kv/radix.py; a prefill
forward takes those inside it, after any of its tokens: snapshots_at). NOTE: the
engine resets or restores it wherever it sets the KV cache's length; the model asserts both hold
the same number of tokens.
"""
from typing import Optional

import torch


class StateCache:
    """conv [NL, C, K-1] in the compute dtype and recurrent [NL, nv, dk, dv] fp32, one row per
    linear-attention layer (NL of them, in layer order)."""

    def __init__(self, model_config, device, dtype):
        c = model_config
        self.index = {layer: j for j, layer in enumerate(c.linear_layers)}  # layer -> row
        NL = len(self.index)
        conv_dim = (2 * c.linear_num_key_heads * c.linear_key_head_dim
                    + c.linear_num_value_heads * c.linear_value_head_dim)
        self.conv = torch.zeros(NL, conv_dim, c.linear_conv_kernel_dim - 1, device=device,
                                dtype=dtype)
        self.recurrent = torch.zeros(NL, c.linear_num_value_heads, c.linear_key_head_dim,
                                     c.linear_value_head_dim, device=device, dtype=torch.float32)
        self.num_tokens = 0
        self.version = 0  # advanced by every change (a captured step's copy of it: graphs.py)

    def layer(self, layer: int):
        """(conv window [C, K-1], recurrent state [nv, dk, dv]) of `layer`: views the layer
        updates in place."""
        j = self.index[layer]
        return self.conv[j], self.recurrent[j]

    def commit(self, n: int) -> None:
        """Counts the n tokens the last forward advanced every layer's state by."""
        self.num_tokens += n
        self.version += 1

    def reset(self) -> None:
        """Empty: the state of a sequence before its first token."""
        self.conv.zero_()
        self.recurrent.zero_()
        self.num_tokens = 0
        self.version += 1

    @property
    def nbytes(self) -> int:
        return _nbytes(self.conv) + _nbytes(self.recurrent)

    def snapshot(self) -> "StateSnapshot":
        """A copy of the state as it is now (after num_tokens tokens), on the same device."""
        return StateSnapshot(self.conv.clone(), self.recurrent.clone(), self.num_tokens)

    def snapshots_at(self, positions) -> list:
        """Empty StateSnapshots for the state after each of positions (tokens), for a forward
        to fill (MoETransformer.forward's snapshots: positions within its tokens)."""
        return [StateSnapshot(torch.empty_like(self.conv), torch.empty_like(self.recurrent), n)
                for n in positions]

    def restore(self, snap: "StateSnapshot") -> None:
        """Becomes the state snap was taken from (after snap.num_tokens tokens); snap is not
        changed."""
        self.conv.copy_(snap.conv)
        self.recurrent.copy_(snap.recurrent)
        self.num_tokens = snap.num_tokens
        self.version += 1


class StateSnapshot:
    """Every linear-attention layer's conv window and recurrent state after num_tokens tokens of
    one token sequence (a StateCache's copy; never changed once taken)."""
    __slots__ = ("conv", "recurrent", "num_tokens")

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor, num_tokens: int):
        self.conv, self.recurrent, self.num_tokens = conv, recurrent, num_tokens

    @property
    def nbytes(self) -> int:
        return _nbytes(self.conv) + _nbytes(self.recurrent)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def state_nbytes(model_config, dtype) -> int:
    """Bytes of one sequence's StateCache (0 without linear-attention layers): what the memory
    plan counts per sequence."""
    c = model_config
    NL = len(c.linear_layers)
    if not NL:
        return 0
    conv_dim = (2 * c.linear_num_key_heads * c.linear_key_head_dim
                + c.linear_num_value_heads * c.linear_value_head_dim)
    size = torch.empty((), dtype=dtype).element_size()
    conv = NL * conv_dim * (c.linear_conv_kernel_dim - 1) * size
    recurrent = NL * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    return conv + recurrent


def create_state_cache(model_config, device, dtype) -> Optional[StateCache]:
    """The StateCache of one sequence of this model, or None when it has no linear-attention
    layers."""
    return StateCache(model_config, device, dtype) if model_config.linear_layers else None
