"""KV storage as one pool of fixed-size pages per model (KVPages) and the view one sequence's
forward writes and reads it through (SequenceKV: its page table). Owns the slot arithmetic,
not attention and not which pages a sequence gets (kv/manager.py).

    data [L, N, KV, num_pages * P, hd]: page p holds flat slots [p * P, (p + 1) * P); per
        layer and token N parts of KV heads of hd (ModelConfig.kv_entry: k and v, N = 2; MLA
        models one part, their kv latent and rope key)
    token i of a sequence:  flat slot = page_table[i // P] * P + i % P
    e.g. P = 4, page_table [7, 2]: tokens 0..3 at slots 28..31, tokens 4..7 at slots 8..11

A forward of T tokens:   start = kv.reserve(T)      (checks room, gets pages, nothing moves yet)
                         per layer: keys, values = kv.store(layer, start, k, v)
                                    (MLA: entries, = kv.store(layer, start, latent_and_rope))
                         kv.commit(T)                (num_tokens += T)
"""
import torch

from .errors import ModelError

PAGE_SIZE = 32  # tokens per KV page: the prefix cache's granularity (docs/MEASUREMENTS.md#kv-pages)


class KVPages:
    """The storage: data [L, N, KV, num_pages * page_size, hd] (N, KV, hd: the model's
    ModelConfig.kv_entry), head-major so that a run of consecutive slots of one layer is an
    SDPA-ready [KV, S, hd] view."""

    def __init__(self, model_config, num_pages: int, page_size: int, device, dtype):
        c = model_config
        self.num_pages, self.page_size = num_pages, page_size
        # ModelConfig.kv_entry; a bare config of the attention fields alone holds k and v
        parts, heads, dim = getattr(c, "kv_entry", (2, c.num_kv_heads, c.head_dim))
        self.data = torch.zeros(c.num_layers, parts, heads, num_pages * page_size, dim,
                                device=device, dtype=dtype)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def page_bytes(self) -> int:
        return self.data.nbytes // self.num_pages

    def resize(self, num_pages: int, staged: bool = False) -> None:
        """The storage becomes num_pages pages (a new `data`; added pages zeroed); pages below
        both sizes keep their ids and contents (pages past a shrink are dropped: the caller
        checks they are free). The new storage is allocated beside the old, or with staged
        after the kept pages went to host memory and the old was freed (a device too full for
        both). NOTE: anything holding `data`'s address (captured graphs) must be rebuilt."""
        keep = min(num_pages, self.num_pages) * self.page_size
        shape = list(self.data.shape)  # [L, N, KV, slots, hd]
        shape[3] = num_pages * self.page_size
        device, dtype = self.data.device, self.data.dtype
        kept = self.data[:, :, :, :keep]
        if staged:
            kept = kept.to("cpu", copy=True)
            self.data = None  # the old storage goes before the new one comes
        data = torch.zeros(shape, device=device, dtype=dtype)
        data[:, :, :, :keep] = kept
        self.data, self.num_pages = data, num_pages

    def copy_rows(self, src: int, dst: int, n: int) -> None:
        """Page dst's first n token rows become page src's, in every layer and part (the
        prefix cache's copy-on-write of a partly used cached page: kv/manager.py)."""
        P = self.page_size
        self.data[:, :, :, dst * P:dst * P + n] = self.data[:, :, :, src * P:src * P + n]

    def slots(self, page_table: list, num_tokens: int) -> torch.Tensor:
        """Flat slots [num_tokens] int64 on the device of tokens 0..num_tokens-1."""
        P = self.page_size
        pages = torch.tensor(page_table[:-(-num_tokens // P)], dtype=torch.int64)
        slots = (pages[:, None] * P + torch.arange(P)).flatten()[:num_tokens]
        return slots.to(self.device, non_blocking=True)


class _Table:
    """page_table + num_kv_tokens of a sequence that is not a Sequence (KVCache)."""

    def __init__(self, page_table: list):
        self.page_table, self.num_kv_tokens = page_table, 0


class SequenceKV:
    """One sequence's K/V for the model's forward (reserve / store / commit). `table` holds its
    page_table and num_kv_tokens (a Sequence; both are read and written here); grow(n) makes its
    page table hold n tokens (KVManager.grow), None when the pages are fixed. A table whose pages
    are consecutive is read as views; any other through the slots (a gather per layer)."""

    def __init__(self, pages: KVPages, table, max_tokens: int, grow=None):
        if max_tokens < 1:
            raise ModelError(f"the KV cache needs room for at least one token, not {max_tokens}")
        self.pages, self.table, self.max_tokens, self.grow = pages, table, max_tokens, grow
        self._slots = None  # the reserved tokens' flat slots: a first slot (int) or [S] slots

    @property
    def data(self) -> torch.Tensor:
        return self.pages.data

    @property
    def page_size(self) -> int:
        return self.pages.page_size

    @property
    def num_tokens(self) -> int:
        return self.table.num_kv_tokens

    @property
    def num_free(self) -> int:
        return self.max_tokens - self.num_tokens

    def reserve(self, n: int) -> int:
        """Checks that n more tokens fit (pages added through grow); returns the first slot
        (the sequence position) they will use."""
        if n > self.num_free:
            raise ModelError(f"the context is full: {self.num_tokens} tokens cached + {n} new > "
                             f"{self.max_tokens}; use a larger --ctx-size or a shorter prompt")
        end = self.num_tokens + n
        if self.grow is not None:
            self.grow(end)
        table, num_pages = self.table.page_table, -(-end // self.page_size)
        assert len(table) >= num_pages, "the page table is too short"
        first = table[0]
        if table[:num_pages] == list(range(first, first + num_pages)):
            self._slots = first * self.page_size  # consecutive pages: an offset, views
        else:
            self._slots = self.pages.slots(table, end)  # [end]
        return self.num_tokens

    def store(self, layer: int, start: int, *parts: torch.Tensor):
        """Writes the N parts of the cache entry (k, v: each [T, KV, hd]; an MLA model's one
        part [T, 1, kv_lora_rank + rope dims]) for positions [start, start + T) of `layer`;
        returns the layer's parts over positions [0, start + T), each [KV, S, hd] (views when
        the pages are consecutive, else gathered copies): keys, values = store(layer, start, k, v)."""
        end = start + parts[0].shape[0]
        kv = self.data[layer]  # [N, KV, slots, hd]
        assert len(parts) == kv.shape[0], (len(parts), kv.shape)
        if isinstance(self._slots, int):
            base = self._slots
            for i, part in enumerate(parts):
                kv[i, :, base + start:base + end] = part.transpose(0, 1)
            return tuple(kv[i, :, base:base + end] for i in range(len(parts)))
        slots = self._slots[:end]  # [S]
        for i, part in enumerate(parts):
            kv[i].index_copy_(1, slots[start:], part.transpose(0, 1))
        return tuple(kv[i].index_select(1, slots) for i in range(len(parts)))

    def commit(self, n: int) -> None:
        """Marks the n tokens written by the last forward as cached."""
        assert self.num_tokens + n <= self.max_tokens
        self.table.num_kv_tokens += n

    def truncate(self, num_tokens: int) -> None:
        """Forgets every token from position `num_tokens` on (0 clears it); pages stay."""
        assert 0 <= num_tokens <= self.num_tokens
        self.table.num_kv_tokens = num_tokens


class KVCache(SequenceKV):
    """One sequence on storage of its own, one page of max_tokens (tests, tools)."""

    def __init__(self, model_config, max_tokens: int, device, dtype):
        if max_tokens < 1:
            raise ModelError(f"the KV cache needs room for at least one token, not {max_tokens}")
        super().__init__(KVPages(model_config, 1, max_tokens, device, dtype), _Table([0]),
                         max_tokens)
