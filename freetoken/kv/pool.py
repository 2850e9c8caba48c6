"""PagePool: ids of fixed-size KV pages, a free list and a reference count per page. Knows
nothing of tokens or tensors; the radix cache and the sequences are its holders.

A page is free exactly when its count is 0. Every holder (a running sequence, the radix tree)
takes one reference per page it keeps and gives it back once.
"""
from ..errors import ModelError


class PagePool:
    """num_pages pages of page_size tokens, ids 0..num_pages-1. alloc hands out free pages (count
    1); ref/unref count further holders; a page whose count drops to 0 is free again."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ModelError(f"a KV page pool needs pages (not {num_pages}) of at least one token "
                             f"(not {page_size}); raise --kv-tokens")
        self.num_pages, self.page_size = num_pages, page_size
        self.refs = [0] * num_pages
        self.free = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives the lowest id first

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free)

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold num_tokens tokens."""
        return -(-num_tokens // self.page_size)

    def alloc(self, n: int) -> list:
        """n free pages, each with count 1; ModelError when fewer than n are free (the caller
        evicts first)."""
        if n > len(self.free):
            raise ModelError(f"the KV pool is out of pages: {n} wanted, {len(self.free)} free of "
                             f"{self.num_pages}; raise --kv-tokens or lower --parallel")
        pages = [self.free.pop() for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        return pages

    def ref(self, pages) -> None:
        """One more holder for each of pages (each must be held already)."""
        for p in pages:
            assert self.refs[p] > 0, f"page {p} is free"
            self.refs[p] += 1

    def unref(self, pages) -> None:
        """One holder fewer for each of pages; those at 0 go back to the free list."""
        for p in pages:
            assert self.refs[p] > 0, f"page {p} is released more often than held"
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free.append(p)

    def resize(self, num_pages: int) -> None:
        """The pool becomes num_pages pages; the ids below both sizes keep their counts. Added
        pages are free and handed out after the free pages below them; removed ones must be
        free (the caller evicts first)."""
        old = self.num_pages
        if num_pages >= old:
            self.free[:0] = range(num_pages - 1, old - 1, -1)  # the stack's bottom: taken last
            self.refs += [0] * (num_pages - old)
        else:
            assert num_pages >= 1 and not any(self.refs[num_pages:]), \
                "a page past the new size is held"
            self.free = [p for p in self.free if p < num_pages]
            del self.refs[num_pages:]
        self.num_pages = num_pages

    def check_integrity(self) -> None:
        """Asserts: counts >= 0; the free list holds each page at most once and exactly those
        with count 0."""
        assert len(self.refs) == self.num_pages, "counts for another number of pages"
        assert all(r >= 0 for r in self.refs), "a negative reference count"
        assert len(set(self.free)) == len(self.free), "a page is on the free list twice"
        assert set(self.free) == {p for p, r in enumerate(self.refs) if r == 0}, \
            "the free list and the counts disagree"
