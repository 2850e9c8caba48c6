"""KVManager: the pages of running sequences. admit() gives a sequence the longest cached
prefix of its prompt, grow() pages for new tokens (evicting cached pages LRU-first when the
pool runs short), release() leaves its whole written pages in the prefix cache and frees the
rest. For a model with a recurrent state (needs_state), a cached prefix is usable only up to a
node holding a state snapshot (save_state puts them there; anchors.py says where). Pure Python
over PagePool and RadixCache; kv_cache.py and state_cache.py do the tensors.

NOTE: a page's pool count = running sequences whose table holds it + 1 if the tree holds it.
"""
from ..sequence import Sequence, Status
from .pool import PagePool
from .radix import RadixCache


class KVManager:
    """prefix_cache False: no tree; admit matches nothing and release frees every page.
    needs_state: the model's sequences carry a recurrent state that no KV page restores; a
    prefix is taken only with a state snapshot at its end (state_budget: RadixCache's)."""

    def __init__(self, pool: PagePool, prefix_cache: bool = True, needs_state: bool = False,
                 state_budget=None):
        self.pool, self.page_size = pool, pool.page_size
        self.radix = RadixCache(pool, state_budget) if prefix_cache else None
        self.needs_state = needs_state

    @property
    def num_evictable_pages(self) -> int:
        return self.radix.num_evictable_pages if self.radix else 0

    def admit(self, seq: Sequence, use_cache: bool = True):
        """WAITING -> RUNNING: the page table starts as the cached pages of the longest cached
        prefix of the prompt without its last token (which is always prefilled: its logits
        start the generation); num_cached_tokens = num_kv_tokens = that prefix's length.
        With needs_state the prefix ends at the deepest node inside that match holding a state
        snapshot; returns the snapshot (restore it before the first forward), else None.
        use_cache False: nothing is taken from the cache (a cold prefill)."""
        assert seq.status is Status.WAITING
        seq.status = Status.RUNNING
        if self.radix is None or not use_cache:
            return None
        match = self.radix.match_prefix(seq.tokens[:seq.num_prompt_tokens - 1])
        node, pages = match.node, match.pages
        if self.needs_state:
            node = self.radix.with_state(node)
            pages = pages[:self.radix.depth(node) // self.page_size]
        if pages:
            self.radix.lock(node)
            self.pool.ref(pages)
            seq.page_table, seq.prefix_node = list(pages), node
        seq.num_cached_tokens = seq.num_kv_tokens = len(pages) * self.page_size
        assert node.state is None or node.state.num_tokens == seq.num_cached_tokens
        return node.state

    def save_state(self, seq: Sequence, state) -> None:
        """Caches seq's first state.num_tokens tokens (whole pages, K/V written) with `state`,
        the snapshot of seq's recurrent state after them, on the node ending there."""
        n = state.num_tokens
        assert seq.status is Status.RUNNING and n % self.page_size == 0 and \
            0 < n <= seq.num_kv_tokens, (n, seq.num_kv_tokens)
        if self.radix is not None:
            self.radix.insert(seq.tokens[:n], seq.page_table, state)

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
