"""End to end against transformers, fp32, on tiny random models of every family: HF checkpoint ->
`ftw.convert` -> Engine. Logits position by position (teacher forcing, max abs diff <= 1e-4) for
every expert-cache size x policy x prefill mode, greedy tokens where the top-2 margin is wide,
and the CPU device tier against the plain CPU engine, and prompts served partly from the prefix
cache (pages of 4 tokens here; the hybrid families with their recurrent state kept at anchors)
against cold prefills and transformers. The hybrid families (Gated DeltaNet) also run a prompt
longer than the DeltaNet's chunk, then decode steps after it, per cache x policy
(tests/test_state_anchors.py: edits around anchors). Each comparison with transformers is
recorded (the `oracle` fixture) before its assertion, for `--oracle-table=FILE`
(tests/oracle_table.py)."""
import pytest

import torch

import make_tiny_model as mtm  # noqa: E402
from freetoken import kv_cache  # noqa: E402
from freetoken.config import EngineConfig  # noqa: E402
from freetoken.errors import ConfigError  # noqa: E402
from freetoken.engine import Engine  # noqa: E402
from freetoken.sampling import SamplingParams  # noqa: E402

ATOL = 1e-4
MARGIN = 1e-3  # greedy tokens are compared only while HF's top-2 logit gap exceeds this
PROMPT = [5, 77, 300, 12, 9, 141, 250, 33, 61, 199, 8, 120, 45, 370]  # 14 tokens, fixed
CACHE_FRACS = {"none": 0.0, "few": 0.125, "half": 0.5, "all": 1.0}  # of 24 experts: 0, 3, 12, 24
MODES = {"prefill": 512, "chunked": 5, "decode": 1}  # --prefill-chunk; 1 = token by token


class Family:
    """One tiny model, built once per module: its FTW path and HF reference logits/tokens."""

    def __init__(self, root, family):
        from ftw.convert import convert
        self.family = family
        src = mtm.build(root / "hf", family, dtype="fp32", seed=7)
        self.ftw = str(root / "model.ftw")
        convert(str(src), self.ftw, dtype="auto", progress=False)
        self.hf = mtm.load_hf(src, dtype=torch.float32).eval()
        with torch.no_grad():
            self.logits = self.hf(torch.tensor([PROMPT])).logits[0]  # [N, V]

    def engine(self, device="cpu", **options):
        return Engine(self.ftw, EngineConfig(device=device, dtype="fp32", **options))

    def greedy(self, num_tokens):
        """HF greedy continuation of PROMPT and each step's top-2 margin (full recompute)."""
        ids, margins = list(PROMPT), []
        with torch.no_grad():
            for _ in range(num_tokens):
                top = self.hf(torch.tensor([ids])).logits[0, -1].topk(2)
                margins.append(float(top.values[0] - top.values[1]))
                ids.append(int(top.indices[0]))
        return ids[len(PROMPT):], margins


@pytest.fixture(scope="module", params=mtm.FAMILIES)
def fam(request, tmp_path_factory):
    return Family(tmp_path_factory.mktemp(request.param), request.param)


def skip_unverified_on_cuda(fam):
    """The engine refuses a family whose cuda path is not verified (engine.UNVERIFIED_ON)."""
    from freetoken.engine import UNVERIFIED_ON
    if (fam.family, "cuda") in UNVERIFIED_ON:
        with pytest.raises(ConfigError, match="--device cpu only"):
            fam.engine(device="cuda")
        pytest.skip(f"{fam.family} is refused on cuda: {UNVERIFIED_ON[fam.family, 'cuda']}")


def assert_close(ours, ref, what, oracle=None):
    """oracle: the test's record (a comparison with transformers), which gets the max diff."""
    diff = (ours - ref).abs()
    worst = int(diff.max(dim=-1).values.argmax())
    if oracle is not None:
        oracle.diff(diff.max())
    assert float(diff.max()) <= ATOL, (f"{what}: max |diff| {float(diff.max()):.3g} at position "
                                       f"{worst} (of {ref.shape[0]})")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", ["hybrid", "offload", "cpu"])
@pytest.mark.parametrize("cache", CACHE_FRACS)
def test_logits_match_transformers(fam, cache, policy, mode, oracle):
    with fam.engine(expert_cache_frac=CACHE_FRACS[cache], policy=policy,
                    prefill_chunk=MODES[mode]) as engine:
        logits = engine.score(PROMPT)
        stats = engine.experts.stats
    assert logits.shape == fam.logits.shape and logits.dtype == torch.float32
    assert_close(logits, fam.logits, f"{fam.family} cache={cache} policy={policy} mode={mode}",
                 oracle)
    if cache != "none" and mode == "decode" and policy != "cpu":
        assert stats["fills"] > 0  # the device tier was really used


def test_device_tier_equals_plain_cpu(fam):
    with fam.engine(policy="cpu", expert_cache_frac=0.0) as engine:
        plain = engine.score(PROMPT)
    with fam.engine(policy="hybrid", expert_cache_frac=0.5, prefill_chunk=1) as engine:
        tiered = engine.score(PROMPT)
    assert_close(tiered, plain, f"{fam.family} device tier vs plain cpu")


@pytest.mark.parametrize("cache, policy", [("none", "cpu"), ("few", "hybrid"), ("all", "offload")])
def test_greedy_tokens_match_transformers(fam, cache, policy, oracle):
    ref, margins = fam.greedy(8)
    wide = next((i for i, m in enumerate(margins) if m < MARGIN), len(margins))
    assert wide >= 2, f"{fam.family}: top-2 margins too narrow to compare ({margins})"
    with fam.engine(expert_cache_frac=CACHE_FRACS[cache], policy=policy,
                    prefill_chunk=4) as engine:
        eos = set(engine.model_config.eos_token_ids)
        if any(t in eos for t in ref[:wide]):
            wide = [t in eos for t in ref].index(True)  # our generate does not yield EOS
        ours = list(engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=wide)))
    oracle.tokens(ours, ref[:wide])
    assert ours == ref[:wide]


LONG_PROMPT = [3 + (i * 37) % 380 for i in range(150)]  # 150 tokens: 3 DeltaNet chunks of 64
NUM_DECODE = 10


@pytest.fixture(scope="module", params=mtm.HYBRID)
def hybrid(request, tmp_path_factory):
    fam = Family(tmp_path_factory.mktemp(request.param), request.param)
    with torch.no_grad():
        fam.long_logits = fam.hf(torch.tensor([LONG_PROMPT])).logits[0]  # [150, V]
    return fam


def score_then_decode(engine, ids, num_decode):
    """Logits [N, V]: prefill of ids[:-num_decode] in --prefill-chunk forwards, then each of
    the last num_decode tokens as a decode step (the engine's own, decode) after it, in one
    sequence; and the tokens its KV and its recurrent state (if any) then held."""
    n = len(ids) - num_decode
    tokens = torch.tensor(ids, dtype=torch.int64, device=engine.device)
    with torch.no_grad(), engine.sequence(ids) as (_, kv):
        prefill = list(engine._prefill_chunks(kv, tokens[:n]))
        decoded = [engine.decode(kv, tokens[i:i + 1], engine.state).clone()  # (a static
                   for i in range(n, len(ids))]  # output when replayed from graphs)
        held = (kv.num_tokens, engine.state.num_tokens if engine.state is not None else None)
    return torch.cat([*prefill, *decoded]).cpu(), held


@pytest.mark.parametrize("policy", ["hybrid", "offload", "cpu"])
@pytest.mark.parametrize("cache", CACHE_FRACS)
def test_hybrid_long_prefill_then_decode(hybrid, cache, policy, oracle):
    """Prefill forwards of 100 tokens (the first spans a DeltaNet chunk boundary, the second
    starts from the carried state), then decode steps: every position equals transformers."""
    with hybrid.engine(expert_cache_frac=CACHE_FRACS[cache], policy=policy,
                       prefill_chunk=100) as engine:
        logits, held = score_then_decode(engine, LONG_PROMPT, NUM_DECODE)
        assert held == (len(LONG_PROMPT), len(LONG_PROMPT))
    assert_close(logits, hybrid.long_logits,
                 f"{hybrid.family} long prompt cache={cache} policy={policy}", oracle)


def test_hybrid_state_resets_with_the_sequence(hybrid, oracle):
    """A second generation on the same engine starts from an empty state, as the first did."""
    oracle.at(cache="half")
    with hybrid.engine(expert_cache_frac=0.5, prefill_chunk=64) as engine:
        first = engine.score(LONG_PROMPT[:80])
        list(engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3)))
        again = engine.score(LONG_PROMPT[:80])
    assert_close(first, hybrid.long_logits[:80], f"{hybrid.family} rescored", oracle)
    assert torch.equal(first, again)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["hybrid", "offload", "cpu"])
@pytest.mark.parametrize("cache", ["none", "few", "all"])
def test_cuda_hybrid_long_prefill_then_decode(hybrid, cache, policy, oracle):
    """On cuda the decode steps replay CUDA graphs (the recurrent state copied into the
    captured row and back) and must equal transformers too; eager steps as well."""
    for graphs in (True, False):
        with hybrid.engine(device="cuda", expert_cache_frac=CACHE_FRACS[cache], policy=policy,
                           prefill_chunk=100, cuda_graphs=graphs) as engine:
            assert (engine.graphs is not None) == graphs, engine.graphs_off
            logits, _ = score_then_decode(engine, LONG_PROMPT, NUM_DECODE)
        assert_close(logits, hybrid.long_logits,
                     f"cuda {hybrid.family} long prompt cache={cache} policy={policy} "
                     f"graphs={graphs}", oracle)


@pytest.mark.gpu
def test_cuda_hybrid_sequences_alternating_on_one_captured_row(hybrid, monkeypatch, oracle):
    """Three sequences decoded one token each in turn: the captured row's state is each one's
    in turn (copied in whenever the row held another's), and every row equals transformers."""
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    oracle.at(cache="half")
    prompts = [LONG_PROMPT[:40], LONG_PROMPT[50:120], LONG_PROMPT[7:30]]
    with hybrid.engine(device="cuda", expert_cache_frac=0.5, policy="hybrid") as engine:
        assert engine.graphs is not None
        rows = batched_logits(engine, prompts, FORCED, alternate=True)
        batched = batched_logits(engine, prompts, FORCED)
    with torch.no_grad():
        for b, ids in enumerate(prompts):
            ref = hybrid.hf(torch.tensor([ids])).logits[0, -FORCED:]
            assert_close(rows[b], ref, f"cuda {hybrid.family} alternating row {b}", oracle)
            assert_close(batched[b], ref, f"cuda {hybrid.family} batched row {b}", oracle)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["prefill", "chunked", "decode"])  # prefill: streamed layers
@pytest.mark.parametrize("policy", ["hybrid", "offload", "cpu"])
@pytest.mark.parametrize("cache", ["none", "few", "all"])
def test_cuda_logits_match_transformers(fam, cache, policy, mode, oracle):
    skip_unverified_on_cuda(fam)
    with fam.engine(device="cuda", expert_cache_frac=CACHE_FRACS[cache], policy=policy,
                    prefill_chunk=MODES[mode]) as engine:
        logits = engine.score(PROMPT).cpu()
    assert_close(logits, fam.logits, f"cuda {fam.family} cache={cache} policy={policy} mode={mode}",
                 oracle)


# ---- the prefix cache ---------------------------------------------------------------------------

@pytest.mark.parametrize("cache, policy", [("none", "cpu"), ("few", "hybrid"), ("all", "offload")])
def test_cached_prefix_equals_cold_prefill(fam, cache, policy, monkeypatch, oracle):
    """PROMPT after a prompt sharing its first 11 tokens: they come from the cache (2 pages and
    3 rows of the third, copied), and the logits of the other 3 positions equal a cold
    prefill's and transformers'. The hybrid families (a recurrent state no KV page restores)
    take the first 2 pages with the state kept after them (--state-interval 4: a state at every
    page inside a long span, anchors.py)."""
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    hit = 8 if fam.family in mtm.HYBRID else 11  # page 3 differs at its last token
    with fam.engine(expert_cache_frac=CACHE_FRACS[cache], policy=policy,
                    prefill_chunk=5, state_interval=4) as engine:
        engine.score(PROMPT[:11] + [1, 2])  # caches 3 pages: PROMPT[:11] + [1]
        cached = engine.score(PROMPT, prefix_cache=True)
        assert engine.last_stats.cached_tokens == hit
        cold = engine.score(PROMPT)
        assert engine.last_stats.cached_tokens == 0
    assert cached.shape == (len(PROMPT) - hit, fam.logits.shape[1])
    assert_close(cached, fam.logits[hit:], f"{fam.family} cached vs transformers", oracle)
    assert_close(cached, cold[hit:], f"{fam.family} cached vs cold")


def test_greedy_tokens_from_the_cache_match_transformers(fam, monkeypatch, oracle):
    """The same prompt twice: the second takes all its tokens but the last from the cache (3
    pages and 1 row of the fourth, copied; the last token is always prefilled; the hybrid
    families with the state kept before the first prefill's last token) and decodes the same
    greedy tokens as transformers."""
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    oracle.at(cache="few")
    ref, margins = fam.greedy(6)
    wide = next((i for i, m in enumerate(margins) if m < MARGIN), len(margins))
    with fam.engine(expert_cache_frac=0.125, prefill_chunk=4) as engine:
        eos = set(engine.model_config.eos_token_ids)
        if any(t in eos for t in ref[:wide]):
            wide = [t in eos for t in ref].index(True)
        params = SamplingParams(temperature=0, max_tokens=wide)
        first = list(engine.generate(PROMPT, params))
        oracle.tokens(first, ref[:wide])
        assert engine.last_stats.cached_tokens == 0
        again = list(engine.generate(PROMPT, params))
        oracle.tokens(again, ref[:wide])
        hit = len(PROMPT) - 1
        assert engine.last_stats.cached_tokens == hit
        assert engine.last_stats.kv.hit_rate == hit / (2 * len(PROMPT))
    assert first == again == ref[:wide]


def test_a_small_pool_evicts_and_stays_exact(fam, monkeypatch, oracle):
    """A pool of 6 pages: each prompt evicts the last one's cached pages (LRU), and page tables
    that are no longer in order still give transformers' logits (the hybrid families' kept
    states go with their pages)."""
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    oracle.at(policy="cpu")
    with fam.engine(kv_tokens=24, prefill_chunk=5, policy="cpu") as engine:
        engine.score([3, 1, 4, 1, 5, 9, 2, 6, 5])  # 2 pages cached, 1 freed
        engine.score(list(range(60, 80)))  # 5 pages: evicts the first prompt's (the hybrid
        # families' state kept after token 2 splits them in 2 nodes: only the last goes)
        left = 4 if fam.family in mtm.HYBRID else 0
        assert engine.kv_manager.radix.match_prefix([3, 1, 4, 1, 5]).num_tokens == left
        logits = engine.score(PROMPT)
        table = engine.kv_manager.radix.match_prefix(PROMPT).pages
        assert table != list(range(table[0], table[0] + len(table))), "the pages are in order"
        engine.kv_manager.check_integrity()
    assert_close(logits, fam.logits, f"{fam.family} small pool", oracle)


def test_a_request_that_can_never_fit_is_refused(fam, monkeypatch):
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    with fam.engine(kv_tokens=16) as engine:
        with pytest.raises(ConfigError, match="--kv-tokens 22"):
            engine.generate(PROMPT, SamplingParams(max_tokens=8))
        assert list(engine.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0)))


# ---- several sequences at once (scheduler.py, MoETransformer.forward_batch) ---------------------

BATCH = [PROMPT, PROMPT[:9], PROMPT[3:] + PROMPT[:5]]  # 14, 9 and 16 tokens
FORCED = 5  # teacher-forced decode steps after each prompt's first 10 - b tokens


def admit_cold(engine, prompts):
    """A sequence per prompt admitted without the prefix cache: [(Sequence, its KV, its state)]."""
    from freetoken.sequence import Sequence
    seqs = []
    for ids in prompts:
        seq = Sequence.from_prompt(ids)
        engine.kv_manager.admit(seq, use_cache=False)
        seqs.append((seq, engine.sequence_kv(seq), engine.new_state()))
    return seqs


def batched_logits(engine, prompts, num_decode, alternate=False):
    """Each prompt's first len - num_decode tokens prefilled alone (pages of 4 tokens here, so
    their tables interleave), then num_decode decode steps of all of them in one forward each
    (alternate: one sequence after the other, one token each): logits [num_decode, V] per
    prompt."""
    out = [[] for _ in prompts]
    with torch.no_grad():
        seqs = admit_cold(engine, prompts)
        for (seq, kv, state), ids in zip(seqs, prompts):
            n = len(ids) - num_decode
            engine.forward(kv, torch.tensor(ids[:n], device=engine.device), state=state)
        for i in range(num_decode):
            tokens = torch.tensor([ids[len(ids) - num_decode + i] for ids in prompts],
                                  device=engine.device)
            if alternate:
                logits = torch.cat([engine.decode(kv, tokens[b:b + 1], state).clone()
                                    for b, (_, kv, state) in enumerate(seqs)])
            else:
                logits = engine.decode_batch(tokens, [s[1] for s in seqs], [s[2] for s in seqs])
            for b, row in enumerate(logits.cpu()):
                out[b].append(row)
        for seq, _, _ in seqs:
            engine.kv_manager.release(seq)
        engine.kv_manager.check_idle()
    return [torch.stack(rows) for rows in out]


def hf_greedy(hf, prompt, num_tokens):
    ids, margins = list(prompt), []
    with torch.no_grad():
        for _ in range(num_tokens):
            top = hf(torch.tensor([ids])).logits[0, -1].topk(2)
            margins.append(float(top.values[0] - top.values[1]))
            ids.append(int(top.indices[0]))
    return ids[len(prompt):], margins


@pytest.mark.parametrize("policy", ["hybrid", "offload", "cpu"])
@pytest.mark.parametrize("cache", CACHE_FRACS)
def test_batched_decode_logits_match_transformers(fam, cache, policy, monkeypatch, oracle):
    """Three sequences decoded together, teacher-forced: every row equals transformers at its
    own position."""
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    with fam.engine(expert_cache_frac=CACHE_FRACS[cache], policy=policy) as engine:
        rows = batched_logits(engine, BATCH, FORCED)
    with torch.no_grad():
        for b, ids in enumerate(BATCH):
            ref = fam.hf(torch.tensor([ids])).logits[0, -FORCED:]  # after each forced token
            assert_close(rows[b], ref, f"{fam.family} row {b} cache={cache} policy={policy}",
                         oracle)


@pytest.mark.parametrize("cache, policy, beside", [("none", "cpu", False), ("few", "hybrid", False),
                                                  ("half", "offload", False), ("few", "hybrid", True)])
def test_batched_greedy_equals_alone_and_transformers(fam, cache, policy, beside, oracle):
    """The three prompts submitted together (--parallel 3: they decode in one forward per step;
    beside: also between the layers of the others' prefill chunks) give each the greedy tokens
    it gets alone, and transformers' while its margins are wide."""
    from freetoken.config import Tuning
    params = SamplingParams(temperature=0, max_tokens=6)
    with fam.engine(expert_cache_frac=CACHE_FRACS[cache], policy=policy, parallel=3,
                    prefill_chunk=4, tuning=Tuning(decode_beside_every=int(beside))) as engine:
        alone = [list(engine.generate(ids, params)) for ids in BATCH]
        reqs = [engine.submit(ids, params, prefix_cache=False) for ids in BATCH]  # cold
        steps = 0
        while not all(r.finished for r in reqs):
            engine.step()
            steps += 1
            if steps == 6 and not beside:  # all three prefilled (a chunk a step), decoding
                assert len(engine.scheduler.running) == 3
        together = [r.take() for r in reqs]
        eos = set(engine.model_config.eos_token_ids)
        engine.kv_manager.check_idle()
    refs = []
    for b, ids in enumerate(BATCH):
        ref, margins = hf_greedy(fam.hf, ids, 6)
        wide = next((i for i, m in enumerate(margins) if m < MARGIN), len(margins))
        if any(t in eos for t in ref[:wide]):
            wide = [t in eos for t in ref].index(True)
        refs.append((wide, ref))
        oracle.tokens(together[b][:wide], ref[:wide])
    assert together == alone
    for b, (wide, ref) in enumerate(refs):
        assert together[b][:wide] == ref[:wide], f"{fam.family} prompt {b}"


def packed_prefill_logits(engine, prompts, cuts):
    """Each prompt prefilled in packed forwards (all the sequences' chunks in one forward each):
    chunk j of prompt b is prompts[b][cuts[j][b]:cuts[j + 1][b]]; an empty chunk leaves the
    sequence out of that forward. -> per prompt, the logits of each of its chunks' last token
    [chunks, V], and the number of forwards."""
    out = [[] for _ in prompts]
    with torch.no_grad():
        seqs = admit_cold(engine, prompts)
        for lo, hi in zip(cuts, cuts[1:]):
            rows = [b for b in range(len(prompts)) if hi[b] > lo[b]]
            chunks = [torch.tensor(prompts[b][lo[b]:hi[b]], device=engine.device) for b in rows]
            logits = engine.forward_packed([seqs[b][1] for b in rows], chunks,
                                           [seqs[b][2] for b in rows])
            for i, b in enumerate(rows):
                out[b].append(logits[i].cpu())
        for seq, _, _ in seqs:
            engine.kv_manager.release(seq)
        engine.kv_manager.check_idle()
    return [torch.stack(rows) for rows in out]


@pytest.mark.parametrize("cache, policy, device", [
    ("few", "hybrid", "cpu"),
    pytest.param("few", "hybrid", "cuda", marks=pytest.mark.gpu),
    pytest.param("none", "offload", "cuda", marks=pytest.mark.gpu)])
def test_packed_prefill_matches_transformers(fam, cache, policy, device, monkeypatch, oracle):
    """Three prompts prefilled together, chunks of different lengths in one forward (one of them
    left out of the second): each chunk's last row equals transformers at that position."""
    if device == "cuda":
        skip_unverified_on_cuda(fam)
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    cuts = [(0, 0, 0), (5, 0, 7), (11, 6, 7), (14, 9, 16)]
    with fam.engine(device=device, expert_cache_frac=CACHE_FRACS[cache], policy=policy) as engine:
        rows = packed_prefill_logits(engine, BATCH, cuts)
    with torch.no_grad():
        for b, ids in enumerate(BATCH):
            ends = sorted({c[b] for c in cuts[1:] if c[b] > 0})
            ref = fam.hf(torch.tensor([ids])).logits[0, [e - 1 for e in ends]]
            assert_close(rows[b], ref, f"{fam.family} prompt {b} cache={cache} policy={policy}",
                         oracle)


def test_packed_prefill_of_hybrids_keeps_each_state(hybrid, monkeypatch, oracle):
    """Gated DeltaNet families: chunks longer than the DeltaNet's chunk, packed; each sequence's
    recurrent state advances on its own tokens only."""
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    oracle.at(cache="half", policy="hybrid")
    prompts = [LONG_PROMPT[:140], LONG_PROMPT[10:80], LONG_PROMPT[5:150]]
    cuts = [(0, 0, 0), (70, 0, 100), (140, 70, 145)]
    with hybrid.engine(expert_cache_frac=0.5, policy="hybrid") as engine:
        rows = packed_prefill_logits(engine, prompts, cuts)
    with torch.no_grad():
        for b, ids in enumerate(prompts):
            ends = sorted({c[b] for c in cuts[1:] if c[b] > 0})
            ref = hybrid.hf(torch.tensor([ids])).logits[0, [e - 1 for e in ends]]
            assert_close(rows[b], ref, f"{hybrid.family} prompt {b}", oracle)


def test_batched_hybrid_decode_matches_transformers(hybrid, monkeypatch, oracle):
    """The Gated DeltaNet families: each sequence's recurrent state is its own in a batch."""
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    oracle.at(cache="half")
    prompts = [LONG_PROMPT[:40], LONG_PROMPT[50:120], LONG_PROMPT[7:30]]
    with hybrid.engine(expert_cache_frac=0.5, policy="hybrid") as engine:
        rows = batched_logits(engine, prompts, FORCED)
    with torch.no_grad():
        for b, ids in enumerate(prompts):
            ref = hybrid.hf(torch.tensor([ids])).logits[0, -FORCED:]
            assert_close(rows[b], ref, f"{hybrid.family} row {b}", oracle)


@pytest.mark.gpu
@pytest.mark.parametrize("cache, policy", [("few", "hybrid"), ("half", "offload"), ("all", "hybrid")])
def test_cuda_decode_steps_match_transformers(fam, cache, policy, oracle):
    """On cuda, decode steps (replayed from CUDA graphs where the family's are captured, else
    eager, as the engine runs them), one sequence and then three together: every position
    equals transformers."""
    skip_unverified_on_cuda(fam)
    with fam.engine(device="cuda", expert_cache_frac=CACHE_FRACS[cache], policy=policy,
                    parallel=3, prefill_chunk=4) as engine:
        logits, _ = score_then_decode(engine, PROMPT, NUM_DECODE)
        rows = batched_logits(engine, BATCH, FORCED)
    assert_close(logits, fam.logits, f"cuda {fam.family} decode cache={cache} policy={policy}",
                 oracle)
    with torch.no_grad():
        for b, ids in enumerate(BATCH):
            ref = fam.hf(torch.tensor([ids])).logits[0, -FORCED:]
            assert_close(rows[b], ref, f"cuda {fam.family} batched row {b} cache={cache}", oracle)
