"""RadixCache: a radix tree over token ids at page granularity (as SGLang's RadixAttention): each
edge is a run of whole pages, keyed by their tokens, holding their KV page ids. A new request
takes the longest cached prefix; finished sequences leave their pages here; unreferenced
pages are evicted LRU-first. A node can also hold an opaque recurrent-state snapshot (`state`,
for hybrid models; anything with `nbytes`) valid at its end: it goes with the node's pages, and
beyond `state_budget` bytes the least recently used ones of unlocked nodes are dropped alone.

The tree takes one pool reference per page it holds (PagePool) and gives it back on eviction.
lock(node) marks the path root..node as used by a running sequence: locked nodes are never
evicted, nor their states dropped. Locks only count (a child's lock count <= its parent's), so
an unlocked node has no locked descendant and every page of an unlocked node is evictable.

    tokens  a b c d | e f g h | i j k l        page_size 4; two sequences inserted,
    root -> [abcd efgh] -> [ijkl]               "abcd efgh ijkl" and "abcd efgh mnop":
                        -> [mnop]              match_prefix("abcd efgh mn..") = 2 pages
"""
import heapq
from typing import Optional


class Node:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_used", "state")

    def __init__(self, key: tuple, pages: list, parent: Optional["Node"]):
        self.key, self.pages, self.parent = key, pages, parent  # len(key) == len(pages) * P
        self.children = {}  # first page's tokens -> child
        self.lock_ref = 0
        self.last_used = 0
        self.state = None  # an opaque snapshot valid after this node's last token


class Match:
    """match_prefix's answer: the cached pages of the longest prefix (num_tokens = pages x P) and
    the node ending there (the root when nothing matched); lock(node) keeps them."""
    __slots__ = ("pages", "node", "num_tokens")

    def __init__(self, pages: list, node: Node, num_tokens: int):
        self.pages, self.node, self.num_tokens = pages, node, num_tokens


class RadixCache:
    """match_prefix / insert / lock / unlock / evict over a PagePool (see the module text).
    Every method leaves check_integrity() true."""

    def __init__(self, pool, state_budget: Optional[int] = None):
        self.pool, self.page_size = pool, pool.page_size
        self.state_budget = state_budget  # bytes of states kept at most (None: no limit)
        self.num_states = self.num_state_bytes = 0
        self.root = Node((), [], None)
        self.root.lock_ref = 1  # never evicted
        self.clock = 0  # a logical clock for LRU: every match and insert ticks it
        self.num_pages = 0  # pages held by the tree
        self.num_locked_pages = 0  # of those, in locked nodes

    @property
    def num_evictable_pages(self) -> int:
        return self.num_pages - self.num_locked_pages

    def _page_key(self, tokens, i: int) -> tuple:
        return tuple(tokens[i * self.page_size:(i + 1) * self.page_size])

    def _walk(self, tokens):
        """(node, pages, num matched pages): the node ending the longest cached prefix of
        tokens' whole pages, the edge it ends inside split there first."""
        self.clock += 1
        P, node, pages, i = self.page_size, self.root, [], 0
        num_pages = len(tokens) // P
        node.last_used = self.clock
        while i < num_pages:
            child = node.children.get(self._page_key(tokens, i))
            if child is None:
                break
            n = len(child.pages)
            k = 1  # pages of child's edge that match (its first does: it is the dict key)
            while k < n and i + k < num_pages and \
                    child.key[k * P:(k + 1) * P] == self._page_key(tokens, i + k):
                k += 1
            if k < n:
                child = self._split(child, k)
            child.last_used = self.clock
            pages += child.pages
            node, i = child, i + k
        return node, pages, i

    def _split(self, child: Node, k: int) -> Node:
        """Cuts child's edge after k pages; returns the new upper node (the state stays below)."""
        P = self.page_size
        upper = Node(child.key[:k * P], child.pages[:k], child.parent)
        upper.lock_ref, upper.last_used = child.lock_ref, child.last_used
        child.parent.children[upper.key[:P]] = upper
        child.key, child.pages, child.parent = child.key[k * P:], child.pages[k:], upper
        upper.children[child.key[:P]] = child
        return upper

    def match_prefix(self, tokens) -> Match:
        """The longest cached prefix of tokens in whole pages (a node ending inside the match is
        split there). Marks the path used now (LRU). Takes no reference: lock the node and
        ref the pages to keep them."""
        node, pages, i = self._walk(tokens)
        return Match(pages, node, i * self.page_size)

    def insert(self, tokens, pages: list, state=None) -> int:
        """Caches pages [len(tokens) // P of them] as the KV of tokens' whole pages; returns how
        many of those tokens were cached already (their pages stay the tree's: the caller keeps
        and releases its own copies). The tree refs the pages it takes. state: a snapshot valid
        after the last whole page (set on the node ending there)."""
        P = self.page_size
        num_pages = len(tokens) // P
        assert len(pages) >= num_pages, (len(pages), num_pages)
        node, _, i = self._walk(tokens[:num_pages * P])
        if i < num_pages:
            new_pages = list(pages[i:num_pages])
            child = Node(tuple(tokens[i * P:num_pages * P]), new_pages, node)
            child.last_used = self.clock
            node.children[child.key[:P]] = child
            self.pool.ref(new_pages)
            self.num_pages += len(new_pages)
            node = child
        if state is not None and node is not self.root:
            self.set_state(node, state)
        return i * P

    def set_state(self, node: Node, state) -> None:
        """node.state = state (a snapshot valid after node's last token, replacing any); then
        drops other unlocked nodes' states, least recently used first, while over the budget
        (the newest always stays: a budget below one state keeps just it)."""
        self._drop_state(node)
        node.state = state
        self.num_states += 1
        self.num_state_bytes += state.nbytes
        if self.state_budget is None or self.num_state_bytes <= self.state_budget:
            return
        held = sorted((n.last_used, id(n), n) for n in self._nodes()
                      if n.state is not None and n.lock_ref == 0 and n is not node)
        for _, _, n in held:
            if self.num_state_bytes <= self.state_budget:
                break
            self._drop_state(n)

    def _drop_state(self, node: Node) -> None:
        if node.state is not None:
            self.num_states -= 1
            self.num_state_bytes -= node.state.nbytes
            node.state = None

    def with_state(self, node: Node) -> Node:
        """The deepest of node and its ancestors that holds a state (the root when none does)."""
        while node is not self.root and node.state is None:
            node = node.parent
        return node

    def depth(self, node: Node) -> int:
        """Tokens from the root to node's end."""
        n = 0
        while node is not self.root:
            n, node = n + len(node.key), node.parent
        return n

    def lock(self, node: Node) -> None:
        """Keeps node and its ancestors from eviction (counted: unlock once per lock)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.num_locked_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.num_locked_pages -= len(node.pages)
            node = node.parent

    def evict(self, num_pages: int) -> int:
        """Removes unlocked leaves, least recently used first, until num_pages pages went back to
        the pool or none is left to remove; returns the pages freed."""
        leaves = [(n.last_used, id(n), n) for n in self._nodes()
                  if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_pages and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[leaf.key[:self.page_size]]
            self.num_pages -= len(leaf.pages)
            self._drop_state(leaf)
            before = self.pool.num_free
            self.pool.unref(leaf.pages)
            freed += self.pool.num_free - before
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))
        return freed

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def cached(self) -> dict:
        """{tokens of a whole-page prefix (tuple): its last page id} for every cached prefix:
        the tree's content, flat (for tests and their naive models)."""
        out = {}
        stack = [((), self.root)]
        while stack:
            prefix, node = stack.pop()
            for child in node.children.values():
                for k, page in enumerate(child.pages):
                    out[prefix + child.key[:(k + 1) * self.page_size]] = page
                stack.append((prefix + child.key, child))
        return out

    def check_integrity(self) -> None:
        """Asserts the tree's invariants: edges of whole pages keyed by their first page, parent
        links, lock counts >= 0 and <= the parent's, each page held once and referenced in the
        pool, the page and state counters."""
        P, seen, locked, states, state_bytes = self.page_size, set(), 0, 0, 0
        for node in self._nodes():
            if node.state is not None:
                states, state_bytes = states + 1, state_bytes + node.state.nbytes
            assert node.key and len(node.key) == len(node.pages) * P, "an edge of partial pages"
            assert node.parent.children.get(node.key[:P]) is node, "a broken parent link"
            assert node.lock_ref >= 0, "a negative lock count"
            assert node.parent is self.root or node.lock_ref <= node.parent.lock_ref, \
                "a node locked more often than its parent"
            for p in node.pages:
                assert p not in seen, f"page {p} is in the tree twice"
                assert self.pool.refs[p] >= 1, f"page {p} is in the tree but free"
                seen.add(p)
            locked += len(node.pages) if node.lock_ref else 0
        assert len(seen) == self.num_pages and locked == self.num_locked_pages, "page counters"
        assert (states, state_bytes) == (self.num_states, self.num_state_bytes), "state counters"
