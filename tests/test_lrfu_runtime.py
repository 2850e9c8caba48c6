"""--cache-policy lrfu in the runtime (experts/policy.py LRFUPolicy through plan.make_plan): the
admission rule on a hand-worked cache, the replay twin (EngineLRFU) taking the runtime's
decisions step for step, the option's validation, and the engine's logits and greedy tokens
against transformers on two tiny families (the policy moves experts, never results). The
device plan kernel against the host plan: tests/test_device_step.py."""
import numpy as np
import pytest
import torch

import make_tiny_model as mtm
from freetoken.config import EngineConfig, Tuning
from freetoken.engine import Engine
from freetoken.errors import ConfigError
from freetoken.experts.cache import ExpertCache
from freetoken.experts.plan import apply_plan, make_decode_plan
from freetoken.experts.policy import LRFU_ONE, EngineLRFU, LRFUPolicy, serve
from freetoken.sampling import SamplingParams


class _Info:
    def __init__(self, E):
        self.num_experts, self.slot_stride = E, 64


def _cache(capacity, L=2, E=8):
    return ExpertCache({layer: _Info(E) for layer in range(L)}, capacity, "cpu", with_storage=False)


def _step(cache, layer, experts, policy="offload", lru=False, half_life=None):
    eviction = None if lru else LRFUPolicy(*([half_life] if half_life else []))
    plan = make_decode_plan(cache, layer, np.array([experts], dtype=np.int64), policy, 25.0,
                            50.0, eviction)
    apply_plan(cache, plan)
    cache.check_integrity()
    return plan


def test_a_miss_below_the_victims_count_is_not_filled():
    """2 slots, half-life 8 x 2 = 16 accesses (no decay in these 14): 0 and 1 used three times
    hold count 3; a miss of 2 (count 1) does not displace 1 and runs on the CPU (no fill, no
    eviction), where LRU fills it; 2's later misses raise its count until, at 4 > 3, it takes
    1's slot."""
    cache = _cache(2)
    for _ in range(3):
        _step(cache, 0, [0, 1], half_life=8.0)  # the empty slots, then hits
    assert cache.freq[0, 0] == cache.freq[0, 1] == 3 * LRFU_ONE
    plan = _step(cache, 0, [0, 2], half_life=8.0)
    assert plan.m == 1 and plan.q == 0 and plan.fills == [] and plan.cpu_experts == [2]
    assert cache.lookup(0, [1, 2]) == [1, -1] and cache.stats["evictions"] == 0
    lru = _cache(2)
    for experts in ([0, 1], [0, 1], [0, 1], [0, 2]):
        plan = _step(lru, 0, experts, lru=True)
    assert [f[0] for f in plan.fills] == [2] and lru.lookup(0, [2]) == [1]
    counts = []
    for _ in range(3):
        plan = _step(cache, 0, [0, 2], half_life=8.0)
        counts.append(plan.freq[1] // LRFU_ONE)
    assert counts == [2, 3, 4] and plan.fills == [(2, 1, 0, 1)]  # refused at 2 and 3 (ties stay)


def test_fills_only_among_the_worth_and_by_the_split():
    """hybrid: q* of the m misses, clamped to those worth a slot (H = 2 accesses here)."""
    cache = _cache(4, E=16)
    _step(cache, 1, [0, 1, 2, 3], half_life=0.5)               # fills the 4 slots at epoch 0
    plan = _step(cache, 1, [4, 5, 6, 7], policy="hybrid", half_life=0.5)  # epoch 2: all worth
    assert plan.m == 4 and plan.q == 1 and len(plan.cpu_experts) == 3  # q* = round(4/3) = 1


@pytest.mark.parametrize("capacity,seed,half_life", [(3, 0, 1.0), (6, 1, 16.0), (11, 2, 64.0)])
def test_replay_twin_takes_the_runtime_decisions(capacity, seed, half_life):
    """EngineLRFU (what tools/replay_cache.py replays as engine_lrfu) fed the layer steps the
    runtime plans with offload (every miss worth a slot filled): the same misses, step by step,
    and the same residents (long half-lives: whole counts, many ties, broken by recency)."""
    L, E, K = 3, 8, 3
    cache, twin = _cache(capacity, L, E), EngineLRFU(capacity, half_life)
    rng = np.random.default_rng(seed)
    for step in range(300):
        layer = int(rng.integers(L))
        experts = rng.choice(E if step % 4 else 4, K, replace=False).tolist()
        plan = _step(cache, layer, experts, half_life=half_life)
        pairs = sorted(layer * E + e for e in experts)
        assert serve(twin, pairs) == plan.m, f"step {step}: misses"
        resident = sorted(int(l) * E + int(e) for l, e in cache.own if l >= 0)
        assert sorted(twin.resident()) == resident, f"step {step}: residents"


def test_cache_policy_is_validated():
    assert EngineConfig(cache_policy="lrfu").cache_policy == "lrfu"
    assert EngineConfig().cache_policy == "lru"
    with pytest.raises(ConfigError, match="--cache-policy must be one of lru, lrfu, not 'lfu'"):
        EngineConfig(cache_policy="lfu")


PROMPT = [5, 77, 300, 12, 9, 141, 250, 33, 61, 199, 8, 120, 45, 370]


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def tiny(request, tmp_path_factory):
    src, path = mtm.build_ftw(tmp_path_factory.mktemp(request.param), request.param, seed=7)
    hf = mtm.load_hf(src, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0]  # [N, V]
    return path, hf, logits


def test_lrfu_engine_logits_and_tokens_match_transformers(tiny):
    """Token by token through the cpu device tier (a quarter of the experts, offload: every
    worth miss filled), LRFU refusing some misses (they run on the CPU, where LRU offload runs
    none), then greedy tokens."""
    path, hf, ref = tiny
    config = EngineConfig(device="cpu", dtype="fp32", expert_cache_frac=0.25, policy="offload",
                          cache_policy="lrfu", prefill_chunk=1,
                          tuning=Tuning(lrfu_half_life=16.0))  # (long: some misses refused)
    with Engine(path, config) as engine:
        logits = engine.score(PROMPT)
        stats = dict(engine.experts.stats)
        ours = list(engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4)))
    assert float((logits - ref).abs().max()) <= 1e-4
    assert stats["fills"] > 0 and stats["cpu_experts"] > 0  # filled some, refused some
    ids, want = list(PROMPT), []
    with torch.no_grad():
        for _ in range(4):
            top = hf(torch.tensor([ids])).logits[0, -1].topk(2)
            if float(top.values[0] - top.values[1]) < 1e-3:
                break  # too close to call: compare what came before
            want.append(int(top.indices[0]))
            ids.append(want[-1])
    assert len(want) >= 2 and ours[:len(want)] == want


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["hybrid", "offload"])
def test_cuda_lrfu_decode_matches_transformers(tiny, policy):
    """On cuda, GPU-resident control (captured decode steps, the plan kernel's LRFU branch):
    decode logits equal transformers' and the device books' counts came back."""
    from test_engine_oracle import score_then_decode
    if not torch.cuda.is_available():
        pytest.skip("needs cuda")
    path, hf, ref = tiny
    config = EngineConfig(device="cuda", dtype="fp32", expert_cache_frac=0.25, policy=policy,
                          cache_policy="lrfu", prefill_chunk=4)
    with Engine(path, config) as engine:
        ours, _ = score_then_decode(engine, PROMPT, 10)
        rt = engine.experts
        rt.sync_books()
        assert rt.cache.accesses > 0 and rt.cache.freq.any() and rt.eviction is not None
    assert float((ours - ref).abs().max()) <= 1e-4
