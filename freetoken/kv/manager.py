"""KVManager: the pages of running sequences. admit() gives a sequence the longest cached
prefix of its prompt (to the token: a partial last page is copied), grow() pages for new tokens
(evicting cached pages LRU-first when the pool runs short), release() leaves its written pages
in the prefix cache (the last one as a partial leaf) and frees the rest. For a model with a
recurrent state (needs_state), a cached prefix is usable only up to a state snapshot (save_state
puts them there; anchors.py says where). Pure Python
over PagePool and RadixCache; kv_cache.py and state_cache.py do the tensors.

NOTE: a page's pool count = running sequences whose table holds it + 1 if the tree holds it.
"""
from ..errors import ModelError
from ..sequence import Sequence, Status
from .pool import PagePool
from .radix import RadixCache


class KVManager:
    """prefix_cache False: no tree; admit matches nothing and release frees every page.
    needs_state: the model's sequences carry a recurrent state that no KV page restores; a
    prefix is taken only with a state snapshot at its end (state_budget: RadixCache's).
    copy_rows(src, dst, n): page dst's first n token rows become page src's (the storage's;
    None: pages without storage, as in tests of the bookkeeping alone)."""

    def __init__(self, pool: PagePool, prefix_cache: bool = True, needs_state: bool = False,
                 state_budget=None, copy_rows=None):
        self.pool, self.page_size = pool, pool.page_size
        self.copy_rows = copy_rows or (lambda src, dst, n: None)  # KVPages.copy_rows
        self.radix = RadixCache(pool, state_budget) if prefix_cache else None
        self.needs_state = needs_state

    @property
    def num_evictable_pages(self) -> int:
        return self.radix.num_evictable_pages if self.radix else 0

    def num_available(self, running: list) -> int:
        """Pages grow() can still find: free + evictable, less the running sequences' pages past
        their locked prefix that the tree holds too (the partial leaves of the states they saved,
        at any of their pages: evicting one frees nothing while the sequence holds it)."""
        shared = 0
        for seq in running:
            locked = (self.radix.depth(seq.prefix_node) // self.page_size
                      if self.radix is not None and seq.prefix_node is not None else 0)
            shared += sum(1 for page in seq.page_table[locked:] if self.pool.refs[page] > 1)
        return self.pool.num_free + self.num_evictable_pages - shared

    def admit(self, seq: Sequence, use_cache: bool = True):
        """WAITING -> RUNNING: the page table starts with the longest cached prefix of the prompt
        without its last token (which is always prefilled: its logits start the generation):
        its whole pages shared, a last partial page's rows copied into a page of its own
        (copy_rows: the cached page is never written); num_cached_tokens = num_kv_tokens = that
        prefix's length. With needs_state the prefix ends at the deepest state snapshot inside
        that match (request-end states before it are dropped: RadixCache.drop_ends); returns the
        snapshot (restore it before the first forward), else None.
        use_cache False: nothing is taken from the cache (a cold prefill). ModelError (seq left
        WAITING) when no page is free or evictable for a partial page (but the one it copies:
        then that one becomes the sequence's)."""
        assert seq.status is Status.WAITING
        seq.status = Status.RUNNING
        if self.radix is None or not use_cache:
            return None
        P, radix = self.page_size, self.radix
        match = radix.match_prefix(seq.tokens[:seq.num_prompt_tokens - 1])
        state, holder, n = None, match.tail, match.num_tokens
        if self.needs_state:
            state, holder = radix.deepest_state(match)
            n = state.num_tokens if state is not None else 0
            if state is not None:
                radix.drop_ends(match, n)
        path = match.pages + ([holder.pages[0]] if n > len(match.pages) * P else [])
        if n >= P:
            seq.prefix_node = radix.covering(match.node, n - n % P)
            radix.lock(seq.prefix_node)
            seq.page_table = path[:n // P]
            self.pool.ref(seq.page_table)
        if n % P:
            src = path[n // P]
            self.pool.ref([src])  # kept while a page is found: eviction may take the tree's
            try:
                seq.page_table = seq.page_table + self._alloc(1)
                self.copy_rows(src, seq.page_table[-1], n % P)
                self.pool.unref([src])
            except ModelError:
                if self.pool.refs[src] > 1:  # no page free nor evictable: nothing is taken
                    self.pool.unref([src])
                    self.release(seq)
                    seq.status = Status.WAITING
                    raise
                seq.page_table = seq.page_table + [src]  # evicted, ours alone: its rows stay
        seq.num_cached_tokens = seq.num_kv_tokens = n
        return state

    def save_state(self, seq: Sequence, state, is_end: bool = False) -> None:
        """Caches seq's first state.num_tokens tokens (K/V written; a last partial page as a
        partial leaf) with `state`, the snapshot of seq's recurrent state after them. is_end:
        a request-end state (RadixCache.drop_ends). seq's lock moves down to its whole pages."""
        n = state.num_tokens
        assert seq.status is Status.RUNNING and 0 < n <= seq.num_kv_tokens, (n, seq.num_kv_tokens)
        if self.radix is not None:
            self.radix.insert(seq.tokens[:n], seq.page_table, state, is_end)
            whole = n - n % self.page_size  # its pages in the tree are locked for it, as its prefix
            if whole and (seq.prefix_node is None or self.radix.depth(seq.prefix_node) < whole):
                node = self.radix.match_prefix(seq.tokens[:whole]).node
                self.radix.lock(node)
                if seq.prefix_node is not None:
                    self.radix.unlock(seq.prefix_node)
                seq.prefix_node = node

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Pages so that seq's table holds num_tokens tokens; evicts unlocked cached pages
        LRU-first when too few are free. ModelError (from the pool) when they do not suffice."""
        assert seq.status is Status.RUNNING
        need = self.pool.pages_for(num_tokens) - len(seq.page_table)
        if need <= 0:
            return
        seq.page_table += self._alloc(need)

    def _alloc(self, n: int) -> list:
        short = n - self.pool.num_free
        if short > 0 and self.radix is not None:
            self.radix.evict(short)
        return self.pool.alloc(n)

    def release(self, seq: Sequence) -> None:
        """RUNNING -> FINISHED: with the prefix cache, the pages of its written tokens go to the
        tree (those cached already stay as they were; a partial last page as a partial leaf);
        its references are given back."""
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
