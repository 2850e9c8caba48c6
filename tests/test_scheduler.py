"""The scheduler (scheduler.py) on the bundled model, as a state machine against a naive model
(hypothesis): random submits, steps and cancels over a small KV pool. Invariants after every
operation: at most `parallel` requests run, the pool's books hold (no page both free and
referenced, no negative count), the pages the running requests hold (shared prefix pages once)
and may still take fit the pool (no step runs out of pages), and once every request has ended
each page is free or in the prefix tree. A request's greedy tokens equal what it gets alone, whatever ran beside it.
With kv_grow (kv_grow.py) a request short of pages grows the pool instead of waiting; the pool is
back at its planned size once every request has ended."""
import threading

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from freetoken import kv_cache
from freetoken.api import default_model_path
from freetoken.config import EngineConfig
from freetoken.engine import Engine
from freetoken.sampling import SamplingParams

PROMPTS = [[5, 9, 11, 3, 8, 2, 40, 41, 42, 7, 1, 3, 5],  # shared prefixes: cache hits
           [5, 9, 11, 3, 8, 2, 40, 41, 60, 61],
           [100, 101, 102],
           [5, 9, 11, 3, 8, 2, 40, 41, 42, 7, 1, 3, 5, 9, 9, 9, 8]]


@pytest.fixture(scope="module", params=[False, True], ids=["waits", "kv-grow"])
def engine(request):
    kv_cache.PAGE_SIZE, saved = 4, kv_cache.PAGE_SIZE  # small pages: tables interleave
    try:
        with Engine(default_model_path(), EngineConfig(device="cpu", parallel=3, kv_tokens=64,
                                                       ctx_size=32, prefill_chunk=5,
                                                       expert_cache_frac=0.3,
                                                       kv_grow=request.param)) as e:
            yield e
    finally:
        kv_cache.PAGE_SIZE = saved


@pytest.fixture(scope="module")
def alone(engine):
    """Each prompt's greedy tokens for max_tokens 1..6, alone on the engine."""
    out = {}
    for i, ids in enumerate(PROMPTS):
        full = list(engine.generate(ids, SamplingParams(temperature=0, max_tokens=6)))
        for n in range(1, 7):
            out[i, n] = full[:n]
    return out


OPS = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.integers(0, len(PROMPTS) - 1), st.integers(1, 6)),
    st.tuples(st.just("step"), st.integers(1, 3), st.just(0)),
    st.tuples(st.just("cancel"), st.integers(0, 20), st.just(0))), max_size=30)


def check(engine):
    sched, mgr = engine.scheduler, engine.kv_manager
    assert len(sched.running) <= sched.parallel
    mgr.check_integrity()
    # the pages the running requests hold (a cached prefix's pages shared, counted once) and
    # those they may still take fit the pool: no step runs out of pages
    held = {p for r in sched.running for p in r.seq.page_table}
    future = sum(max(0, sched._pages_needed(r) - len(r.seq.page_table)) for r in sched.running)
    assert len(held) + future <= mgr.pool.num_pages, "running requests may not all fit"
    for r in sched.running:
        r.seq.check(engine.kv_pages.page_size)
    assert mgr.pool.num_pages == engine.kv_pages.num_pages >= 16
    assert engine.memory_plan.kv == engine.kv_pages.data.nbytes


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_random_submits_steps_and_cancels(engine, alone, ops):
    reqs = []
    for op, a, b in ops:
        if op == "submit":
            reqs.append((a, b, engine.submit(PROMPTS[a], SamplingParams(temperature=0, max_tokens=b))))
        elif op == "step":
            for _ in range(a):
                engine.step()
        elif reqs:
            engine.cancel(reqs[a % len(reqs)][2])
        check(engine)
    while not engine.scheduler.idle:
        engine.step()
        check(engine)
    engine.kv_manager.check_idle()
    assert engine.kv_pages.num_pages == 16
    for i, n, r in reqs:
        got = r.take()
        if r.stats.stop_reason == "interrupted":  # cancelled: what it had is a prefix
            assert got == alone[i, n][:len(got)]
        else:
            assert got == alone[i, n], (i, n, r.stats.stop_reason)


@pytest.mark.parametrize("beside", [1, 2, 0])
def test_decodes_go_on_during_a_long_prefill(beside):
    """A sequence generating while a long prompt prefills: with decode_beside_every N its decode
    steps run between the prefill forward's MoE layers (one every N layers, every miss on the
    CPU), with 0 one after the chunk; either way every request's greedy tokens equal its own
    alone."""
    from freetoken.config import Tuning
    long_prompt = [(7 * i) % 300 + 5 for i in range(120)]
    params = SamplingParams(temperature=0, max_tokens=10)
    config = EngineConfig(device="cpu", parallel=2, prefill_chunk=128, expert_cache_frac=0.3,
                          tuning=Tuning(decode_beside_every=beside))
    with Engine(default_model_path(), config) as e:
        short_alone = list(e.generate(PROMPTS[2], params))
        long_alone = list(e.generate(long_prompt, params))
        e.kv_manager.radix.evict(e.kv_manager.num_evictable_pages)  # cold prefills below
        short = e.submit(PROMPTS[2], params)
        e.step()  # its prefill and first token
        first = short.take()
        assert len(first) == 1
        long = e.submit(long_prompt, params)
        e.step()  # the long prompt's one chunk, the short one decoding beside or after it
        during = short.take()
        layers = len(e.model_config.moe_layers)
        assert len(during) == (max(1, min(layers // beside, 9)) if beside else 1)
        e.experts.cache.check_integrity()
        while not e.scheduler.idle:
            e.step()
        assert first + during + short.take() == short_alone
        assert long.take() == long_alone
        e.kv_manager.check_idle()


@pytest.mark.parametrize("chunk, first_step", [(64, [1, 1, 1]), (20, [1, 0, 0]), (13, [1, 0, 0])])
def test_prompts_waiting_together_prefill_in_one_forward(chunk, first_step):
    """Requests prefilling at once share a forward (packed) while --prefill-chunk tokens last,
    oldest first: with room for all three, each has its first token after one step; with 20
    tokens the first (13) and 7 of the second's. Every request's greedy tokens equal its own
    alone, and each step runs one forward with at most `chunk` tokens."""
    params = SamplingParams(temperature=0, max_tokens=5)
    prompts = [PROMPTS[0], PROMPTS[1], [(11 * i) % 300 + 5 for i in range(17)]]
    with Engine(default_model_path(), EngineConfig(device="cpu", parallel=3, prefill_chunk=chunk,
                                                   expert_cache_frac=0.3)) as e:
        alone = [list(e.generate(p, params)) for p in prompts]
        e.kv_manager.radix.evict(e.kv_manager.num_evictable_pages)  # cold prefills below
        forwards = []
        model_forward, packed = e.model.forward, e.model.forward_packed
        e.model.forward = lambda ids, *a, **k: forwards.append(ids.shape[0]) or model_forward(ids, *a, **k)
        e.model.forward_packed = (lambda chunks, *a, **k: forwards.append(sum(len(c) for c in chunks))
                                  or packed(chunks, *a, **k))
        reqs = [e.submit(p, params) for p in prompts]
        e.step()
        firsts = [r.take() for r in reqs]
        assert [len(f) for f in firsts] == first_step
        assert forwards[0] == min(chunk, sum(map(len, prompts)))
        got = [[] for _ in reqs]
        while not e.scheduler.idle:
            e.step()
            for g, r in zip(got, reqs):
                g += r.take()
        assert max(forwards) <= chunk
        e.kv_manager.check_idle()
    assert [f + g for f, g in zip(firsts, got)] == alone


def _beside_engine(device: str, mode: str, policy: str = "hybrid"):
    from freetoken.config import Tuning
    return Engine(default_model_path(), EngineConfig(
        device=device, parallel=2, prefill_chunk=128, expert_cache_frac=0.3, policy=policy,
        tuning=Tuning(decode_beside=mode, prefill_choice="stream")))


LONG_PROMPT = [(7 * i) % 300 + 5 for i in range(120)]


def _decode_beside_long_prefill(e, hold_forward: bool):
    """The short prompt decodes (one step alone first: on cuda its graph is captured then),
    then the long prompt's one streamed chunk runs with the short one's steps beside it. With
    hold_forward the chunk's forward starts only once a decode step ended beside it (thread
    mode: they overlap for certain). -> (short's tokens, long's tokens, names of the threads
    that ran decode steps during the chunk)."""
    params = SamplingParams(temperature=0, max_tokens=10)
    short = e.submit(PROMPTS[2], params)
    e.step()  # its prefill and first token
    e.step()  # one decode step alone
    got = short.take()
    assert len(got) == 2
    stepped, threads = threading.Event(), []
    decode, forward = e.scheduler._decode, e.model.forward

    def traced_decode(reqs):
        decode(reqs)
        threads.append(threading.current_thread().name)
        stepped.set()

    def held_forward(ids, *a, **k):
        if ids.shape[0] == len(LONG_PROMPT) and hold_forward:
            assert stepped.wait(60), "no decode step ran beside the prefill forward"
        return forward(ids, *a, **k)

    e.scheduler._decode, e.model.forward = traced_decode, held_forward
    before = dict(e.experts.stats)
    try:
        long = e.submit(LONG_PROMPT, params)
        e.step()  # the long prompt's chunk, the short one decoding beside it
        during = list(threads)
    finally:
        e.scheduler._decode, e.model.forward = decode, forward
    after = e.experts.stats
    # nothing filled beside the prefill (the link is its own); its forward streamed every layer
    assert after["fills"] == before["fills"]
    assert (after["prefill_layers_streamed"] - before["prefill_layers_streamed"]
            == len(e.model_config.moe_layers))
    # its routes counted as prefill's, the decode steps' as decode's (each thread its own phase)
    mc = e.model_config
    assert (after["prefill_routes"] - before["prefill_routes"]
            == len(LONG_PROMPT) * mc.num_experts_per_tok * len(mc.moe_layers))
    e.experts.cache.check_integrity()
    while not e.scheduler.idle:
        e.step()
    e.kv_manager.check_idle()
    return got + short.take(), long.take(), during


@pytest.mark.parametrize("mode", ["interleave", "thread"])
def test_decode_thread_beside_a_streamed_prefill(mode):
    """Tuning decode_beside "thread": while the long prompt's forward streams every layer, the
    short request's decode steps run on a thread of their own (the forward waits here until one
    has ended, so they overlap it); "interleave" runs them on the scheduler's thread between
    the layers. Either way each request's greedy tokens equal its own alone."""
    with _beside_engine("cpu", mode) as e:
        params = SamplingParams(temperature=0, max_tokens=10)
        short_alone = list(e.generate(PROMPTS[2], params))
        long_alone = list(e.generate(LONG_PROMPT, params))
        e.kv_manager.radix.evict(e.kv_manager.num_evictable_pages)  # cold prefills below
        short, long, during = _decode_beside_long_prefill(e, hold_forward=mode == "thread")
        assert short == short_alone
        assert long == long_alone
        assert during, "no decode step during the chunk"
        if mode == "thread":
            assert set(during) == {"ft-decode-beside"}
        else:
            assert set(during) == {threading.main_thread().name}


def test_decode_thread_error_surfaces():
    """An exception in the decode thread beside a prefill forward is raised by the step that
    ran the forward (after the forward, the thread joined), not lost."""
    with _beside_engine("cpu", "thread") as e:
        params = SamplingParams(temperature=0, max_tokens=10)
        short = e.submit(PROMPTS[2], params)
        e.step()
        e.step()
        decode = e.scheduler._decode

        def failing(reqs):
            if threading.current_thread().name == "ft-decode-beside":
                raise RuntimeError("boom in the decode thread")
            decode(reqs)

        e.scheduler._decode = failing
        e.submit(LONG_PROMPT, params)
        with pytest.raises(RuntimeError, match="boom in the decode thread"):
            e.step()
        assert not any(t.name == "ft-decode-beside" for t in threading.enumerate())
        assert short.take()


def test_decode_beside_mode_is_checked():
    from freetoken.config import Tuning
    from freetoken.errors import ConfigError
    with pytest.raises(ConfigError, match="decode_beside must be one of interleave, thread"):
        Tuning(decode_beside="threads")
    assert Tuning().decode_beside == "interleave"


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["cpu", "hybrid"])
def test_decode_thread_beside_a_streamed_prefill_on_cuda(policy):
    """On cuda the decode thread replays its captured steps on a CUDA stream of its own while
    the prefill forward streams its layers on the scheduler's; the tokens equal each request's
    alone (policy cpu: every miss on the CPU alone too, so the routes run where they ran alone;
    hybrid: alone its misses fill, beside they run on the CPU: equal while the margins allow)."""
    with _beside_engine("cuda", "thread", policy) as e:
        params = SamplingParams(temperature=0, max_tokens=10)
        short_alone = list(e.generate(PROMPTS[2], params))
        long_alone = list(e.generate(LONG_PROMPT, params))
        e.kv_manager.radix.evict(e.kv_manager.num_evictable_pages)
        short, long, during = _decode_beside_long_prefill(e, hold_forward=True)
        assert set(during) == {"ft-decode-beside"}
        assert short == short_alone
        assert long == long_alone


def test_step_log_names_what_each_step_ran(caplog):
    """The DEBUG step log (bench_agent --step-log): a line per step with the requests admitted,
    the prompt tokens each chunk forwarded (the last chunk marked), where the decode steps ran;
    nothing when the logger is off."""
    import logging
    params = SamplingParams(temperature=0, max_tokens=2)
    with Engine(default_model_path(), EngineConfig(device="cpu", parallel=2,
                                                   prefill_chunk=8)) as e:
        with caplog.at_level(logging.INFO, logger="freetoken.scheduler"):
            list(e.generate([300, 301, 302], params))
        assert not caplog.records
        a = e.submit(list(range(3, 15)), params)  # 12 tokens: chunks of 8 and 4
        b = e.submit(list(range(20, 26)), params)  # 6: 4 beside a's last chunk, then 2
        with caplog.at_level(logging.DEBUG, logger="freetoken.scheduler"):
            while not (a.finished and b.finished):
                e.step()
    n, m = a.number, b.number
    assert (n, m) == (2, 3)
    lines = [r.getMessage().split(" | ", 1)[1] for r in caplog.records]
    assert lines == [
        "admitted [2, 3] | prefill #2: 8 | decode B=0 x 0 (after) | captured 0 | waiting 0",
        "admitted - | prefill #2: 4 (last), #3: 4 | decode B=0 x 0 (after) | captured 0 | waiting 0",
        "admitted - | prefill #3: 2 (last) | decode B=1 x 1 (interleaved) | captured 0 | waiting 0",
        "admitted - | prefill - | decode B=1 x 1 (after) | captured 0 | waiting 0"]
