"""The KV page pool, the radix prefix cache and the KV manager (freetoken/kv/) on random
request traces (hypothesis), against a naive model: a flat dict {page-aligned prefix: page}."""
import pytest
from hypothesis import given, settings, strategies as st

from freetoken.errors import ModelError
from freetoken.kv import PagePool, RadixCache
from freetoken.kv.manager import KVManager
from freetoken.sequence import Sequence, Status

FEW = settings(max_examples=150, deadline=None)


def naive_match(cached: dict, tokens, P: int) -> list:
    """Pages of the longest prefix of tokens' whole pages that is cached, page by page."""
    pages = []
    for i in range(len(tokens) // P):
        page = cached.get(tuple(tokens[:(i + 1) * P]))
        if page is None:
            break
        pages.append(page)
    return pages


def check_holders(manager: KVManager, running: list) -> None:
    """Each page's count is its holders: running tables + the tree; free exactly at 0."""
    manager.check_integrity()
    tree = set(manager.radix.cached().values()) if manager.radix else set()
    for p, refs in enumerate(manager.pool.refs):
        holders = sum(p in s.page_table for s in running) + (p in tree)
        assert refs == holders, (p, refs, holders)
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
    pool = PagePool(num_pages, page_size)
    m = KVManager(pool, prefix_cache)
    naive, running = {}, []
    for op in trace:
        before = m.radix.cached() if m.radix else {}
        if op[0] == "start":
            _, prompt = op
            seq = Sequence.from_prompt(prompt)
            m.admit(seq)
            want = naive_match(naive, prompt[:-1], page_size) if prefix_cache else []
            assert seq.page_table == want and seq.num_cached_tokens == len(want) * page_size
            running.append(seq)
            try:
                m.grow(seq, len(prompt))
                seq.num_kv_tokens = len(prompt)
            except ModelError:
                assert pool.num_free < pool.pages_for(len(prompt)) - len(seq.page_table)
        elif op[0] == "decode" and running:
            seq = running[op[1] % len(running)]
            seq.tokens.append(op[2])
            try:
                m.grow(seq, len(seq.tokens))
                seq.num_kv_tokens = len(seq.tokens)
            except ModelError:
                seq.tokens.pop()
        elif op[0] == "finish" and running:
            seq = running.pop(op[1] % len(running))
            kv = seq.tokens[:seq.num_kv_tokens]
            for i in range(len(kv) // page_size):
                naive.setdefault(tuple(kv[:(i + 1) * page_size]), seq.page_table[i])
            m.release(seq)
            assert seq.status is Status.FINISHED
            before = naive if prefix_cache else {}
        elif op[0] == "evict" and m.radix:
            evictable = m.num_evictable_pages
            freed = m.radix.evict(op[1])
            assert min(op[1], evictable) <= freed <= evictable  # whole leaves: maybe more
        after = m.radix.cached() if m.radix else {}
        check_eviction(before, after)
        naive = after
        check_holders(m, running)
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
    def __init__(self, name, nbytes=100):
        self.name, self.nbytes = name, nbytes


def test_radix_keeps_a_state_snapshot_at_its_node():
    pool = PagePool(4, 2)
    tree = RadixCache(pool)
    pages = pool.alloc(2)
    tree.insert([1, 2, 3, 4], pages, state=Snapshot("after 4"))
    pool.unref(pages)  # the tree's alone
    m = tree.match_prefix([1, 2, 3, 4, 5])
    assert m.num_tokens == 4 and m.node.state.name == "after 4"
    assert tree.match_prefix([1, 2, 9]).node.state is None  # the split's upper half has none
    assert tree.with_state(tree.match_prefix([1, 2, 9]).node) is tree.root
    assert (tree.num_states, tree.num_state_bytes) == (1, 100)
    assert tree.evict(2) == 2 and (tree.num_states, tree.num_state_bytes) == (0, 0)
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
