"""States taken inside one prefill forward (Step.snapshots, models/linear_attention.py) on the
tiny hybrid models, fp32: the forward's logits and each state equal those of forwards chunked at
the same positions (the path before: a chunk ended at every state point) and a cold prefill of
exactly each prefix; the scheduler and Engine.score prefill a prompt with several closers in
ceil(tokens / --prefill-chunk) forwards and keep its states at exactly its state points."""
import math

import pytest
import torch

import make_tiny_model as mtm
from test_engine_oracle import Family
from freetoken import kv_cache
from freetoken.anchors import SNAPSHOTS_PER_FORWARD
from freetoken.sampling import SamplingParams
from freetoken.sequence import Sequence

TOL = 1e-5  # fp32: the same math, only the projections' matmuls see other row counts
CLOSE = 2  # <|im_end|>: the tiny models' EOS, a closer
# 150 tokens: past 2 x CHUNK (64) of the chunked delta rule, closers at 21, 43 and 97
PROMPT = [3 + (i * 37) % 380 for i in range(150)]
PROMPT[21] = PROMPT[43] = PROMPT[97] = CLOSE
# two forwards (70 + 80 tokens), each with states at its first tokens (their conv windows reach
# into the state before it: K - 1 = 3), at adjacent tokens (1-token segments), at its end, and
# inside segments longer than CHUNK
CHUNKS = [(0, 70, [1, 2, 5, 22, 23, 44, 70]), (70, 150, [71, 72, 98, 149, 150])]


@pytest.fixture(scope="module", params=mtm.HYBRID)
def hybrid(request, tmp_path_factory):
    return Family(tmp_path_factory.mktemp(request.param), request.param)


def devices():
    return [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


class Run:
    """One sequence of the engine's (no prefix cache), its own state: forward(ids, ends)."""

    def __init__(self, engine):
        self.engine = engine
        self.seq = Sequence.from_prompt(PROMPT)
        engine.kv_manager.admit(self.seq, use_cache=False)
        self.kv, self.state = engine.sequence_kv(self.seq), engine.new_state()

    def forward(self, start, stop, ends=()):
        """Logits [stop - start, V] of PROMPT[start:stop] and the states after each of ends,
        taken inside the one forward."""
        snaps = self.state.snapshots_at(ends)
        ids = torch.tensor(PROMPT[start:stop], device=self.engine.device)
        logits = self.engine.forward(self.kv, ids, state=self.state, snapshots=snaps)
        return logits, snaps

    def release(self):
        self.engine.kv_manager.release(self.seq)


def assert_states_close(ours, ref, what):
    assert ours.num_tokens == ref.num_tokens, what
    for name in ("conv", "recurrent"):
        a, b = getattr(ours, name), getattr(ref, name)
        worst = float((a - b).abs().max())
        assert worst <= TOL, f"{what}: {name} max |diff| {worst:.3g}"


def cold_state(engine, n):
    """The state after a cold prefill of exactly PROMPT[:n] (one forward)."""
    run = Run(engine)
    run.forward(0, n)
    snap = run.state.snapshot()
    run.release()
    return snap


@pytest.mark.parametrize("device", devices())
def test_states_inside_a_forward_equal_chunks_ending_there_and_a_cold_prefill(hybrid, device):
    with torch.no_grad(), hybrid.engine(device=device, prefill_chunk=256) as engine:
        inside, chunked = Run(engine), Run(engine)
        for start, stop, ends in CHUNKS:
            logits, snaps = inside.forward(start, stop, ends)
            ref_rows, refs, begin = [], [], start
            for end in ends + [stop]:  # the path before: a forward per segment
                if end > begin:
                    ref_rows.append(chunked.forward(begin, end)[0])
                    refs.append(chunked.state.snapshot())
                begin = end
            ref = torch.cat(ref_rows)
            worst = float((logits - ref).abs().max())
            assert worst <= TOL, f"{hybrid.family} logits of {start}..{stop}: {worst:.3g}"
            for snap, want in zip(snaps, refs):
                what = f"{hybrid.family} state at {snap.num_tokens}"
                assert_states_close(snap, want, what + " vs chunked there")
                assert_states_close(snap, cold_state(engine, snap.num_tokens), what + " vs cold")
            assert_states_close(inside.state.snapshot(), chunked.state.snapshot(), "after")
        inside.release()
        chunked.release()
        engine.kv_manager.check_idle()


def kept_states(radix, tokens):
    """{n: the StateSnapshot kept for exactly tokens[:n]}."""
    out = {}
    for n in range(1, len(tokens) + 1):
        state = radix.deepest_state(radix.match_prefix(tokens[:n]))[0]
        if state is not None and state.num_tokens == n:
            out[n] = state
    return out


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("how", ["scheduler", "score"])
def test_a_prompt_with_closers_takes_ceil_of_its_chunks_in_forwards(hybrid, monkeypatch, how,
                                                                     device):
    """Pages of 4, --state-interval 16, --prefill-chunk 32: PROMPT's 150 tokens in 5 forwards
    (not one per state point: 13 of them), its states kept at exactly its state points, each
    equal to a cold prefill of its prefix."""
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    chunk = 32
    with torch.no_grad(), hybrid.engine(device=device, prefill_chunk=chunk, state_interval=16,
                                        state_budget=1 << 30) as engine:
        points = engine.anchors.points(PROMPT, 0, len(PROMPT))
        assert points == [16, 22, 36, 44, 60, 76, 92, 98, 112, 128, 144, 149, 150]
        forwards = []
        forward = engine.forward

        def counting(kv, ids, *args, **kwargs):
            forwards.append((ids.shape[0], [s.num_tokens for s in kwargs.get("snapshots", ())]))
            return forward(kv, ids, *args, **kwargs)

        monkeypatch.setattr(engine, "forward", counting)
        if how == "scheduler":
            list(engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1)))
        else:
            engine.score(PROMPT, prefix_cache=True)
        monkeypatch.setattr(engine, "forward", forward)
        assert len(forwards) == math.ceil(len(PROMPT) / chunk) == 5
        assert [n for n, _ in forwards] == [32, 32, 32, 32, 22]
        assert [e for _, ends in forwards for e in ends] == points
        kept = kept_states(engine.kv_manager.radix, PROMPT)
        assert sorted(kept) == points
        ends = {k.state.num_tokens: k.is_end for node in engine.kv_manager.radix._nodes()
                for k in node.states.values()}
        assert ends == {p: p >= len(PROMPT) - 1 for p in points}  # request ends: 149, 150
        for n, snap in kept.items():
            assert_states_close(snap, cold_state(engine, n), f"{hybrid.family} kept at {n}")
        # the same prompt again resumes at its last token, from the state kept there
        again = engine.score(PROMPT, prefix_cache=True)
        assert engine.last_stats.cached_tokens == len(PROMPT) - 1
        run = Run(engine)
        cold = run.forward(0, len(PROMPT))[0][-1:]
        run.release()
        assert float((again - cold).abs().max()) <= 1e-4  # ATOL of the resume tests
        engine.kv_manager.check_idle()


@pytest.mark.parametrize("device", devices())
def test_prompts_prefilled_together_keep_each_ones_states(hybrid, monkeypatch, device):
    """Two prompts with closers submitted together (--parallel 2, --prefill-chunk 512): one packed
    forward prefills the first and as much of the second as its kept states allow, taking both's
    states at their state points; each kept state equals a cold prefill of its own prefix, and
    each request's greedy tokens equal its own alone."""
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    other = PROMPT[40:] + PROMPT[:30]  # closers at 3 and 57 of its 140 tokens
    params = SamplingParams(temperature=0, max_tokens=4)
    with torch.no_grad(), hybrid.engine(device=device, prefill_chunk=512, state_interval=16,
                                        state_budget=1 << 30, parallel=2) as engine:
        alone = [list(engine.generate(p, params)) for p in (PROMPT, other)]
        engine.kv_manager.radix.evict(engine.kv_manager.num_evictable_pages)  # cold below
        packed_calls = []
        packed = engine.forward_packed

        def counting(kvs, chunks, *args, **kwargs):
            packed_calls.append([len(c) for c in chunks])
            return packed(kvs, chunks, *args, **kwargs)

        monkeypatch.setattr(engine, "forward_packed", counting)
        reqs = [engine.submit(p, params, prefix_cache=True) for p in (PROMPT, other)]
        got = [[], []]
        while not engine.scheduler.idle:
            engine.step()
            for g, r in zip(got, reqs):
                g += r.take()
        monkeypatch.setattr(engine, "forward_packed", packed)
        # both in one forward, within its SNAPSHOTS_PER_FORWARD states: PROMPT's 13, then
        # `other` up to its 3rd state point (the rest in a forward of its own)
        room = SNAPSHOTS_PER_FORWARD - len(engine.anchors.points(PROMPT, 0, len(PROMPT)))
        assert packed_calls == [[len(PROMPT), engine.anchors.points(other, 0, len(other))[room - 1]]]
        assert got == alone
        for tokens in (PROMPT, other):
            kept = kept_states(engine.kv_manager.radix, tokens)
            points = engine.anchors.points(tokens, 0, len(tokens))
            assert set(points) - {len(tokens) - 1} <= set(kept)  # 149: dropped once resumed past
            for n in points:
                if n in kept:
                    assert_states_close(kept[n], cold_state_of(engine, tokens, n),
                                        f"{hybrid.family} kept at {n}")
        engine.kv_manager.check_idle()


def cold_state_of(engine, tokens, n):
    """The state after a cold prefill of exactly tokens[:n] (one forward)."""
    seq = Sequence.from_prompt(tokens[:n])
    engine.kv_manager.admit(seq, use_cache=False)
    kv, state = engine.sequence_kv(seq), engine.new_state()
    engine.forward(kv, torch.tensor(tokens[:n], device=engine.device), state=state)
    snap = state.snapshot()
    engine.kv_manager.release(seq)
    return snap
