"""The KV page pool, the radix prefix cache and the KV manager (freetoken/kv/) on random
request traces (hypothesis), against a naive model: a flat dict {cached prefix: its last page}
(whole pages, and partial leaves' prefixes), and the pages' content (token ids per row, copied
by the manager's copy_rows): every row a sequence or the tree vouches for holds its token."""
import pytest
from hypothesis import given, settings, strategies as st

from freetoken.errors import ModelError
from freetoken.kv import PagePool, RadixCache
from freetoken.kv.manager import KVManager
from freetoken.sequence import Sequence, Status

FEW = settings(max_examples=150, deadline=None)


def naive_match(cached: dict, tokens, P: int) -> int:
    """Tokens of the longest cached prefix of tokens: whole pages page by page, then the most
    of the next page that a cached prefix of it starts with."""
    i = 0
    while i < len(tokens) // P and tuple(tokens[:(i + 1) * P]) in cached:
        i += 1
    head, rest = tuple(tokens[:i * P]), list(tokens[i * P:(i + 1) * P])
    tail = [_common(k[i * P:], rest) for k in cached if i * P < len(k) <= (i + 1) * P
            and k[:i * P] == head]
    return i * P + max(tail, default=0)


def _common(x, y) -> int:
    return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))


class Rows:
    """The pages' content: {page: [token id per row]}; the sequences write, copy_rows copies."""

    def __init__(self, P: int):
        self.P, self.rows = P, {}

    def write(self, seq: Sequence, end: int) -> None:
        for j in range(seq.num_kv_tokens, end):
            self.rows.setdefault(seq.page_table[j // self.P], {})[j % self.P] = seq.tokens[j]
        seq.num_kv_tokens = end

    def copy(self, src: int, dst: int, n: int) -> None:
        assert 0 < n < self.P and src != dst
        self.rows[dst] = {j: t for j, t in self.rows[src].items() if j < n}

    def check(self, running: list, cached: dict) -> None:
        for s in running:
            got = [self.rows[s.page_table[j // self.P]][j % self.P] for j in range(s.num_kv_tokens)]
            assert got == s.tokens[:s.num_kv_tokens], "a sequence's K/V rows changed"
        for k, page in cached.items():
            r = len(k) - (len(k) - 1) // self.P * self.P
            assert [self.rows[page][j] for j in range(r)] == list(k[-r:]), "a cached row changed"


def check_holders(manager: KVManager, running: list) -> None:
    """Each page's count is its holders: running tables + the tree; free exactly at 0."""
    manager.check_integrity()
    tree = set(manager.radix.cached().values()) if manager.radix else set()
    for p, refs in enumerate(manager.pool.refs):
        holders = sum(p in s.page_table for s in running) + (p in tree)
        assert refs == holders, (p, refs, holders)
        assert refs >= 0 and (refs == 0) == (p in manager.pool.free), p
    for s in running:
        s.check(manager.page_size)
        cached = s.page_table[:s.num_cached_tokens // manager.page_size]
        assert set(cached) <= tree, "a running sequence's cached prefix was evicted"


def check_eviction(before: dict, after: dict) -> None:
    """The tree lost only whole subtrees (a prefix gone means its extensions are gone) and
    kept what it kept unchanged."""
    assert all(before.get(k) == v for k, v in after.items()), "the tree changed a prefix"
    for k in set(before) - set(after):
        assert not any(a[:len(k)] == k for a in after), "an extension outlived its prefix"


ops = st.lists(st.one_of(
    st.tuples(st.just("start"), st.lists(st.integers(0, 2), min_size=1, max_size=24)),
    st.tuples(st.just("decode"), st.integers(0, 7), st.integers(0, 2)),
    st.tuples(st.just("finish"), st.integers(0, 7)),
    st.tuples(st.just("evict"), st.integers(0, 6)),
), max_size=40)


@FEW
@given(ops, st.integers(1, 4), st.integers(2, 24), st.booleans())
def test_manager_against_naive_model(trace, page_size, num_pages, prefix_cache):
    pool, rows = PagePool(num_pages, page_size), Rows(page_size)
    m = KVManager(pool, prefix_cache, copy_rows=rows.copy)
    naive, running = {}, []
    for op in trace:
        before = m.radix.cached() if m.radix else {}
        if op[0] == "start":
            _, prompt = op
            seq = Sequence.from_prompt(prompt)
            try:
                m.admit(seq)
            except ModelError:  # no page for a partial last page: nothing was taken
                assert seq.status is Status.WAITING and not seq.page_table
                assert pool.num_free == 0 and m.num_evictable_pages == 0
                check_holders(m, running)
                continue
            want = naive_match(naive, prompt[:-1], page_size) if prefix_cache else 0
            assert seq.num_cached_tokens == seq.num_kv_tokens == want
            assert seq.page_table[:want // page_size] == \
                [naive[tuple(prompt[:(i + 1) * page_size])] for i in range(want // page_size)]
            running.append(seq)
            try:
                m.grow(seq, len(prompt))
                rows.write(seq, len(prompt))
            except ModelError:
                assert pool.num_free < pool.pages_for(len(prompt)) - len(seq.page_table)
        elif op[0] == "decode" and running:
            seq = running[op[1] % len(running)]
            seq.tokens.append(op[2])
            try:
                m.grow(seq, len(seq.tokens))
                rows.write(seq, len(seq.tokens))
            except ModelError:
                seq.tokens.pop()
        elif op[0] == "finish" and running:
            seq = running.pop(op[1] % len(running))
            m.release(seq)
            assert seq.status is Status.FINISHED
            if prefix_cache:  # its tokens are cached now, to the last (partial) page
                kv = tuple(seq.tokens[:seq.num_kv_tokens])
                assert naive_match(m.radix.cached(), kv + (-1,), page_size) == len(kv)
            before = m.radix.cached() if prefix_cache else {}
        elif op[0] == "evict" and m.radix:
            evictable = m.num_evictable_pages
            freed = m.radix.evict(op[1])
            assert min(op[1], evictable) <= freed <= evictable  # whole leaves: maybe more
        after = m.radix.cached() if m.radix else {}
        check_eviction(before, after)
        naive = after
        check_holders(m, running)
        rows.check(running, after)
    for seq in running:
        m.release(seq)
    check_holders(m, [])
    in_tree = set(m.radix.cached().values()) if m.radix else set()
    assert pool.num_free + len(in_tree) == num_pages, "a page neither free nor in the tree"


def test_radix_split_share_and_lru_eviction():
    pool = PagePool(8, 2)
    tree = RadixCache(pool)
    a, b = pool.alloc(3), pool.alloc(3)
    assert tree.insert([1, 2, 3, 4, 5, 6], a) == 0
    assert tree.insert([1, 2, 3, 4, 7, 8], b) == 4  # shares two pages: the edge splits there
    pool.unref(a + b)  # the tree is the only holder now
    tree.check_integrity()
    assert tree.match_prefix([1, 2, 3, 4, 7, 8, 9]).pages == [a[0], a[1], b[2]]
    assert tree.match_prefix([1, 2, 3]).pages == [a[0]]  # whole pages only
    assert pool.num_free == 8 - 4
    m = tree.match_prefix([1, 2, 3, 4, 5, 6])  # [5, 6] is now more recent than [7, 8]
    assert tree.evict(1) == 1 and tree.match_prefix([1, 2, 3, 4, 7, 8]).pages == a[:2]
    tree.lock(m.node)
    assert tree.num_evictable_pages == 0 and tree.evict(5) == 0  # locked: stays
    tree.unlock(m.node)
    assert tree.evict(5) == 3 and pool.num_free == 8
    tree.check_integrity()


class Snapshot:
    def __init__(self, num_tokens, nbytes=100):
        self.num_tokens, self.nbytes = num_tokens, nbytes


def test_radix_keeps_a_state_snapshot_at_its_node():
    pool = PagePool(4, 2)
    tree = RadixCache(pool)
    pages = pool.alloc(2)
    tree.insert([1, 2, 3, 4], pages, state=Snapshot(4))
    pool.unref(pages)  # the tree's alone
    m = tree.match_prefix([1, 2, 3, 4, 5])
    assert m.num_tokens == 4 and tree.deepest_state(m)[0].num_tokens == 4
    m = tree.match_prefix([1, 2, 9])
    assert m.num_tokens == 2 and tree.deepest_state(m)[0] is None  # the split's upper half has none
    assert (tree.num_states, tree.num_state_bytes) == (1, 100)
    assert tree.evict(2) == 2 and (tree.num_states, tree.num_state_bytes) == (0, 0)
    tree.check_integrity()


def test_radix_partial_leaves_are_matched_replaced_and_covered():
    """P = 4: a sequence's last partial page is a leaf; a longer one of the same tokens replaces
    it (its page and states kept in one node), a whole page starting with it absorbs it, one a
    cached page already starts with is not kept; a match takes rows of any page's start."""
    pool = PagePool(8, 4)
    tree = RadixCache(pool)
    a = pool.alloc(2)
    tree.insert([1, 2, 3, 4, 5, 6], a, state=Snapshot(6))  # [1 2 3 4] -> [5 6]
    assert tree.num_pages == 2 and tree.cached()[(1, 2, 3, 4, 5, 6)] == a[1]
    m = tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert (m.pages, m.num_tail, m.tail.pages, m.num_tokens) == ([a[0]], 2, [a[1]], 6)
    assert tree.deepest_state(m)[0].num_tokens == 6
    m = tree.match_prefix([1, 2, 3, 4, 5, 9])
    assert m.num_tokens == 5 and tree.deepest_state(m)[0] is None  # the state is after token 6
    b = pool.alloc(2)
    assert tree.insert([1, 2, 3, 4, 5, 6, 7], b, state=Snapshot(7)) == 4  # replaces [5 6]
    leaf = tree.match_prefix([1, 2, 3, 4, 5]).tail
    assert leaf.key == (5, 6, 7) and leaf.pages == [b[1]] and sorted(leaf.states) == [6, 7]
    assert pool.refs[a[1]] == 1 and tree.num_pages == 2  # the old page is its owner's alone
    assert tree.insert([1, 2, 3, 4, 5], b) == 4 and tree.num_pages == 2  # [5 6 7] starts so
    c = pool.alloc(3)
    tree.insert([1, 2, 3, 4, 5, 6, 7, 8, 9], c)  # a whole page starting with [5 6 7]
    assert tree.num_pages == 3 and pool.refs[b[1]] == 1
    node = tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).node
    assert node.pages == [c[1]] and sorted(node.states) == [6, 7]  # its states moved along
    d = pool.alloc(1)
    tree.insert([1, 2, 3, 4, 9], c[:1] + d)  # a sibling partial leaf
    assert tree.match_prefix([1, 2, 3, 4, 9, 9]).num_tokens == 5
    pool.unref(a + b + c + d)
    tree.check_integrity()
    assert tree.evict(8) == 4 and pool.num_free == 8 and tree.num_states == 0
    tree.check_integrity()


def test_pool_refuses_overdraw_and_double_release():
    pool = PagePool(2, 16)
    pages = pool.alloc(2)
    with pytest.raises(ModelError, match="--kv-tokens"):
        pool.alloc(1)
    pool.unref(pages)
    with pytest.raises(AssertionError):
        pool.unref(pages[:1])
    pool.check_integrity()
