"""The free-memory trigger on the cpu device tier (memory_watch.py): a simulated device whose
free memory another program takes and gives back (the watch's probe replaced) makes the engine
shrink the expert cache by what is missing, go on generating, and grow back to its planned size;
the greedy tokens equal a run without the watch and the cache's integrity check holds after
every step. Also: the check's rate bound, the option that turns it off, a refused resize."""
import pytest

from freetoken.api import LLM
from freetoken.config import Tuning
from freetoken.errors import ConfigError
from freetoken.sampling import SamplingParams

PROMPT = "def fibonacci(n):"
NUM_TOKENS = 32
OPTIONS = dict(device="cpu", expert_cache_frac=0.5)


def greedy(llm, after_step=None) -> list:
    """NUM_TOKENS greedy token ids of PROMPT; after_step(i) after the step giving token i."""
    ids = llm.encode(PROMPT)
    out = []
    for token_id in llm.engine.generate(ids, SamplingParams(temperature=0, max_tokens=NUM_TOKENS,
                                                            ignore_eos=True)):
        out.append(token_id)
        if after_step is not None:
            after_step(len(out) - 1)
    return out


@pytest.fixture(scope="module", params=["hybrid", "offload", "cpu"])
def unwatched(request):
    """(policy, its greedy tokens with no memory watch)."""
    with LLM(memory_watch=False, policy=request.param, **OPTIONS) as llm:
        assert llm.engine.watch is None
        return request.param, greedy(llm)


def test_cache_follows_simulated_free_memory(unwatched):
    policy, expected = unwatched
    with LLM(policy=policy, tuning=Tuning(memory_watch_ms=0), **OPTIONS) as llm:
        engine = llm.engine
        watch, plan = engine.watch, engine.memory_plan
        stride, planned = plan.slot_bytes, plan.num_slots
        slack = watch.slack()
        assert planned > 60 and slack >= stride
        # a device where the engine, at its planned cache, leaves margin + slack free: in the
        # dead band, no resize until another program takes `other` bytes of it
        room = plan.margin + slack + planned * stride
        other = {"bytes": 0}
        watch.probe = lambda: room - other["bytes"] - engine.memory_plan.expert_cache
        # the step after token i's sees the program's use set then (slots' worth)
        episode = {4: 40, 10: 70, 16: 10 * planned, 20: 0}
        slots = []

        def after_step(i):
            engine.experts.cache.check_integrity()
            slots.append(engine.experts.cache.capacity)
            if i in episode:
                other["bytes"] = episode[i] * stride

        assert greedy(llm, after_step) == expected
        # each shrink gives back what is missing (the cache then leaves margin + slack free);
        # more than the whole cache taken: no cache, every route on the CPU; then all back
        assert slots[:5] == [planned] * 5
        assert slots[5:11] == [planned - 40] * 6
        assert slots[11:17] == [planned - 70] * 6
        assert slots[17:21] == [0] * 4
        assert slots[21:] == [planned] * (NUM_TOKENS - 21)
        assert engine.resizes == {"api": 0, "admin": 0, "memory": 4, "kv": 0}
        assert engine.memory_plan.num_slots == planned
        assert engine.experts.cache.storage.nbytes == engine.memory_plan.expert_cache
        assert watch.num_checks == NUM_TOKENS


def test_batched_requests_keep_their_tokens_across_watch_resizes():
    prompts = ["def fibonacci(n):", "import numpy as np", "class Stack:"]
    with LLM(memory_watch=False, **OPTIONS) as llm:
        expected = llm.generate(prompts, temperature=0, max_tokens=16)
    with LLM(tuning=Tuning(memory_watch_ms=0), **OPTIONS) as llm:
        engine, watch = llm.engine, llm.engine.watch
        plan = engine.memory_plan
        # checks 4-9 (one per step): another program leaves only half the margin; then all back
        watch.probe = lambda: plan.margin // 2 if 4 <= watch.num_checks < 10 else 10 ** 15
        assert llm.generate(prompts, temperature=0, max_tokens=16) == expected
        # one shrink (to 0 slots: half the margin is more than the whole cache), one grow back
        assert engine.resizes["memory"] == 2
        assert engine.memory_plan.num_slots == plan.num_slots
        engine.experts.cache.check_integrity()


def test_grows_back_within_the_dead_band_only():
    with LLM(tuning=Tuning(memory_watch_ms=0), **OPTIONS) as llm:
        engine, watch = llm.engine, llm.engine.watch
        plan = engine.memory_plan
        stride, planned, slack = plan.slot_bytes, plan.num_slots, watch.slack()
        free = {"bytes": plan.margin - 1}
        watch.probe = lambda: free["bytes"]
        shrunk = watch.check()
        assert shrunk.trigger == "memory" and shrunk.new_slots == planned - -(-(slack + 1) // stride)
        for free["bytes"] in (plan.margin, plan.margin + 2 * slack):  # the dead band: no resize
            assert watch.check() is None
        free["bytes"] = plan.margin + 2 * slack + 3 * stride  # grows by all above margin + slack
        grown = watch.check()
        assert grown.new_slots == min(planned, shrunk.new_slots + (slack + 3 * stride) // stride)
        llm.resize_expert_cache((planned // 2 + 0.5) * stride / 1e9)  # asked: the new target
        assert watch.target_slots == planned // 2 and engine.resizes["api"] == 1
        free["bytes"] = 10 ** 15
        assert watch.check() is None  # at its target: nothing to grow


def test_checks_at_a_bounded_rate():
    with LLM(tuning=Tuning(memory_watch_ms=10 ** 9), **OPTIONS) as llm:
        probes = []
        llm.engine.watch.probe = lambda: probes.append(1) or 10 ** 15
        greedy(llm)
        assert len(probes) == llm.engine.watch.num_checks == 1  # the first step's, then none


def test_a_refused_resize_turns_the_watch_off(monkeypatch):
    with LLM(tuning=Tuning(memory_watch_ms=0), **OPTIONS) as llm:
        engine = llm.engine
        engine.watch.probe = lambda: 0

        def refuse(*args, **kwargs):
            raise ConfigError("resizing the expert cache on this device is not built yet")
        monkeypatch.setattr(engine, "resize_expert_cache", refuse)
        assert len(greedy(llm)) == NUM_TOKENS  # the engine goes on
        assert "not built yet" in engine.watch.off and engine.watch.num_checks == 1


def test_no_watch_without_a_cache():
    with LLM(device="cpu") as llm:  # the plain CPU engine: no slots to give back
        llm.engine.watch.probe = lambda: 0
        greedy(llm)
        assert llm.engine.watch.num_checks == 0


def test_run_prints_one_line_per_resize(monkeypatch):
    from click.testing import CliRunner
    from freetoken import memory_watch
    from freetoken.cli import main
    monkeypatch.setattr(memory_watch, "device_free", lambda device, margin=0: 0)  # another program took all
    args = ["run", "-p", PROMPT, "--temp", "0", "-n", "4", "--device", "cpu",
            "--expert-cache-frac", "0.5"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    lines = [l for l in result.stderr.splitlines() if "expert cache" in l and "->" in l]
    assert len(lines) == 1, result.stderr
    assert " GB -> 0.00 GB (96 -> 0 slots; memory: free 0.00 GB < margin " in lines[0]
    assert lines[0].startswith("freetoken: ") and lines[0].endswith(" ms")
    quiet = CliRunner().invoke(main, args + ["--no-memory-watch"])
    assert quiet.exit_code == 0, quiet.output
    assert quiet.stdout == result.stdout and "slots;" not in quiet.stderr  # same text, no resize


def test_grows_no_further_than_the_budget():
    from freetoken.api import plan_model
    from freetoken.config import EngineConfig
    options = dict(device="cpu", ctx_size=256, parallel=1)
    p = plan_model(None, EngineConfig(gpu_mem_gb=1.0, **options))
    cap = (p.weights + p.kv + p.buffers + p.num_experts * p.slot_bytes / 2) / 0.95 / 1e9
    with LLM(gpu_mem_gb=cap, tuning=Tuning(memory_watch_ms=0), **options) as llm:
        engine, watch = llm.engine, llm.engine.watch
        plan = engine.memory_plan
        room = (plan.budget - plan.context_part) // plan.slot_bytes
        assert 0 < room < plan.num_experts and plan.num_slots == room
        llm.resize_expert_cache((room // 2 + 0.5) * plan.slot_bytes / 1e9)
        watch.target_slots = plan.num_experts  # more than the budget holds
        watch.probe = lambda: 10 ** 15
        assert watch.check().new_slots == room and not watch.off
        assert watch.check() is None


def test_bench_cells_run_without_the_watch():
    from freetoken.bench import make_config
    from freetoken.config import EngineConfig
    config = make_config("16", "8", "0.01,0.02", None, "hybrid,cpu", "1", "1")
    cells = config.cell_configs(EngineConfig(device="cpu"))
    assert len(cells) == 4 and not any(c.memory_watch for c in cells)  # rows keep their size
