"""The KV pool's elastic trigger (kv_grow.py) on the cpu device tier: with --kv-tokens below two
long requests' needs, the second one does not wait: the pool grows with memory taken from the
expert cache (trigger "kv"), both run at once, and once they end the pool shrinks back and the
cache grows back to its planned size; greedy tokens equal a run with a pool large enough; the
pool's books and the cache's integrity hold after every step. A grow the cache cannot pay for
leaves the request waiting, as --no-kv-grow does. Also PagePool.resize and KVPages.resize."""
import pytest
import torch

from freetoken.api import LLM
from freetoken.config import Tuning
from freetoken.kv import PagePool
from freetoken.kv_cache import KVPages
from freetoken.sampling import SamplingParams

# two prompts of 100 tokens + 60 generated: 5 pages each of 32 tokens, 10 > the pool's 8
PROMPTS = [[5 + (7 * i) % 300 for i in range(100)], [9 + (11 * i) % 290 for i in range(100)]]
PARAMS = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
OPTIONS = dict(device="cpu", expert_cache_frac=0.5, ctx_size=256, parallel=2)


def run_both(llm, each_step=None) -> tuple:
    """(each request's tokens, the most requests that ran at once), both submitted together."""
    engine = llm.engine
    reqs = [engine.submit(p, PARAMS) for p in PROMPTS]
    most = 0
    while not engine.scheduler.idle:
        engine.step()
        most = max(most, len(engine.scheduler.running))
        engine.kv_manager.check_integrity()
        engine.experts.cache.check_integrity()
        if each_step is not None:
            each_step(engine)
    engine.kv_manager.check_idle()
    return [r.take() for r in reqs], most


@pytest.fixture(scope="module")
def large_pool():
    """The tokens with a pool that holds both (ctx_size x parallel), run together."""
    with LLM(**OPTIONS) as llm:
        tokens, most = run_both(llm)
        assert most == 2 and llm.engine.resizes["kv"] == 0
        return tokens


def test_two_long_requests_run_together_on_memory_lent_by_the_cache(large_pool):
    # the memory watch checks after every step: it must not grow the cache over the lent slots
    with LLM(kv_tokens=256, tuning=Tuning(memory_watch_ms=0), **OPTIONS) as llm:
        engine = llm.engine
        plan = engine.memory_plan
        planned, base = plan.num_slots, engine.kv_pages.num_pages
        seen = []

        def each_step(e):
            p = e.memory_plan
            # the plan follows the storage and the cache; its total never grows
            assert p.kv == e.kv_pages.data.nbytes and p.kv_tokens == e.kv_pages.num_pages * 32
            assert p.expert_cache == e.experts.cache.storage.nbytes
            assert p.total <= plan.total
            assert e.kv_manager.pool.num_pages == e.kv_pages.num_pages
            seen.append((e.kv_pages.num_pages, p.num_slots, "taken from the expert cache"
                         in " ".join(p.lines())))

        tokens, most = run_both(llm, each_step)
        assert most == 2  # the second did not wait for the first
        assert tokens == large_pool
        grown = [s for s in seen if s[0] > base]
        assert grown and all(slots < planned and said for _, slots, said in grown)
        assert seen[-1] == (base, planned, False)  # all given back at the end
        assert engine.resizes == {"api": 0, "admin": 0, "memory": 0, "kv": 2}
        assert engine.kv_grow.num_grows == 1 and engine.watch.num_checks == len(seen)
        assert engine.kv_grow.num_returns == 1 and engine.kv_grow.slots_lent == 0
        assert engine.memory_plan == plan  # the plan as it was at load
        assert engine.watch.target_slots == planned  # the watch grows back to the planned size
        # the pool works as before: a request alone, then the two again
        assert tokens == run_both(llm)[0]


def test_a_grow_the_cache_cannot_pay_for_leaves_the_request_waiting(large_pool):
    with LLM(kv_tokens=256, device="cpu", expert_cache_gb=2.5 * 73728 / 1e9, ctx_size=256,
             parallel=2) as llm:
        engine = llm.engine
        # one page takes more than the cache's slots: nothing to lend
        assert engine.kv_pages.page_bytes > engine.memory_plan.expert_cache
        tokens, most = run_both(llm)
        assert most == 1 and tokens == large_pool
        assert engine.resizes["kv"] == 0 and "expert cache" in engine.kv_grow.refused
        assert engine.kv_pages.num_pages == 8


def test_no_kv_grow_waits_for_pages(large_pool):
    with LLM(kv_tokens=256, kv_grow=False, **OPTIONS) as llm:
        assert llm.engine.kv_grow is None
        tokens, most = run_both(llm)
        assert most == 1 and tokens == large_pool


def test_page_pool_resize_keeps_ids_and_counts():
    pool = PagePool(4, 2)
    held = pool.alloc(3)  # 0, 1, 2
    pool.resize(7)
    pool.check_integrity()
    assert pool.alloc(1) == [3]  # the free page below the added ones goes first
    assert sorted(pool.alloc(3)) == [4, 5, 6]
    pool.unref([4, 5, 6, 3])
    pool.resize(4)
    pool.check_integrity()
    assert pool.num_free == 1 and pool.refs[:3] == [1, 1, 1]
    with pytest.raises(AssertionError, match="past the new size is held"):
        pool.resize(2)
    pool.unref(held)
    pool.resize(2)
    pool.check_integrity()
    assert pool.num_free == 2


@pytest.mark.parametrize("staged", [False, True])
def test_kv_pages_resize_keeps_the_pages_below(staged):
    from types import SimpleNamespace
    config = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=3)
    pages = KVPages(config, 3, 4, "cpu", torch.float32)
    pages.data.copy_(torch.randn(pages.data.shape))
    before = pages.data.clone()
    pages.resize(5, staged)
    assert pages.data.shape[3] == 20 and pages.num_pages == 5
    assert torch.equal(pages.data[:, :, :, :12], before) and not pages.data[:, :, :, 12:].any()
    pages.resize(2, staged)
    assert torch.equal(pages.data, before[:, :, :, :8])


@pytest.mark.gpu
@pytest.mark.parametrize("staged", [False, True], ids=["beside", "staged"])
def test_two_long_requests_on_cuda(staged, monkeypatch):
    """As on the cpu tier, with captured decode steps (released and captured again at each
    move of the storage); staged: no room beside the old storage (through host memory)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from freetoken import kv_grow
    options = dict(OPTIONS, device="cuda", dtype="fp32")
    with LLM(**options) as llm:
        expected, _ = run_both(llm)
    if staged:
        monkeypatch.setattr(kv_grow, "device_free", lambda device, margin=0: 0)
    with LLM(kv_tokens=256, **options) as llm:
        engine = llm.engine
        planned = engine.memory_plan.num_slots
        assert engine.graphs is not None
        tokens, most = run_both(llm)
        assert most == 2 and tokens == expected
        assert engine.resizes["kv"] == 2 and engine.memory_plan.num_slots == planned
        assert engine.kv_pages.num_pages == 8
