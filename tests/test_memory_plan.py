"""The memory plan (freetoken/memory_plan.py) on the cpu device: its parts add up and equal what
the engine allocates (bundled model, a hybrid's recurrent state, an MLA model's latent KV), the
cache takes what the context leaves under --gpu-mem-gb, and the refusals (context, an
override past the cap, host RAM by MemAvailable or the container's limit) name what to lower;
`run` prints the plan; the cuda plan's arithmetic with the GPU's free memory and the
locked-memory limit patched."""
import dataclasses
import math

import pytest
import torch
from click.testing import CliRunner

import make_tiny_model as mtm  # noqa: E402
from freetoken import host_memory, memory_plan
from freetoken.anchors import SNAPSHOTS_PER_FORWARD
from freetoken.api import LLM, default_model_path, plan_model
from freetoken.cli import main
from freetoken.config import EngineConfig
from freetoken.engine import Engine
from freetoken.errors import ConfigError, ModelError
from freetoken.memory_plan import GB

BUNDLED = default_model_path()


def cpu(**options) -> EngineConfig:
    return EngineConfig(device="cpu", **options)


def assert_plan_matches(engine: Engine) -> None:
    plan = engine.memory_plan
    assert plan.kv == engine.kv_pages.data.nbytes
    assert plan.kv_tokens == engine.kv_pages.num_pages * engine.kv_pages.page_size
    cache = engine.experts.cache
    assert plan.num_slots == cache.capacity
    assert plan.expert_cache == cache.storage.nbytes == cache.capacity * cache.slot_stride
    assert plan.weights == sum(p.nbytes for p in engine.model.parameters())
    assert plan.host_banks == sum(b.data.nbytes for b in engine.experts.banks.values())
    assert plan.total == (plan.weights + plan.kv + plan.state + plan.buffers + plan.margin
                          + plan.expert_cache)
    assert plan.total <= plan.budget


def cap_for(config: EngineConfig, share: float) -> float:
    """A --gpu-mem-gb (GB) under which the expert cache gets about `share` of every expert."""
    p = plan_model(BUNDLED, dataclasses.replace(config, gpu_mem_gb=1.0))  # a tier: its buffers
    rest = p.weights + p.kv + p.state + p.buffers
    experts = p.num_experts * p.slot_bytes
    return (rest + share * experts) / (1 - memory_plan.MARGIN_FRAC) / GB


def test_plain_cpu_plan_has_no_cache_and_matches():
    with Engine(BUNDLED, cpu(ctx_size=256, parallel=2)) as engine:
        plan = engine.memory_plan
        assert plan.num_slots == 0 and plan.expert_cache == 0 and plan.state == 0
        assert plan.kv_tokens == 512 and plan.ctx_size == 256 and plan.parallel == 2
        assert_plan_matches(engine)


def test_the_cache_takes_what_the_context_leaves_under_the_cap():
    config = cpu(ctx_size=512, parallel=2)
    cap = cap_for(config, 0.5)
    with Engine(BUNDLED, cpu(ctx_size=512, parallel=2, gpu_mem_gb=cap)) as engine:
        plan = engine.memory_plan
        assert plan.budget == int(cap * GB) and "--gpu-mem-gb" in plan.budget_from
        assert 0.45 * plan.num_experts <= plan.num_slots <= 0.55 * plan.num_experts
        assert plan.budget - plan.total < plan.slot_bytes  # whole slots, nothing wasted
        assert_plan_matches(engine)
    # more context under the same cap: fewer slots
    longer = plan_model(BUNDLED, cpu(ctx_size=640, parallel=2, gpu_mem_gb=cap))
    assert longer.num_slots < plan.num_slots


def test_an_override_past_the_cap_is_refused():
    cap = cap_for(cpu(ctx_size=512, parallel=2), 0.5)
    with pytest.raises(ConfigError, match=r"--expert-cache-frac 1 .* exceeds .*lower "
                                          r"--expert-cache-frac to [0-9.]+ or less"):
        plan_model(BUNDLED, cpu(ctx_size=512, parallel=2, gpu_mem_gb=cap, expert_cache_frac=1.0))
    ok = plan_model(BUNDLED, cpu(ctx_size=512, parallel=2, gpu_mem_gb=cap, expert_cache_frac=0.25))
    assert ok.num_slots == int(0.25 * ok.num_experts)


def test_a_context_too_large_for_the_cap_is_refused():
    with pytest.raises(ConfigError) as e:
        plan_model(BUNDLED, cpu(ctx_size=4096, parallel=4, gpu_mem_gb=0.1))
    msg = str(e.value)
    assert "the context does not fit" in msg and "16384 tokens" in msg
    assert "lower --ctx-size to" in msg and "raise --gpu-mem-gb" in msg
    # the size it names fits
    fits = int(msg.split("lower --ctx-size to ")[1].split()[0])
    assert plan_model(BUNDLED, cpu(ctx_size=fits, parallel=4, gpu_mem_gb=0.1)).total <= 0.1 * GB


def test_gpu_mem_gb_is_validated():
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ConfigError, match="--gpu-mem-gb must be > 0"):
            EngineConfig(gpu_mem_gb=bad)


def test_run_prints_the_plan_and_refuses_a_context_that_cannot_fit():
    base = ["run", "--device", "cpu", "-n", "4", "--temp", "0", "-p", "hello"]
    ok = CliRunner().invoke(main, base + ["--ctx-size", "256", "--gpu-mem-gb", "0.2"])
    assert ok.exit_code == 0, ok.output
    lines = ok.stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("memory plan (cpu"))
    block = "\n".join(lines[start:start + 4])
    for key in ("--gpu-mem-gb 0.2", "weights", "KV", "1024 tokens: context 256 x 4 sequences",
                "expert cache", "of 192 experts", "host: expert banks"):
        assert key in block, (key, block)
    bad = CliRunner().invoke(main, base + ["--ctx-size", "100000", "--gpu-mem-gb", "0.2"])
    assert bad.exit_code == 2
    err = bad.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the context does not fit"), bad.stderr
    assert "--ctx-size" in err[0] and "--gpu-mem-gb" in err[0]


def test_host_ram_short_of_the_banks_is_refused(monkeypatch):
    banks = plan_model(BUNDLED, cpu()).host_banks
    monkeypatch.setattr(host_memory, "read_mem_available", lambda: banks - 4096)
    monkeypatch.setattr(host_memory, "read_cgroup_room", lambda: None)
    with pytest.raises(ModelError, match=r"expert banks need 0\.01 GB of host RAM but 0\.01 GB "
                                         r"is available \(MemAvailable\)"):
        Engine(BUNDLED, cpu())
    # a container's limit below MemAvailable is the one that counts
    monkeypatch.setattr(host_memory, "read_mem_available", lambda: 1 << 40)
    monkeypatch.setattr(host_memory, "read_cgroup_room", lambda: banks // 2)
    with pytest.raises(ModelError, match="the container's memory limit"):
        Engine(BUNDLED, cpu())
    # room for the banks but not for the cpu device's part: the context is refused
    monkeypatch.setattr(host_memory, "read_cgroup_room", lambda: banks + 10_000_000)
    with pytest.raises(ConfigError, match="available host RAM less the expert banks"):
        Engine(BUNDLED, cpu(ctx_size=4096, parallel=4))


def test_host_available_falls_back_to_sysconf(monkeypatch):
    real = host_memory.read_mem_available()  # this Linux host's /proc/meminfo
    assert isinstance(real, int) and real > 0
    monkeypatch.setattr(host_memory, "read_mem_available", lambda: None)
    monkeypatch.setattr(host_memory, "read_cgroup_room", lambda: None)
    monkeypatch.setattr(host_memory, "read_free_pages", lambda: 123 << 20)
    assert host_memory.host_available() == (123 << 20, "free pages")


@pytest.mark.parametrize("family", ["qwen3_next", "deepseek_v2"])
def test_state_and_latent_kv_match_what_is_allocated(tmp_path, family):
    from ftw.convert import convert
    src = mtm.build(tmp_path / "hf", family, dtype="fp32", seed=1)
    path = str(tmp_path / "m.ftw")
    convert(str(src), path, dtype="auto", progress=False)
    with Engine(path, cpu(dtype="fp32", ctx_size=128, parallel=3, gpu_mem_gb=0.5)) as engine:
        plan = engine.memory_plan
        assert_plan_matches(engine)
        if family == "qwen3_next":
            state = engine.state.conv.nbytes + engine.state.recurrent.nbytes
            # the running ones, their page-boundary copies, the engine's own, the states
            # kept at anchors (their budget: num_default_states of them) and those a prefill
            # forward takes
            kept = engine.config.num_default_states
            assert state > 0 and plan.state == (2 * 3 + 1 + kept + SNAPSHOTS_PER_FORWARD) * state
            assert engine.kv_manager.radix.state_budget == kept * state
        else:
            assert engine.model_config.is_mla and plan.state == 0


def cuda_plan(monkeypatch, free_gb: float, memlock=None, **options):
    """The plan on cuda for the bundled model, the GPU's free memory and the locked-memory
    limit given (the readers patched: no GPU needed for the arithmetic)."""
    import ftw
    from freetoken.config import ModelConfig
    monkeypatch.setattr(memory_plan, "gpu_free", lambda device: int(free_gb * GB))
    monkeypatch.setattr(host_memory, "read_memlock", lambda: memlock)
    options.setdefault("prefill_chunk", 512)  # (None: the cuda default, PREFILL_CHUNK)
    with ftw.open(BUNDLED) as f:
        return memory_plan.make_memory_plan(ModelConfig.from_dict(f.config),
                                            EngineConfig(**options), f, "cuda", torch.bfloat16)


def test_the_prefill_chunk_defaults_per_device(monkeypatch):
    from freetoken.config import PREFILL_CHUNK
    auto = cuda_plan(monkeypatch, 8.0, prefill_chunk=None)
    assert auto.buffers == cuda_plan(monkeypatch, 8.0, prefill_chunk=PREFILL_CHUNK["cuda"]).buffers
    assert auto.buffers > cuda_plan(monkeypatch, 8.0, prefill_chunk=512).buffers
    with LLM(device="cpu") as llm:
        assert llm.engine.config.prefill_chunk == PREFILL_CHUNK["cpu"]


def test_the_cuda_plan_from_free_memory_and_the_cap(monkeypatch):
    plan = cuda_plan(monkeypatch, 2.0, ctx_size=1024, parallel=2)
    assert plan.budget == int(2 * GB) and plan.budget_from == "free GPU memory"
    assert plan.margin == int(memory_plan.MARGIN_FIXED_CUDA + memory_plan.MARGIN_FRAC * 2 * GB)
    assert plan.num_slots == plan.num_experts  # the tiny model's experts all fit
    assert plan.weights == 2 * sum(math.prod(t.shape) for t in _file_tensors())  # bf16
    capped = cuda_plan(monkeypatch, 2.0, ctx_size=1024, parallel=2, gpu_mem_gb=0.6)
    assert capped.budget == int(0.6 * GB) and capped.budget_from == "--gpu-mem-gb 0.6"
    above = cuda_plan(monkeypatch, 0.7, gpu_mem_gb=24)
    assert above.budget == int(0.7 * GB) and "below --gpu-mem-gb 24" in above.budget_from
    with pytest.raises(ConfigError, match="lower --ctx-size to .* or free GPU memory"):
        cuda_plan(monkeypatch, 0.7, ctx_size=1 << 20, parallel=1)
    assert plan.pinned and "pinned" in "\n".join(plan.lines())


def test_the_cuda_plan_says_when_the_banks_pass_the_memlock_limit(monkeypatch):
    low = cuda_plan(monkeypatch, 2.0, memlock=64 << 10, ctx_size=256)
    assert "ulimit -l" in "\n".join(low.lines()) and low.memlock == 64 << 10
    high = cuda_plan(monkeypatch, 2.0, memlock=1 << 40, ctx_size=256)
    assert "ulimit" not in "\n".join(high.lines())


def _file_tensors():
    import ftw
    with ftw.open(BUNDLED) as f:
        return list(f.tensors.values())


def test_chat_prints_the_plan_and_bench_takes_the_cap():
    chat = CliRunner().invoke(main, ["chat", "--device", "cpu", "--ctx-size", "256"],
                              input="/exit\n")
    assert chat.exit_code == 0, chat.output
    assert chat.stderr.startswith("memory plan (cpu"), chat.stderr
    bench = CliRunner().invoke(main, ["bench", "--device", "cpu", "-p", "0", "-n", "1", "-r", "1",
                                      "--gpu-mem-gb", "0.01"])
    assert bench.exit_code == 2 and "error: the context does not fit" in bench.stderr, bench.output


def test_the_cgroup_reader_v2_v1_and_no_limit(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("8000000000\n")
    (v2 / "memory.current").write_text("3000000000\n")
    assert host_memory.read_cgroup_room(str(v2)) == 5_000_000_000
    # inactive page cache (a model file just read) is reclaimable: it counts as room
    (v2 / "memory.stat").write_text("anon 1000000000\nfile 2000000000\nactive_file 500000000\n"
                                    "inactive_file 1500000000\n")
    assert host_memory.read_cgroup_room(str(v2)) == 6_500_000_000
    (v2 / "memory.max").write_text("max\n")
    assert host_memory.read_cgroup_room(str(v2)) is None
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("4000000000\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text("5000000000\n")
    assert host_memory.read_cgroup_room(str(v1)) == 0  # over the limit: no room
    (v1 / "memory" / "memory.stat").write_text("cache 3000000000\ntotal_inactive_file 2000000000\n")
    assert host_memory.read_cgroup_room(str(v1)) == 1_000_000_000
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(2 ** 63 - 4096))  # v1's "none"
    assert host_memory.read_cgroup_room(str(v1)) is None
    assert host_memory.read_cgroup_room(str(tmp_path / "absent")) is None


def test_the_plan_says_how_the_slots_are_kept():
    """cuda: the runtime's storage_info (experts/cache.py create_slot_memory) after the expert
    cache line; the cpu device has none."""
    plan = plan_model(None, cpu(ctx_size=256))
    assert plan.slot_storage == "" and len(plan.lines()) == 4
    said = dataclasses.replace(plan, slot_storage="expert cache slots at a fixed address (x)")
    lines = said.lines()
    assert lines[3] == "  expert cache slots at a fixed address (x)"
    assert lines[2].startswith("  expert cache") and lines[4].startswith("  host:")
