"""Prefill layer streaming (freetoken/experts/prefill/stream.py) with 1, 2 and 3 device layer buffers:
each acquire sees exactly its layer's bytes, a buffer is never rewritten while its layer is in
use, copies are issued as buffers are released, the timeline's order; the streamed prefill
equals the reference experts and the resident engine, on the cpu tier (a background copy
thread) and, marked gpu, on cuda (copy stream and events)."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import make_tiny_model as mtm
from bench_host_banks import HostBanks
from freetoken.config import EngineConfig, ModelConfig, Tuning
from freetoken.errors import ConfigError
from freetoken.experts.reference import DenseReferenceExperts
from freetoken.experts.runtime import ExpertRuntime
from freetoken.experts.prefill.stream import LayerStreamer

LAYERS = [0, 1, 2, 4, 5, 6, 7]  # 7 MoE layers (3 dense): more than any buffer count here


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """The kernel executor sets torch to one thread (its thread rule); restore it after."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def fake_banks(layers, seed=0):
    """{layer: bank-like}: random bytes, a different size per layer (E * stride varies)."""
    rng = np.random.default_rng(seed)
    banks = {}
    for i, layer in enumerate(layers):
        E, stride = 3 + i % 3, 64 * (1 + i % 2)
        info = SimpleNamespace(num_experts=E, slot_stride=stride)
        banks[layer] = SimpleNamespace(info=info, data=rng.integers(0, 256, E * stride, dtype=np.uint8))
    return banks


def make_streamer(banks, n):
    return LayerStreamer(banks, {layer: torch.from_numpy(b.data) for layer, b in banks.items()}, "cpu", n)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_each_acquire_sees_its_layer_and_its_buffer_is_not_rewritten_in_use(n):
    banks = fake_banks(LAYERS)
    st = make_streamer(banks, n)
    try:
        for _ in range(3):  # steps: buffers hold the last step's layers at each begin
            st.begin()
            for i, layer in enumerate(LAYERS):
                buf = st.acquire(layer)
                b = i % n
                assert buf.data_ptr() == st.buffers[b].data_ptr()
                assert np.array_equal(buf.numpy(), banks[layer].data)
                # in use: no copy into this buffer has been issued since, and its own is done
                assert st.holder[b] == layer and st.ready[b].done()
                st.release(layer)
                nxt = LAYERS[i + n] if i + n < len(LAYERS) else layer
                assert st.holder[b] == nxt  # released: the layer n places later is issued at once
    finally:
        st.close()


def test_acquire_out_of_order_without_begin_copies_on_demand():
    banks = fake_banks(LAYERS, seed=1)
    st = make_streamer(banks, 2)
    try:
        for layer in [5, 0, 7, 7, 2]:
            assert np.array_equal(st.acquire(layer).numpy(), banks[layer].data)
            st.release(layer)
    finally:
        st.close()


@pytest.mark.parametrize("bad", [0, -1, "2", True, 1.5])
def test_bad_buffer_count_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="prefill_buffers must be an integer >= 1"):
        make_streamer(fake_banks(LAYERS), bad)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_timeline_order(n):
    """Every layer copied once per step; its compute starts after its copy ended; a copy into
    a buffer starts after the compute that used the buffer before ended (layer n earlier)."""
    banks = fake_banks(LAYERS)
    st = make_streamer(banks, n)
    st.timing = True
    try:
        for _ in range(2):
            st.begin()
            for layer in LAYERS:
                st.acquire(layer)
                st.release(layer)
            st.timeline.mark("end")
            spans = st.timeline.spans()
            assert [s.layer for s in spans] == LAYERS
            assert [s.nbytes for s in spans] == [banks[layer].data.nbytes for layer in LAYERS]
            for i, s in enumerate(spans):
                assert s.queued <= s.copy <= s.copy_end <= s.compute <= s.compute_end
                assert s.want <= s.compute
                if i >= n:
                    assert s.copy >= spans[i - n].compute_end
            assert st.timeline.elapsed_ms("end") >= spans[-1].compute_end
    finally:
        st.close()


# ---- the runtime, streamed vs the reference ------------------------------------------------------

def tiny_config(layers, E=8, K=2, D=64, I=32):
    return ModelConfig(family="qwen3_moe", vocab_size=32, hidden_size=D, num_layers=max(layers) + 1,
                       num_heads=2, num_kv_heads=1, head_dim=D // 2, rms_norm_eps=1e-6, rope_theta=1e4,
                       max_position_embeddings=128, num_experts=E, num_experts_per_tok=K,
                       moe_intermediate_size=I, moe_layers=tuple(layers))


def streamed_vs_reference(device, n, tier_compute="torch", steps=(40, 9, 64), dtype=torch.float32):
    """Streamed prefill steps through every MoE layer of a runtime with n layer buffers and no
    expert cache, against DenseReferenceExperts; returns (worst |diff| / max |ref|, stats)."""
    mc = tiny_config(LAYERS)
    hb = HostBanks(mc, threads=1, seed=3)
    if device == "cuda":
        hb.pin()
    tuning = Tuning(prefill_stream=True, prefill_stream_min_tokens=1, prefill_buffers=n,
                    prefill_choice="stream",  # every layer (cuda's default auto decides per layer)
                    cpu_experts="kernels" if tier_compute == "kernels" else "torch",
                    tier_torch=tier_compute != "kernels")
    rt = ExpertRuntime(hb.banks, mc, EngineConfig(policy="hybrid", tuning=tuning), device, dtype, capacity=0)
    ref = DenseReferenceExperts(hb.banks, mc, device, dtype)
    gen = torch.Generator().manual_seed(n)
    worst = 0.0
    try:
        with torch.inference_mode():
            for T in steps:
                rt.begin_step("prefill", T)
                for layer in LAYERS:
                    x = torch.randn(T, mc.hidden_size, generator=gen).to(device, dtype)
                    ids = torch.stack([torch.randperm(mc.num_experts, generator=gen)[:2] for _ in range(T)])
                    w = torch.rand(T, 2, generator=gen)
                    ids, w = ids.to(device), (w / w.sum(-1, keepdim=True)).to(device)
                    want = ref.forward(layer, x, ids, w).float()
                    got = rt.forward(layer, x, ids, w).float()
                    worst = max(worst, float((got - want).abs().max() / want.abs().max()))
        if device == "cuda":
            torch.cuda.synchronize()
    finally:
        rt.close()
        hb.close()
    return worst, dict(rt.stats, tier_on_pool=rt.tier_on_pool)


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("tier_compute", ["torch", "kernels"])
def test_cpu_tier_streamed_runtime_equals_reference(n, tier_compute):
    if tier_compute == "kernels":
        import freetoken.kernels  # noqa: F401  (skips nothing: the kernels are built here)
    worst, stats = streamed_vs_reference("cpu", n, tier_compute)
    assert worst <= (1e-2 if tier_compute == "kernels" else 1e-5)  # kernels: bf16 dot products
    assert stats["tier_on_pool"] == (tier_compute == "kernels")
    assert stats["prefill_layers_streamed"] == 3 * len(LAYERS)
    assert stats["device_routes"] == stats["routes"] and stats["misses"] == 0


# ---- the engine: streamed prefill logits vs every expert resident ---------------------------------

@pytest.fixture(scope="module")
def tiny_ftw(tmp_path_factory):
    from ftw.convert import convert
    root = tmp_path_factory.mktemp("stream")
    src = mtm.build(root / "hf", "qwen3_moe", dtype="fp32", seed=11, num_hidden_layers=5)
    path = str(root / "model.ftw")
    convert(str(src), path, dtype="auto", progress=False)
    return path


PROMPT = [5, 77, 300, 12, 9, 141, 250, 33, 61, 199, 8, 120, 45, 370]


def score(path, device, chunk, **options):
    from freetoken.engine import Engine
    with Engine(path, EngineConfig(device=device, dtype="fp32", prefill_chunk=chunk, **options)) as engine:
        return engine.score(PROMPT).cpu(), dict(engine.experts.stats)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_cpu_tier_streamed_prefill_logits_equal_resident(tiny_ftw, n):
    resident, _ = score(tiny_ftw, "cpu", 512, expert_cache_frac=1.0)
    for chunk in (512, 5):  # one forward; three chunks, each streamed
        logits, stats = score(tiny_ftw, "cpu", chunk, expert_cache_frac=0.25,
                              tuning=Tuning(prefill_buffers=n, prefill_stream_min_tokens=1))
        torch.testing.assert_close(logits, resident, atol=1e-4, rtol=1e-4)
        assert stats["prefill_layers_streamed"] == 5 * -(-len(PROMPT) // chunk)


# ---- cuda -------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2, 3])
def test_cuda_streamed_runtime_equals_reference(n):
    worst, stats = streamed_vs_reference("cuda", n)
    assert worst <= 1e-5
    assert stats["prefill_layers_streamed"] == 3 * len(LAYERS)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 3])
def test_cuda_streamed_prefill_logits_equal_resident(tiny_ftw, n):
    resident, _ = score(tiny_ftw, "cuda", 512, expert_cache_frac=1.0)
    for chunk in (512, 5):
        logits, stats = score(tiny_ftw, "cuda", chunk, expert_cache_frac=0.0,
                              tuning=Tuning(prefill_buffers=n, prefill_stream_min_tokens=1,
                                            prefill_choice="stream"))
        torch.testing.assert_close(logits, resident, atol=1e-4, rtol=1e-4)
        assert stats["prefill_layers_streamed"] == 5 * -(-len(PROMPT) // chunk)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 3])
def test_cuda_timeline_order(n):
    """As test_timeline_order, from CUDA events on the copy and compute streams (the GPU-side
    waits order them; 1 µs of slack for the event clock)."""
    banks = fake_banks(LAYERS)
    host = {layer: torch.from_numpy(b.data).pin_memory() for layer, b in banks.items()}
    st = LayerStreamer(banks, host, "cuda", n)
    st.timing = True
    try:
        st.begin()
        for layer in LAYERS:
            buf = st.acquire(layer)
            torch.cuda._sleep(20000)  # a compute that reads the buffer for a while
            assert torch.equal(buf.cpu(), host[layer])
            st.release(layer)
        st.timeline.mark("end")
        spans = st.timeline.spans()
        eps = 1e-3
        assert [s.layer for s in spans] == LAYERS
        for i, s in enumerate(spans):
            assert s.queued <= s.copy + eps and s.copy <= s.copy_end + eps
            assert s.copy_end <= s.compute + eps and s.compute <= s.compute_end + eps
            if i >= n:
                assert s.copy + eps >= spans[i - n].compute_end
    finally:
        st.close()
