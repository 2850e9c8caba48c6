"""Recurrent-state checkpoints at anchors (anchors.py, kv/radix.py states, scheduler.py): which
tokens close a block, where states are kept, a kept state always belongs to exactly the prefix a
request takes and is never dropped under a running sequence (hypothesis, over KVManager with
token-tuple states), and on the tiny hybrid models (fp32, pages of 4 tokens) edits at, before
and after anchors resume with a cold prefill's and transformers' logits while several sequences
run together."""
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

import make_tiny_model as mtm
from serve_support import QWEN_TEMPLATE
from test_engine_oracle import Family, assert_close
from test_kv_pages import Rows
from freetoken import anchors as anchors_module, kv_cache
from freetoken.anchors import Anchors, closer_token_ids, next_chunk_end
from freetoken.errors import ModelError
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


def test_points_are_the_anchors_and_long_spans_pages():
    """The module docstring's example, and a prefill that starts past some of them."""
    anchors = Anchors(frozenset({7}), interval=8, page_size=4)
    tokens = [1, 1, 1, 1, 1, 7] + [1] * 13  # closer at index 5, 19 tokens
    assert anchors.points(tokens, 0, 19) == [6, 12, 18, 19]
    assert anchors.points(tokens, 6, 19) == [12, 18, 19]
    assert anchors.points(tokens, 0, 6) == [5, 6]  # a prompt ending at the anchor
    assert anchors.points(tokens, 0, 16) == [6, 12, 15, 16]  # 16 for what follows, 15 to redo it
    # chunks end at --prefill-chunk and the prompt end, not at points (taken inside a forward)
    assert [next_chunk_end(s, 19, 10, [6, 12, 18, 19]) for s in (0, 10, 12)] == [10, 19, 19]


def test_a_chunk_ends_at_its_last_snapshot_when_it_has_too_many(monkeypatch):
    monkeypatch.setattr(anchors_module, "SNAPSHOTS_PER_FORWARD", 2)
    points = [3, 5, 7, 9, 19]
    assert [next_chunk_end(s, 19, 10, points) for s in (0, 5, 9)] == [5, 15, 19]  # 3, 2, 1 inside
    assert next_chunk_end(0, 19, 4, points) == 4  # 1 point inside


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.integers(1, 12),
       st.integers(1, 5), st.data())
def test_points_cover_every_anchor_and_long_span(tokens, interval, page_size, data):
    """Points lie in (start, end]; each anchor (end and end - 1 too) is one, and each stretch of
    interval tokens without one has a point within a page before it."""
    end = data.draw(st.integers(1, len(tokens)))
    start = data.draw(st.integers(0, end - 1))
    points = Anchors(frozenset({0}), interval, page_size).points(tokens, start, end)
    assert points == sorted(set(points))
    assert all(start < p <= end for p in points)
    anchors = [i + 1 for i, t in enumerate(tokens[:end]) if t == 0] + [end]
    assert {a for a in anchors + [end - 1] if a > start} <= set(points)
    last = 0
    for a in anchors:
        for want in range(last + interval, a, interval):
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


# found by CI's hypothesis run: a state saved at a page before a running sequence's last one
# left its partial leaf counted as evictable (num_available promised a page grow() lacked)
@example(ops=[
    ('admit', 0, [0, 0]),
    ('admit', 0, [0, 0]),
    ('release', 0, [0, 0]),
    ('admit', 0, [0, 0, 0, 0, 0, 0, 0, 0, 0]),
    ('forward', 0, [0, 0]),
    ('forward', 3, [0, 0]),
    ('admit', 0, [0, 0, 0, 0, 0]),
    ('forward', 5, [0, 0]),
    ('save', 1, [0, 0]),
    ('save', 0, [0, 0]),
    ('admit', 0, [0, 0]),
    ('forward', 5, [0, 0]),
    ('admit', 0, [0, 0, 0, 0, 0]),
    ('admit', 0, [0, 0]),
    ('release', 0, [0, 0]),
    ('forward', 3, [0, 0])], budget=0)
@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "forward", "save", "release"]),
                          st.integers(0, 5), st.lists(st.integers(0, 1), min_size=2, max_size=14)),
                min_size=1, max_size=40),
       st.integers(0, 40))
def test_a_taken_state_is_the_prefix_s_and_the_budget_holds(ops, budget):
    """Random admits (prompts over 2 tokens: they share prefixes), forwards, states saved at
    any token (request ends or anchors) and releases, in a pool of 12 pages of 2 tokens under
    a budget of 0-4 states: an admitted sequence's state is exactly its cached prefix's tokens,
    the K/V rows it took (whole pages shared, a partial one copied) hold exactly them, a grow
    within num_available() always finds its pages, and the states stay within the budget (or
    the newest alone)."""
    P, rows = 2, Rows(2)
    mgr = KVManager(PagePool(12, P), prefix_cache=True, needs_state=True, state_budget=budget,
                    copy_rows=rows.copy)
    running = []  # (seq, state tokens: what its recurrent state has seen)
    for op, which, prompt in ops:
        if op == "admit":
            seq = Sequence.from_prompt(prompt)
            try:
                snap = mgr.admit(seq)
            except ModelError:  # no page for a partial one: nothing taken
                assert seq.status is Status.WAITING and not seq.page_table
                mgr.check_integrity()
                continue
            n = seq.num_cached_tokens
            assert (snap.tokens if snap is not None else ()) == tuple(seq.tokens[:n]), "wrong state"
            running.append((seq, list(seq.tokens[:n])))
        elif running:
            seq, seen = running[which % len(running)]
            if op == "forward" and seq.num_kv_tokens < len(seq.tokens):
                end = min(len(seq.tokens), seq.num_kv_tokens + 1 + which)
                need = mgr.pool.pages_for(end) - len(seq.page_table)
                if need > mgr.num_available([s for s, _ in running]):
                    continue
                mgr.grow(seq, end)
                seen += seq.tokens[seq.num_kv_tokens:end]
                rows.write(seq, end)
            elif op == "save" and seq.num_kv_tokens >= 1:
                n = max(1, seq.num_kv_tokens - which)
                mgr.save_state(seq, FakeState(seen[:n]), is_end=which % 2 == 1)
            elif op == "release":
                mgr.release(seq)
                running.remove((seq, seen))
        mgr.check_integrity()
        rows.check([s for s, _ in running], mgr.radix.cached())
        assert mgr.radix.num_state_bytes <= max(budget, 10), "over the budget"
        for seq, _ in running:
            seq.check(P)
    for seq, _ in running:
        mgr.release(seq)
    mgr.check_idle()


def state_at(radix, tokens):
    """The deepest state kept inside the longest cached prefix of tokens (None: none)."""
    return radix.deepest_state(radix.match_prefix(tokens))[0]


def test_the_budget_drops_the_least_recently_used_state_alone():
    """Budget of 2 states: the oldest goes, its pages kept; a state a running sequence resumed
    from goes too when it is the oldest (restored: a copy), its pages stay locked."""
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
    assert state_at(radix, [1, 1]) is None  # the oldest, its pages kept
    assert state_at(radix, [3, 3]).tokens == (3, 3)
    assert len(radix.cached()) == 3
    seq = Sequence.from_prompt([1, 1, 5])
    assert mgr.admit(seq) is None and seq.num_cached_tokens == 0  # pages without a state
    mgr.release(seq)
    held = Sequence.from_prompt([2, 2, 5])
    assert mgr.admit(held).tokens == (2, 2) and held.num_cached_tokens == 2
    for prompt in ([4, 4, 5], [6, 6, 5]):  # newer states: (3, 3), then the held (2, 2) go
        seq = Sequence.from_prompt(prompt)
        mgr.admit(seq)
        mgr.grow(seq, 2)
        seq.num_kv_tokens = 2
        mgr.save_state(seq, FakeState(prompt[:2]))
        mgr.release(seq)
    assert radix.num_states == 2 and state_at(radix, [2, 2]) is None
    assert state_at(radix, [4, 4]).tokens == (4, 4) and state_at(radix, [6, 6]).tokens == (6, 6)
    assert radix.cached()[(2, 2)] == held.page_table[0] and radix.num_evictable_pages == 4
    mgr.release(held)
    mgr.check_idle()


def kept_in(tree) -> list:
    """The tokens of every state the tree keeps, sorted."""
    return sorted(kept.state.tokens for node in tree._nodes() for kept in node.states.values())


def test_the_budget_drops_request_ends_first_among_states_used_together():
    """P = 2, room for 3 states: a match uses every state it covers; of states used together
    the budget drops the request ends first, then the shallowest."""
    from freetoken.kv import RadixCache
    pool = PagePool(8, 2)
    tree = RadixCache(pool, state_budget=30)
    tokens, pages = [1, 1, 2, 2, 3, 3], pool.alloc(3)
    for n, is_end in ((2, False), (3, True), (6, False)):  # the partial leaf [2] is absorbed
        tree.insert(tokens[:n], pages, FakeState(tokens[:n]), is_end)
    pool.unref(pages)
    assert state_at(tree, tokens + [9]).num_tokens == 6  # 2, 3 and 6 used now
    page = pool.alloc(1)
    tree.insert([5, 5], page, FakeState([5, 5]))  # over the budget: the end at 3 goes
    pool.unref(page)
    assert kept_in(tree) == [(1, 1), (1, 1, 2, 2, 3, 3), (5, 5)]
    page = pool.alloc(1)
    tree.insert([7, 7], page, FakeState([7, 7]))  # then the shallower of 2 and 6
    pool.unref(page)
    assert kept_in(tree) == [(1, 1, 2, 2, 3, 3), (5, 5), (7, 7)]
    tree.check_integrity()


def test_a_sub_page_sibling_s_state_is_usable_and_a_resume_drops_the_ends_it_passed():
    """P = 2: a state inside a page serves every branch whose page starts with its tokens (as
    a tail of the match or beside a node on its path); resuming at 6 drops the request ends
    before it (3 and 5)."""
    from freetoken.kv import RadixCache
    pool = PagePool(8, 2)
    tree = RadixCache(pool)
    tokens, pages = [1, 1, 2, 2, 3, 3], pool.alloc(3)
    for n, is_end in ((3, True), (5, True), (6, False)):
        tree.insert(tokens[:n], pages, FakeState(tokens[:n]), is_end)
    other = pool.alloc(1)
    tree.insert([1, 1, 2, 9], pages[:1] + other)
    pool.unref(pages + other)
    m = tree.match_prefix([1, 1, 2, 8, 8])  # [2, 8]: its first token on both pages
    assert m.num_tokens == 3 and state_at(tree, [1, 1, 2, 8, 8]).tokens == (1, 1, 2)
    state, node = tree.deepest_state(tree.match_prefix([1, 1, 2, 9, 7]))  # through [2, 9]
    assert state.tokens == (1, 1, 2) and node.key == (2, 2)
    tree.drop_ends(tree.match_prefix(tokens + [7]), 6)  # a request resuming at 6
    assert kept_in(tree) == [(1, 1, 2, 2, 3, 3)]
    tree.check_integrity()


# ---- the tiny hybrid models ----------------------------------------------------------------------

CLOSE = 2  # <|im_end|>: the tiny models' EOS, written by their template after every turn
# 58 tokens: closers at 21 (anchor 22, mid-page) and 43 (anchor 44, on a page boundary)
BASE = [3 + (i * 37) % 380 for i in range(58)]
BASE[21] = BASE[43] = CLOSE
EDITS = {  # edited index (None: the same prompt again) -> the cached prefix it resumes from
    "none (the same prompt)": (None, 57),
    "after the second anchor": (50, 44),
    "at the second anchor": (44, 44),
    "of the second closer": (43, 22),
    "between the anchors": (30, 22),
    "at the first anchor": (22, 22),
    "before the first anchor": (12, 0),
}


@pytest.fixture(scope="module", params=mtm.HYBRID)
def hybrid(request, tmp_path_factory):
    return Family(tmp_path_factory.mktemp(request.param), request.param)


def edited(i):
    ids = list(BASE)
    if i is not None:
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
    return [(torch.stack(rows[id(r)]).cpu(), r.stats, r.tokens[len(ids):len(ids) + 3].tolist())
            for r, ids in zip(reqs, prompts)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_edits_resume_from_the_nearest_state(hybrid, monkeypatch, device):
    """BASE once (its states kept at 22, 44, 57 and 58, taken inside its prefill forwards), then
    it again and six edits of it together: each takes the prefix up to the nearest kept state
    before its edit (a partial page's rows copied), and its first token's and 2 decode steps'
    logits (on cuda from the captured decode graphs) equal a cold prefill's and transformers'."""
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [edited(i) for i, _ in EDITS.values()]
    with hybrid.engine(device=device, expert_cache_frac=0.5, parallel=len(prompts),
                       prefill_chunk=8) as engine:
        assert engine.anchors.closer_ids == {CLOSE}
        list(engine.generate(BASE, SamplingParams(temperature=0, max_tokens=1)))
        assert engine.kv_manager.radix.num_states == 4
        warm = run_together(engine, prompts, params)
        cold = [engine.score(ids + out[:2]).cpu() for ids, (_, _, out) in zip(prompts, warm)]
    for (what, (_, hit)), ids, (rows, stats, out), ref in zip(EDITS.items(), prompts, warm, cold):
        assert stats.cached_tokens == hit, f"{hybrid.family} edit {what}"
        n = len(ids)
        assert_close(rows, ref[n - 1:], f"{hybrid.family} edit {what} vs cold")
        with torch.no_grad():
            hf = hybrid.hf(torch.tensor([ids + out[:2]])).logits[0, n - 1:]
        assert_close(rows, hf, f"{hybrid.family} edit {what} vs transformers")


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return Family(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")


def test_a_plain_family_resumes_at_the_edit(plain, monkeypatch):
    """No recurrent state: BASE once, then it again and the six edits of it together: each
    takes every token before its edit from the cache (inside a page: its rows copied), and its
    first token's and 2 decode steps' logits equal a cold prefill's and transformers'."""
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [edited(i) for i, _ in EDITS.values()]
    with plain.engine(expert_cache_frac=0.5, parallel=len(prompts), prefill_chunk=8) as engine:
        assert engine.anchors is None and engine.state is None
        list(engine.generate(BASE, SamplingParams(temperature=0, max_tokens=1)))
        warm = run_together(engine, prompts, params)
        cold = [engine.score(ids + out[:2]) for ids, (_, _, out) in zip(prompts, warm)]
    for (what, (i, _)), ids, (rows, stats, out), ref in zip(EDITS.items(), prompts, warm, cold):
        assert stats.cached_tokens == (len(ids) - 1 if i is None else i), f"edit {what}"
        n = len(ids)
        assert_close(rows, ref[n - 1:], f"qwen3_moe edit {what} vs cold")
        with torch.no_grad():
            hf = plain.hf(torch.tensor([ids + out[:2]])).logits[0, n - 1:]
        assert_close(rows, hf, f"qwen3_moe edit {what} vs transformers")


def test_the_next_turn_resumes_after_the_answer(hybrid, monkeypatch):
    """A conversation's next turn (prompt + answer + closer + new tokens) resumes from the state
    kept when the answer ended (exactly there: a partial page), and equals transformers."""
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with hybrid.engine(expert_cache_frac=0.5, prefill_chunk=8) as engine:
        first = BASE[:22]
        answer = list(engine.generate(first, params))
        forwarded = len(first) + len(answer) - 1  # the last token was sampled, not forwarded
        turn = first + answer + [CLOSE, 40, 41, 42]
        logits = engine.score(turn, prefix_cache=True)
        hit = engine.last_stats.cached_tokens
        engine.kv_manager.check_idle()
    assert hit == forwarded and hit % 4
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
    """A budget of 2 states: after 3 prompts of 3 kept states each, 2 are left (the newest),
    and the KV lines say so."""
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    with hybrid.engine(state_budget=1) as engine:
        size = engine.state.nbytes
    with hybrid.engine(state_budget=2 * size) as engine:
        for k in range(3):
            engine.score([10 + k] * 9 + [CLOSE] + [20 + k] * 4)  # states at 10, 13 and 14
        radix = engine.kv_manager.radix
        assert (radix.num_states, radix.num_state_bytes) == (2, 2 * size)
        assert state_at(radix, [12] * 9 + [CLOSE] + [22] * 3).num_tokens == 13
        line = engine.last_stats.kv.lines()[-1]
    assert line.startswith("KV states      = 2 kept at anchors") and "MB" in line


def test_bench_agent_edits_reprefills_about_the_edited_suffix(hybrid, monkeypatch, capsys):
    """tools/bench_agent.py --edits on a tiny hybrid (pages of 4): with anchors every request
    prefills at most its edited suffix + 1 (an append: the reply's last token, sampled, not
    forwarded; + the kept head of a truncated tool output, which follows the anchor before it),
    a regenerate just its last token, and never more than with states at prefill ends only,
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
        assert c[k][0] <= suffix + kept + 1, (k, kind, suffix)
        assert kind != "regenerate" or c[k][0] == b[k][0] == 1, (k, kind)
    assert sum(r[0] for r in c) < sum(r[0] for r in b)  # anchors help past prefill ends
    # one forward per prefill (prompts under the cpu's 512-token chunk): states taken inside it
    assert all(r[2] == 1 for mode in (a, b, c) for r in mode)
    assert "prefilled <=" in capsys.readouterr().out


def test_a_closer_in_the_answer_keeps_the_state_after_it(hybrid, monkeypatch):
    """Decoding: a generated closer (forced here) keeps the state right after it (25), the
    answer's end the state where it ended (30), beside the prompt's (21 and 22)."""
    from bench_agent import Forced
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    answer = [5, 6, CLOSE, 7, 8, 9, 10, 11, 12]  # at positions 22..30: the closer at 24
    params = SamplingParams(temperature=0, max_tokens=len(answer), ignore_eos=True)
    with hybrid.engine(expert_cache_frac=0.5, prefill_chunk=8) as engine:
        assert list(engine.generate(BASE[:22], params, Forced(answer))) == answer
        radix = engine.kv_manager.radix
        tokens = BASE[:22] + answer
        kept = [n for n in range(1, 32)
                if getattr(state_at(radix, tokens[:n]), "num_tokens", 0) == n]
        assert kept == [21, 22, 25, 30]
        again = engine.score(tokens[:26] + [40, 41], prefix_cache=True)
        assert engine.last_stats.cached_tokens == 25
    with torch.no_grad():
        ref = hybrid.hf(torch.tensor([tokens[:26] + [40, 41]])).logits[0, 25:]
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
