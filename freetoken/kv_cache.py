"""KV storage preallocated for one sequence: keys and values of every layer for up to
`max_tokens` tokens. Owns the slot arithmetic, not attention; no paging (one sequence).

A forward of T tokens:   start = kv.reserve(T)      (checks room, nothing moves yet)
                         per layer: keys, values = kv.store(layer, start, k, v)
                         kv.commit(T)                (num_tokens += T)

    slots [0, start)            earlier tokens (prompt chunks, decoded tokens)
    slots [start, start + T)    this forward's tokens, written layer by layer
    slots [start + T, max)      free
"""
import torch

from .errors import ModelError


class KVCache:
    """data [L, 2, KV, max_tokens, hd]: head-major so that one layer's keys are an SDPA-ready
    [KV, S, hd] view (each head's rows contiguous) without a copy."""

    def __init__(self, model_config, max_tokens: int, device, dtype):
        if max_tokens < 1:
            raise ModelError(f"the KV cache needs room for at least one token, not {max_tokens}")
        c = model_config
        self.max_tokens = max_tokens
        self.data = torch.zeros(c.num_layers, 2, c.num_kv_heads, max_tokens, c.head_dim,
                                device=device, dtype=dtype)
        self.num_tokens = 0

    @property
    def num_free(self) -> int:
        return self.max_tokens - self.num_tokens

    def reserve(self, n: int) -> int:
        """Checks that n more tokens fit; returns the first slot they will use."""
        if n > self.num_free:
            raise ModelError(f"the context is full: {self.num_tokens} tokens cached + {n} new > "
                             f"{self.max_tokens}; use a larger --ctx-size or a shorter prompt")
        return self.num_tokens

    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Writes k, v [T, KV, hd] at slots [start, start + T) of `layer`; returns the layer's
        keys and values over slots [0, start + T), each [KV, S, hd] (views, no copy)."""
        end = start + k.shape[0]
        kv = self.data[layer]  # [2, KV, max, hd]
        kv[0, :, start:end] = k.transpose(0, 1)
        kv[1, :, start:end] = v.transpose(0, 1)
        return kv[0, :, :end], kv[1, :, :end]

    def commit(self, n: int) -> None:
        """Marks the n tokens written by the last forward as cached."""
        assert self.num_tokens + n <= self.max_tokens
        self.num_tokens += n

    def truncate(self, num_tokens: int) -> None:
        """Forgets every token from slot `num_tokens` on (0 clears the cache)."""
        assert 0 <= num_tokens <= self.num_tokens
        self.num_tokens = num_tokens
