"""KVManager: the pages of running sequences. admit() gives a sequence the longest cached
prefix of its prompt, grow() pages for new tokens (evicting cached pages LRU-first when the
pool runs short), release() leaves its whole written pages in the prefix cache and frees the
rest. Pure Python over PagePool and RadixCache; kv_cache.py does the tensors.

NOTE: a page's pool count = running sequences whose table holds it + 1 if the tree holds it.
"""
from ..sequence import Sequence, Status
from .pool import PagePool
from .radix import RadixCache


class KVManager:
    """prefix_cache False: no tree; admit matches nothing and release frees every page."""

    def __init__(self, pool: PagePool, prefix_cache: bool = True):
        self.pool, self.page_size = pool, pool.page_size
        self.radix = RadixCache(pool) if prefix_cache else None

    @property
    def num_evictable_pages(self) -> int:
        return self.radix.num_evictable_pages if self.radix else 0

    def admit(self, seq: Sequence, use_cache: bool = True) -> None:
        """WAITING -> RUNNING: the page table starts as the cached pages of the longest cached
        prefix of the prompt without its last token (which is always prefilled: its logits
        start the generation); num_cached_tokens = num_kv_tokens = that prefix's length.
        use_cache False: nothing is taken from the cache (a cold prefill)."""
        assert seq.status is Status.WAITING
        seq.status = Status.RUNNING
        if self.radix is None or not use_cache:
            return
        match = self.radix.match_prefix(seq.tokens[:seq.num_prompt_tokens - 1])
        if match.pages:
            self.radix.lock(match.node)
            self.pool.ref(match.pages)
            seq.page_table, seq.prefix_node = list(match.pages), match.node
        seq.num_cached_tokens = seq.num_kv_tokens = match.num_tokens

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Pages so that seq's table holds num_tokens tokens; evicts unlocked cached pages
        LRU-first when too few are free. ModelError (from the pool) when they do not suffice."""
        assert seq.status is Status.RUNNING
        need = self.pool.pages_for(num_tokens) - len(seq.page_table)
        if need <= 0:
            return
        short = need - self.pool.num_free
        if short > 0 and self.radix is not None:
            self.radix.evict(short)
        seq.page_table += self.pool.alloc(need)

    def release(self, seq: Sequence) -> None:
        """RUNNING -> FINISHED: with the prefix cache, the whole pages of its written tokens go
        to the tree (those cached already stay as they were); its references are given back."""
        assert seq.status is Status.RUNNING
        if self.radix is not None:
            self.radix.insert(seq.tokens[:seq.num_kv_tokens], seq.page_table)
            if seq.prefix_node is not None:
                self.radix.unlock(seq.prefix_node)
        self.pool.unref(seq.page_table)
        seq.page_table, seq.prefix_node = [], None
        seq.status = Status.FINISHED

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        if self.radix is not None:
            self.radix.check_integrity()

    def check_idle(self) -> None:
        """Asserts, with no sequence running, that every page is free or held by the prefix tree
        alone: a request that ended without giving its pages back fails here."""
        self.check_integrity()
        tree = set(self.radix.cached().values()) if self.radix is not None else set()
        held = {p for p, r in enumerate(self.pool.refs) if r > 0}
        assert held == tree, f"pages held outside the prefix tree: {sorted(held - tree)}"
        assert all(self.pool.refs[p] == 1 for p in tree), "a cached page still has a holder"
        assert self.radix is None or self.radix.num_locked_pages == 0, "a prefix is still locked"
