"""RadixCache: a radix tree over token ids at page granularity (as SGLang's RadixAttention): each
edge is a run of whole pages, keyed by their tokens, holding their KV page ids; a leaf may
instead be a partial page (1..P-1 tokens: the tail of a sequence, its page's first rows). A new
request takes the longest cached prefix, down to the token: its last page partly (kv/manager.py
copies those rows into a page of its own); finished sequences leave their pages here;
unreferenced pages are evicted LRU-first. A node also holds opaque recurrent-state snapshots
(`states`, hybrid models; anything with `nbytes` and `num_tokens`), each valid after its
num_tokens-th token, which lies on the node's edge: they go with the node's pages, and beyond
`state_budget` bytes the least recently used ones are dropped alone (a match uses every state it
covers, those of sub-page sibling branches included: deepest_state).

The tree takes one pool reference per page it holds (PagePool) and gives it back on eviction.
lock(node) marks the path root..node as used by a running sequence: locked nodes are never
evicted; partial leaves are never locked, nor states kept for a sequence (a request copies a
partial page's rows and the state it resumes from at once). Locks only count (a child's lock
count <= its parent's), so an unlocked node has no locked descendant and every page of an
unlocked node is evictable (a running sequence's saved partial page: evicted, not freed).

    tokens  a b c d | e f g h | i j k l        page_size 4; three sequences inserted,
    root -> [abcd efgh] -> [ijkl]               "abcd efgh ijkl", "abcd efgh mnop", "abcd efgh q":
                        -> [mnop]              match_prefix("abcd efgh mn..") = 2 pages + 2 rows
                        -> [q]                 of [mnop]'s page; "abcd efgh qr" would replace [q]
"""
import heapq
from typing import Optional


class Node:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_used", "states")

    def __init__(self, key: tuple, pages: list, parent: Optional["Node"]):
        self.key, self.pages, self.parent = key, pages, parent  # len(pages) = ceil(len(key) / P)
        self.children = {}  # first page's tokens (a partial leaf: all its tokens) -> child
        self.lock_ref = 0
        self.last_used = 0
        self.states = {}  # num_tokens -> Kept: a snapshot valid after that many tokens


class Kept:
    """A state snapshot in the tree: when a match last covered it (LRU) and whether it was kept
    at a request's end (RadixCache.drop_ends)."""
    __slots__ = ("state", "last_used", "is_end")

    def __init__(self, state, last_used: int, is_end: bool):
        self.state, self.last_used, self.is_end = state, last_used, is_end


class Match:
    """match_prefix's answer: the cached whole pages of the longest prefix, the node ending there
    (the root when none matched; lock(node) keeps them), and `tails`: [(n, child)] for each
    child whose first page starts with the next n > 0 tokens too, most first (sub-page matches:
    their first n rows can be copied). tail, num_tail: the first of them (None, 0: none);
    num_tokens counts the whole pages and num_tail."""
    __slots__ = ("tokens", "pages", "node", "tails", "tail", "num_tail", "num_tokens")

    def __init__(self, tokens, pages: list, node: Node, tails: list, P: int):
        self.tokens, self.pages, self.node, self.tails = tokens, pages, node, tails
        self.num_tail, self.tail = tails[0] if tails else (0, None)
        self.num_tokens = len(pages) * P + self.num_tail


def _common(x, y) -> int:
    return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))


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
                child = self._split(child, k, (i + k) * P)
            child.last_used = self.clock
            pages += child.pages
            node, i = child, i + k
        return node, pages, i

    def _split(self, child: Node, k: int, end: int) -> Node:
        """Cuts child's edge after k pages (at `end` tokens from the root); returns the new
        upper node, which takes the states up to end."""
        P = self.page_size
        upper = Node(child.key[:k * P], child.pages[:k], child.parent)
        upper.lock_ref, upper.last_used = child.lock_ref, child.last_used
        upper.states = {n: s for n, s in child.states.items() if n <= end}
        child.states = {n: s for n, s in child.states.items() if n > end}
        child.parent.children[upper.key[:P]] = upper
        child.key, child.pages, child.parent = child.key[k * P:], child.pages[k:], upper
        upper.children[child.key[:P]] = child
        return upper

    def match_prefix(self, tokens) -> Match:
        """The longest cached prefix of tokens, to the token: whole pages (a node ending inside
        the match is split there), then the most of the next page that a child's first page
        starts with. Marks the path and the children it continues into used now (LRU). Takes
        no reference: lock the node and ref the pages to keep them; copy the tail's rows before
        anything else changes the tree."""
        P = self.page_size
        node, pages, i = self._walk(tokens)
        rest = tuple(tokens[i * P:(i + 1) * P])
        tails = [(_common(c.key[:P], rest), c) for c in node.children.values()]
        tails = sorted(((n, c) for n, c in tails if n), key=lambda t: -t[0])
        for _, child in tails:
            child.last_used = self.clock
        return Match(tokens, pages, node, tails, P)

    def insert(self, tokens, pages: list, state=None, is_end: bool = False) -> int:
        """Caches pages [ceil(len(tokens) / P) of them] as the KV of tokens (a last partial page
        as a partial leaf, which replaces a shorter one of the same tokens; one that a cached
        page already starts with is not kept); returns how many of the whole pages' tokens were
        cached already (their pages stay the tree's: the caller keeps and releases its own
        copies). The tree refs the pages it takes. state: a snapshot valid after the last token
        (set on the node whose edge ends there or holds it; is_end: set_state's)."""
        P = self.page_size
        num_pages = len(tokens) // P
        assert len(pages) >= -(-len(tokens) // P), (len(pages), len(tokens))
        node, _, i = self._walk(tokens[:num_pages * P])
        if i < num_pages:
            new_pages = list(pages[i:num_pages])
            child = Node(tuple(tokens[i * P:num_pages * P]), new_pages, node)
            child.last_used = self.clock
            self._drop_covered(node, child)
            node.children[child.key[:P]] = child
            self.pool.ref(new_pages)
            self.num_pages += len(new_pages)
            node = child
        if len(tokens) > num_pages * P:
            node = self._insert_tail(node, tuple(tokens[num_pages * P:]), pages[num_pages])
        if state is not None and node is not self.root:
            assert state.num_tokens == len(tokens), (state.num_tokens, len(tokens))
            self.set_state(node, state, is_end)
        return i * P

    def _insert_tail(self, node: Node, tail: tuple, page: int) -> Node:
        """The child of node holding tokens `tail` (< P of them) in its first page: one that
        holds them already, else a partial leaf of them (a shorter one extended, page swapped)."""
        for child in node.children.values():
            if child.key[:len(tail)] == tail:
                return child
        leaf = next((c for c in node.children.values() if tail[:len(c.key)] == c.key), None)
        self.pool.ref([page])
        if leaf is None:
            leaf = Node(tail, [page], node)
            self.num_pages += 1
        else:  # a shorter partial leaf: its tokens are tail's first, its rows the page's first
            del node.children[leaf.key]
            self.pool.unref(leaf.pages)
            leaf.key, leaf.pages = tail, [page]
        leaf.last_used = self.clock
        node.children[tail] = leaf
        return leaf

    def _drop_covered(self, node: Node, child: Node) -> None:
        """Removes node's partial leaves that child's first page starts with; their states go
        to child (same tokens, same positions)."""
        for leaf in [c for c in node.children.values() if child.key[:len(c.key)] == c.key]:
            del node.children[leaf.key]
            child.states.update(leaf.states)
            leaf.states = {}
            self.num_pages -= 1
            self.pool.unref(leaf.pages)

    def set_state(self, node: Node, state, is_end: bool = False) -> None:
        """Keeps state (valid after state.num_tokens tokens, on node's edge; replacing one
        there; is_end: kept at a request's end, see drop_ends); then drops other states while
        over the budget (locked or not: a request copies the state it resumes from): least
        recently used first (a match uses every state it covers), of those used together the
        request ends first (the match went past them), then the shallowest. The newest always
        stays: a budget below one state keeps just it."""
        self._drop_state(node, state.num_tokens)
        node.states[state.num_tokens] = Kept(state, self.clock, is_end)
        self.num_states += 1
        self.num_state_bytes += state.nbytes
        if self.state_budget is None or self.num_state_bytes <= self.state_budget:
            return
        held = sorted((kept.last_used, not kept.is_end, k, id(n), n) for n in self._nodes()
                      for k, kept in n.states.items() if n is not node or k != state.num_tokens)
        for *_, k, _, n in held:
            if self.num_state_bytes <= self.state_budget:
                break
            self._drop_state(n, k)

    def _drop_state(self, node: Node, num_tokens: int) -> None:
        kept = node.states.pop(num_tokens, None)
        if kept is not None:
            self.num_states -= 1
            self.num_state_bytes -= kept.state.nbytes

    def _usable(self, match: Match):
        """(num_tokens, node) of each state kept for a prefix of match's tokens inside it: on
        its path, or on the first page of another child of a path node that starts with the
        same tokens (a sub-page branch: its rows up to the state are the same)."""
        P, tokens = self.page_size, match.tokens
        path, node = [], match.node
        while node is not self.root:
            path.append(node)
            node = node.parent
        parent, depth = self.root, 0
        for child in path[::-1] + [None]:
            for c in parent.children.values():
                n = len(c.key) if c is child else _common(c.key[:P], tokens[depth:depth + P])
                yield from ((k, c) for k in c.states if k <= min(depth + n, match.num_tokens))
            if child is None:
                return
            parent, depth = child, depth + len(child.key)

    def deepest_state(self, match: Match):
        """(snapshot, its node): the deepest state usable inside match (_usable), or (None,
        root); every usable one counts as used now (LRU)."""
        usable = list(self._usable(match))
        for k, node in usable:
            node.states[k].last_used = self.clock
        if not usable:
            return None, self.root
        k, node = max(usable, key=lambda t: t[0])
        return node.states[k].state, node

    def drop_ends(self, match: Match, num_tokens: int) -> None:
        """Drops the request-end states (a prompt's end and the token before it, a generation's
        end) usable inside match before num_tokens: a request resuming at
        num_tokens continues the conversation past them (they served a regenerate or the next
        turn; kept, they would push its anchors out of the budget)."""
        for k, node in list(self._usable(match)):
            if k < num_tokens and node.states[k].is_end:
                self._drop_state(node, k)

    def covering(self, node: Node, num_tokens: int) -> Node:
        """The shallowest of node and its ancestors whose edge ends at or after num_tokens
        tokens from the root (the root for 0): the node to lock for that many tokens' pages."""
        end = self.depth(node)
        while node is not self.root and end - len(node.key) >= num_tokens:
            end, node = end - len(node.key), node.parent
        return node

    def depth(self, node: Node) -> int:
        """Tokens from the root to node's end."""
        n = 0
        while node is not self.root:
            n, node = n + len(node.key), node.parent
        return n

    def lock(self, node: Node) -> None:
        """Keeps node and its ancestors from eviction (counted: unlock once per lock)."""
        assert len(node.key) % self.page_size == 0, "a partial leaf is never locked"
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
            for k in list(leaf.states):
                self._drop_state(leaf, k)
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
        """{tokens of a cached prefix (tuple): its last page id} for every whole-page prefix and
        every partial leaf's (whole pages + its tokens): the tree's content, flat (for tests and
        their naive models)."""
        P, out = self.page_size, {}
        stack = [((), self.root)]
        while stack:
            prefix, node = stack.pop()
            for child in node.children.values():
                for k, page in enumerate(child.pages):
                    out[prefix + child.key[:(k + 1) * P]] = page
                stack.append((prefix + child.key, child))
        return out

    def check_integrity(self) -> None:
        """Asserts the tree's invariants: edges of whole pages keyed by their first page or
        partial leaves keyed by their tokens (none that a sibling's first page starts with),
        parent links, lock counts >= 0 and <= the parent's, each page held once and referenced
        in the pool, each state on the edge of its token, the page and state counters."""
        P, seen, locked, states, state_bytes = self.page_size, set(), 0, 0, 0
        for node in self._nodes():
            end = self.depth(node)
            for k, kept in node.states.items():
                assert k == kept.state.num_tokens and end - len(node.key) < k <= end, \
                    "a misplaced state"
                states, state_bytes = states + 1, state_bytes + kept.state.nbytes
            assert node.key and len(node.pages) == -(-len(node.key) // P), "pages and tokens"
            if len(node.key) % P:
                assert len(node.key) < P and not node.children and not node.lock_ref, \
                    "a partial page that is not a leaf's only page"
                assert not any(c is not node and c.key[:len(node.key)] == node.key
                               for c in node.parent.children.values()), "a partial leaf twice"
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
