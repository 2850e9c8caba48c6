"""Recurrent-state checkpoints at anchors (anchors.py, kv/radix.py states, scheduler.py): which
tokens close a block, where states are kept, a kept state always belongs to exactly the prefix a
request takes and is never dropped under a running sequence (hypothesis, over KVManager with
token-tuple states), and on the tiny hybrid models (fp32, pages of 4 tokens) edits at, before
and after anchors resume with a cold prefill's and transformers' logits while several sequences
run together."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import make_tiny_model as mtm
from serve_support import QWEN_TEMPLATE
from test_engine_oracle import Family, assert_close
from freetoken import kv_cache
from freetoken.anchors import Anchors, closer_token_ids, next_chunk_end
from freetoken.kv import PagePool
from freetoken.kv.manager import KVManager
from freetoken.sampling import SamplingParams
from freetoken.sequence import Sequence, Status
from freetoken.tokenizer import Tokenizer

BLOCKS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
          "</tool_response>"]


# ---- which tokens close a block, where states are kept -------------------------------------------

def test_closers_come_from_the_added_tokens_and_the_template():
    """Qwen-style: the closing tags the template writes and its turn end (the EOS <|im_end|>);
    not the openers, <|im_start|>, nor an added closing tag the template never writes."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer
    tok = HFTokenizer.from_str(mtm.tokenizer_json(384))
    tok.add_tokens([AddedToken(t, special=False) for t in BLOCKS + ["</other>"]])
    ids = {t: tok.token_to_id(t) for t in BLOCKS + ["</other>", "<|im_end|>"]}
    ours = Tokenizer(tok.to_str(), QWEN_TEMPLATE, 0, (2,))
    assert ids["<|im_end|>"] == 2
    assert closer_token_ids(ours) == {ids[t] for t in ("</think>", "</tool_call>",
                                                       "</tool_response>", "<|im_end|>")}
    assert closer_token_ids(Tokenizer(tok.to_str(), None, 0, (2,))) == {2}  # no template: EOS


def test_points_round_anchors_down_to_pages():
    """The module docstring's example, and a prefill that starts past some of them."""
    anchors = Anchors(frozenset({7}), interval=8, page_size=4)
    tokens = [1, 1, 1, 1, 1, 7] + [1] * 13  # closer at index 5, 19 tokens
    assert anchors.points(tokens, 0, 19) == [4, 12, 16]
    assert anchors.points(tokens, 4, 19) == [12, 16]
    assert anchors.points(tokens, 0, 6) == [4]  # a prompt ending at the anchor
    assert anchors.points(tokens, 0, 16) == [4, 12, 16]  # 16 for what follows, 12 to redo it
    assert [next_chunk_end(s, 19, 10, [4, 12, 16]) for s in (0, 4, 12, 16)] == [4, 12, 16, 19]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.integers(1, 12),
       st.integers(1, 5), st.data())
def test_points_cover_every_anchor_and_long_span(tokens, interval, page_size, data):
    """Points are page boundaries in (start, end]; each anchor, and each stretch of interval
    tokens without one, has a point within a page before it."""
    end = data.draw(st.integers(1, len(tokens)))
    start = data.draw(st.integers(0, end - 1))
    points = Anchors(frozenset({0}), interval, page_size).points(tokens, start, end)
    assert points == sorted(set(points))
    assert all(p % page_size == 0 and start < p <= end for p in points)
    anchors = [i + 1 for i, t in enumerate(tokens[:end]) if t == 0] + [end]
    last = 0
    for a in anchors:
        for want in [*range(last + interval, a, interval), a]:
            if want - want % page_size > start:
                assert any(want - page_size < p <= want for p in points), (want, points)
        last = a


def test_config_refuses_a_bad_interval_or_budget():
    from freetoken.config import STATES_PER_SEQUENCE, EngineConfig
    from freetoken.errors import ConfigError
    with pytest.raises(ConfigError, match="--state-interval must be >= 1"):
        EngineConfig(state_interval=0)
    with pytest.raises(ConfigError, match="--state-budget must be >= 0"):
        EngineConfig(state_budget=-1)
    assert EngineConfig(parallel=3).num_default_states == 3 * STATES_PER_SEQUENCE


# ---- kept states in the prefix tree (KVManager, token-tuple states) ------------------------------

class FakeState:
    """A state that is the tokens it was computed from (what a real state depends on)."""

    def __init__(self, tokens):
        self.tokens, self.num_tokens, self.nbytes = tuple(tokens), len(tokens), 10


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "forward", "save", "release"]),
                          st.integers(0, 5), st.lists(st.integers(0, 1), min_size=2, max_size=14)),
                min_size=1, max_size=40),
       st.integers(0, 40))
def test_a_taken_state_is_the_prefix_s_and_stays_while_locked(ops, budget):
    """Random admits (prompts over 2 tokens: they share prefixes), forwards, saved states at
    page boundaries and releases, in a pool of 12 pages of 2 tokens under a budget of 0-4
    states: an admitted sequence's state is exactly its cached prefix's tokens, and no state
    of a node a running sequence holds is ever dropped (by page eviction or the budget)."""
    P = 2
    mgr = KVManager(PagePool(12, P), prefix_cache=True, needs_state=True, state_budget=budget)
    running = []  # (seq, state tokens: what its recurrent state has seen)
    for op, which, prompt in ops:
        if op == "admit":
            seq = Sequence.from_prompt(prompt)
            snap = mgr.admit(seq)
            n = seq.num_cached_tokens
            assert (snap.tokens if snap is not None else ()) == tuple(seq.tokens[:n]), "wrong state"
            running.append((seq, list(seq.tokens[:n])))
        elif running:
            seq, seen = running[which % len(running)]
            if op == "forward" and seq.num_kv_tokens < len(seq.tokens):
                end = min(len(seq.tokens), seq.num_kv_tokens + 1 + which)
                need = mgr.pool.pages_for(end) - len(seq.page_table)
                if need > mgr.pool.num_free + mgr.num_evictable_pages:
                    continue
                mgr.grow(seq, end)
                seen += seq.tokens[seq.num_kv_tokens:end]
                seq.num_kv_tokens = end
            elif op == "save" and seq.num_kv_tokens >= P:
                n = seq.num_kv_tokens - seq.num_kv_tokens % P
                mgr.save_state(seq, FakeState(seen[:n]))
            elif op == "release":
                mgr.release(seq)
                running.remove((seq, seen))
        mgr.check_integrity()
        for seq, _ in running:
            seq.check(P)
            if seq.prefix_node is not None:
                assert seq.prefix_node.state is not None, "a held state was dropped"
                assert seq.prefix_node.state.tokens == tuple(seq.tokens[:seq.num_cached_tokens])
    for seq, _ in running:
        mgr.release(seq)
    mgr.check_idle()


def test_the_budget_drops_the_least_recently_used_unheld_state_alone():
    mgr = KVManager(PagePool(8, 2), needs_state=True, state_budget=20)
    for prompt in ([1, 1, 5], [2, 2, 5], [3, 3, 5]):
        seq = Sequence.from_prompt(prompt)
        mgr.admit(seq)
        mgr.grow(seq, 2)
        seq.num_kv_tokens = 2
        mgr.save_state(seq, FakeState(prompt[:2]))
        mgr.release(seq)
    radix = mgr.radix
    assert radix.num_states == 2 and radix.num_state_bytes == 20
    assert radix.match_prefix([1, 1]).node.state is None  # the oldest, its pages kept
    assert radix.match_prefix([3, 3]).node.state.tokens == (3, 3)
    assert len(radix.cached()) == 3
    seq = Sequence.from_prompt([1, 1, 5])
    assert mgr.admit(seq) is None and seq.num_cached_tokens == 0  # pages without a state
    mgr.release(seq)
    held = Sequence.from_prompt([2, 2, 5])
    assert mgr.admit(held).tokens == (2, 2) and held.num_cached_tokens == 2
    for prompt in ([4, 4, 5], [6, 6, 5]):  # newer states: the held one stays, over the budget
        seq = Sequence.from_prompt(prompt)
        mgr.admit(seq)
        mgr.grow(seq, 2)
        seq.num_kv_tokens = 2
        mgr.save_state(seq, FakeState(prompt[:2]))
        mgr.release(seq)
        assert held.prefix_node.state.tokens == (2, 2)
    assert radix.num_states == 2 and radix.match_prefix([4, 4]).node.state is None
    mgr.release(held)
    mgr.check_idle()


# ---- the tiny hybrid models ----------------------------------------------------------------------

CLOSE = 2  # <|im_end|>: the tiny models' EOS, written by their template after every turn
# 58 tokens: closers at 21 (anchor 22, state kept at 20) and 43 (anchor 44, on a page boundary)
BASE = [3 + (i * 37) % 380 for i in range(58)]
BASE[21] = BASE[43] = CLOSE
EDITS = {  # edited index -> the cached prefix the edited prompt resumes from
    "after the second anchor": (50, 44),
    "at the second anchor": (44, 44),
    "of the second closer": (43, 20),
    "between the anchors": (30, 20),
    "at the first anchor's page": (20, 20),
    "before the first anchor": (12, 0),
}


@pytest.fixture(scope="module", params=mtm.HYBRID)
def hybrid(request, tmp_path_factory):
    return Family(tmp_path_factory.mktemp(request.param), request.param)


def edited(i):
    ids = list(BASE)
    ids[i] = 7 if ids[i] != 7 else 8
    return ids


def run_together(engine, prompts, params):
    """The prompts submitted together, stepped to the end: per request the logits rows its
    tokens were sampled from [num_sampled, V] and its stats; the pool is idle afterwards."""
    rows = {}
    sample = engine.scheduler._sample

    def recording(reqs):
        for r in reqs:
            rows.setdefault(id(r), []).append(r.logits.clone())
        sample(reqs)

    engine.scheduler._sample = recording
    reqs = [engine.submit(ids, params) for ids in prompts]
    most = 0
    while not all(r.finished for r in reqs):
        engine.step()
        most = max(most, len(engine.scheduler.running))
    engine.scheduler._sample = sample
    assert most == len(prompts), "the requests did not run together"
    engine.kv_manager.check_idle()
    return [(torch.stack(rows[id(r)]), r.stats, r.tokens[len(ids):len(ids) + 3].tolist())
            for r, ids in zip(reqs, prompts)]


def test_edits_resume_from_the_nearest_state(hybrid, monkeypatch):
    """BASE once (its states kept at 20, 44 and 56), then the six edits of it together: each
    takes the prefix up to the nearest kept state before its edit, and its first token's and 2
    decode steps' logits equal a cold prefill's and transformers'."""
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [edited(i) for i, _ in EDITS.values()]
    with hybrid.engine(expert_cache_frac=0.5, parallel=len(prompts), prefill_chunk=8) as engine:
        assert engine.anchors.closer_ids == {CLOSE}
        list(engine.generate(BASE, SamplingParams(temperature=0, max_tokens=1)))
        assert engine.kv_manager.radix.num_states == 3
        warm = run_together(engine, prompts, params)
        cold = [engine.score(ids + out[:2]) for ids, (_, _, out) in zip(prompts, warm)]
    for (what, (_, hit)), ids, (rows, stats, out), ref in zip(EDITS.items(), prompts, warm, cold):
        assert stats.cached_tokens == hit, f"{hybrid.family} edit {what}"
        n = len(ids)
        assert_close(rows, ref[n - 1:], f"{hybrid.family} edit {what} vs cold")
        with torch.no_grad():
            hf = hybrid.hf(torch.tensor([ids + out[:2]])).logits[0, n - 1:]
        assert_close(rows, hf, f"{hybrid.family} edit {what} vs transformers")


def test_the_next_turn_resumes_after_the_answer(hybrid, monkeypatch):
    """A conversation's next turn (prompt + answer + closer + new tokens) resumes from the state
    kept when the answer ended (its last page boundary), and equals transformers."""
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    with hybrid.engine(expert_cache_frac=0.5, prefill_chunk=8) as engine:
        first = BASE[:22]
        answer = list(engine.generate(first, params))
        forwarded = len(first) + len(answer) - 1  # the last token was sampled, not forwarded
        turn = first + answer + [CLOSE, 40, 41, 42]
        logits = engine.score(turn, prefix_cache=True)
        hit = engine.last_stats.cached_tokens
        engine.kv_manager.check_idle()
    assert hit == forwarded - forwarded % 4
    with torch.no_grad():
        ref = hybrid.hf(torch.tensor([turn])).logits[0, hit:]
    assert_close(logits, ref, f"{hybrid.family} next turn")


def test_no_state_checkpoints_turns_the_prefix_cache_off(hybrid, monkeypatch):
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    with hybrid.engine(state_checkpoints=False) as engine:
        assert engine.anchors is None and engine.kv_manager.radix is None
        engine.score(BASE)
        engine.score(BASE, prefix_cache=True)
        assert engine.last_stats.cached_tokens == 0
        assert engine.last_stats.kv.state_budget == 0


def test_states_stay_under_the_budget_and_show_in_the_kv_lines(hybrid, monkeypatch):
    """A budget of 2 states: after 3 prompts of 2 kept states each, 2 are left (the newest),
    and the KV lines say so."""
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    with hybrid.engine(state_budget=1) as engine:
        size = engine.state.nbytes
    with hybrid.engine(state_budget=2 * size) as engine:
        for k in range(3):
            engine.score([10 + k] * 9 + [CLOSE] + [20 + k] * 4)  # states at 8 and 12
        radix = engine.kv_manager.radix
        assert (radix.num_states, radix.num_state_bytes) == (2, 2 * size)
        assert radix.match_prefix([12] * 9 + [CLOSE] + [22] * 3).node.state is not None
        line = engine.last_stats.kv.lines()[-1]
    assert line.startswith("KV states      = 2 kept at anchors") and "MB" in line


def test_bench_agent_edits_reprefills_about_the_edited_suffix(hybrid, monkeypatch, capsys):
    """tools/bench_agent.py --edits on a tiny hybrid (pages of 4): with anchors every request
    prefills at most its edited suffix + a page (+ the kept head of a truncated tool output,
    which follows the anchor before it), and never more than with states at prefill ends only,
    nor that more than without reuse."""
    import bench_agent
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    results, reqs = bench_agent.main([hybrid.ftw, "--device", "cpu", "--dtype", "fp32", "--edits",
                                      "--system", "20", "--turns", "6", "--tool", "6,12",
                                      "--reply", "2,5", "--from", "1",
                                      "--state-budget", str(1 << 30)])
    a, b, c = (results[m] for m in bench_agent.MODES)
    assert [k for k, *_ in reqs[:4]] == ["append", "truncate", "regenerate", "append"]
    assert "drop" in [k for k, *_ in reqs]
    for k, (kind, prompt, _, suffix) in enumerate(reqs):
        assert a[k][0] == len(prompt), kind
        assert c[k][0] <= b[k][0] <= a[k][0], (k, kind)
        kept = bench_agent.TRUNCATED if kind == "truncate" else 0  # after the output's anchor
        assert c[k][0] <= suffix + kept + 4, (k, kind, suffix)
    assert sum(r[0] for r in c) < sum(r[0] for r in b)  # anchors help past prefill ends
    assert "prefilled <=" in capsys.readouterr().out


def test_a_closer_in_the_answer_keeps_the_state_before_it(hybrid, monkeypatch):
    """Decoding: a generated closer (forced here) keeps the state at the page boundary before it
    (24), the answer's end its last page boundary (28), beside the prompt's (20)."""
    from bench_agent import Forced
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    answer = [5, 6, CLOSE, 7, 8, 9, 10, 11, 12]  # at positions 22..30: the closer at 24
    params = SamplingParams(temperature=0, max_tokens=len(answer), ignore_eos=True)
    with hybrid.engine(expert_cache_frac=0.5, prefill_chunk=8) as engine:
        assert list(engine.generate(BASE[:22], params, Forced(answer))) == answer
        radix = engine.kv_manager.radix
        tokens = BASE[:22] + answer
        kept = [n for n in range(4, 32, 4) if radix.match_prefix(tokens[:n]).node.state is not None]
        assert kept == [20, 24, 28]
        again = engine.score(tokens[:26] + [40, 41], prefix_cache=True)
        assert engine.last_stats.cached_tokens == 24
    with torch.no_grad():
        ref = hybrid.hf(torch.tensor([tokens[:26] + [40, 41]])).logits[0, 24:]
    assert_close(again, ref, f"{hybrid.family} after a generated closer")


def test_any_cached_prompt_equals_transformers(hybrid, monkeypatch):
    """Hypothesis over prompts that share prefixes and closers (tokens 2, 5, 6 only after the
    first page, so that they meet): each one, scored from whatever the cache holds then, equals
    transformers at every prefilled position."""
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    with hybrid.engine(prefill_chunk=6, state_interval=8) as engine:

        @settings(max_examples=25, deadline=None)
        @given(st.lists(st.sampled_from([CLOSE, 5, 6]), min_size=2, max_size=30))
        def check(tail):
            ids = [9, 10, 11, 12] + tail
            logits = engine.score(ids, prefix_cache=True)
            hit = engine.last_stats.cached_tokens
            with torch.no_grad():
                ref = hybrid.hf(torch.tensor([ids])).logits[0, hit:]
            assert_close(logits, ref, f"{hybrid.family} {ids} from {hit}")
            engine.kv_manager.check_idle()

        check()
        assert engine.kv_stats.cached_tokens > 0  # some prompts did resume
