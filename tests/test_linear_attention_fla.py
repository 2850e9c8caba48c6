"""The gated delta rule through fla's kernels (linear_attention.fla_for: cuda, bf16/fp16, fla-core
installed) against the torch ops: on cpu with test_bench_linear_attention's stand-in written from
fla's documented contract (the mapping of our arguments, segments at kept states, the state
copied back); on cuda with fla itself, the rule alone at the test and Qwen3.6 widths and the
whole tiny hybrid models in bf16 (prefill, graph and eager decode) against the torch ops and
fp32."""
import pytest
import torch

import make_tiny_model as mtm
from test_bench_linear_attention import fla_contract
from test_engine_oracle import score_then_decode
from freetoken.config import EngineConfig
from freetoken.engine import Engine
from freetoken.models import linear_attention as la


def inputs(T, nk, nv, dk, dv, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k = (torch.nn.functional.silu(rand(T, nk, dk)) for _ in range(2))
    v = torch.nn.functional.silu(rand(T, nv, dv))
    beta = rand(T, nv).sigmoid()
    g = -torch.nn.functional.softplus(rand(T, nv)) * 0.3
    state = rand(nv, dk, dv) * 0.05
    to = lambda x: x.to(device, torch.bfloat16)  # noqa: E731
    return to(q), to(k), to(v), g.to(device), to(beta), state.to(device)


def run(q, k, v, g, beta, state, keep_at):
    state = state.clone()
    kept = [(n, torch.empty_like(state)) for n in keep_at]
    o = la.gated_delta_rule(q, k, v, g, beta, state, kept)
    return o.float(), state, [s for _, s in kept]


def torch_ops(x, keep_at):
    """The torch ops on the same bf16 values in fp32 (the reference)."""
    q, k, v, g, beta, state = x
    return run(q.float(), k.float(), v.float(), g, beta.float(), state, keep_at)


def assert_near(ours, ref, what, rel=2 ** -6):
    bound = rel * float(ref.abs().max())
    assert float((ours - ref).abs().max()) <= bound, what


def check(x, keep_at):
    o, state, kept = run(*x, keep_at)
    ro, rstate, rkept = torch_ops(x, keep_at)
    assert_near(o, ro, "output")
    assert_near(state, rstate, "final state")
    for n, a, b in zip(keep_at, kept, rkept):
        assert_near(a, b, f"state kept after {n} tokens")


def test_fla_for_takes_the_torch_ops_off_cuda_and_in_fp32():
    assert la.fla_for(torch.zeros(1, dtype=torch.bfloat16)) is None
    if torch.cuda.is_available():
        assert la.fla_for(torch.zeros(1, device="cuda")) is None  # fp32: the oracle's dtype


@pytest.mark.parametrize("T, keep_at", [(1, []), (9, []), (70, [1, 33, 64]), (5, [5])])
def test_segments_through_fla_contract_equal_the_torch_ops(monkeypatch, T, keep_at):
    """Our arguments in fla's terms (GVA 2 key / 4 value heads, odd value width), one call per
    segment between kept states, 1-token segments through the recurrent kernel."""
    calls = []

    def kernel(name):
        def call(*args, **kwargs):
            calls.append((name, args[0].shape[1]))
            return fla_contract(*args, **kwargs)
        return call
    kernels = (kernel("chunk"), kernel("recurrent"))
    monkeypatch.setattr(la, "fla_for", lambda v: kernels if v.dtype == torch.bfloat16 else None)
    check(inputs(T, 2, 4, 16, 24, "cpu"), keep_at)
    ends = [*keep_at, T]
    lengths = [e - b for b, e in zip([0, *ends], ends) if e > b]
    assert calls == [("recurrent" if n == 1 else "chunk", n) for n in lengths]


needs_fla = pytest.mark.skipif(la.fla_kernels() is None, reason="fla-core is not installed")


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("widths", [(2, 4, 16, 24), (16, 32, 128, 128)], ids=["tiny", "qwen3.6"])
@pytest.mark.parametrize("T, keep_at", [(1, []), (200, [1, 64, 130])])
def test_fla_on_cuda_equals_the_torch_ops(widths, T, keep_at):
    assert la.fla_for(torch.zeros(1, device="cuda", dtype=torch.bfloat16)) is not None
    check(inputs(T, *widths, "cuda"), keep_at)


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("family", mtm.HYBRID)
def test_hybrid_engine_in_bf16_with_fla_equals_the_torch_ops(family, tmp_path, monkeypatch):
    """A 150-token prompt in chunks of 100 then 10 decode steps, teacher-forced, in bf16, graphs
    and eager: with fla no further from the same engine in fp32 (the torch ops) than with the
    torch ops in bf16 (routing flips make either differ by more than one op's rounding). On the
    H200 (max |logit| 3.4 / 2.6): fla 0.18 / 0.16 from fp32, the torch ops 0.23 / 0.28."""
    path = mtm.build_ftw(tmp_path, family, seed=7)[1]
    ids = [3 + (i * 37) % 380 for i in range(160)]

    def logits(graphs, dtype="bf16"):
        cfg = EngineConfig(device="cuda", dtype=dtype, expert_cache_frac=0.5, prefill_chunk=100,
                           cuda_graphs=graphs)
        with Engine(path, cfg) as engine:
            out, _ = score_then_decode(engine, ids, 10)
        return out.float().cpu()

    fla = {graphs: logits(graphs) for graphs in (True, False)}
    monkeypatch.setattr(la, "fla_for", lambda v: None)
    ops = {graphs: logits(graphs) for graphs in (True, False)}
    ref = logits(False, dtype="fp32")  # the torch ops in fp32: the truth both bf16 runs round
    diff = lambda x, y: float((x - y).abs().max())  # noqa: E731
    print(f"{family}: max |logit| {float(ref.abs().max()):.3g}; from fp32: fla graphs "
          f"{diff(fla[True], ref):.3g} eager {diff(fla[False], ref):.3g}, ops graphs "
          f"{diff(ops[True], ref):.3g} eager {diff(ops[False], ref):.3g}")
    for graphs in (True, False):
        assert diff(fla[graphs], ref) <= 1.5 * diff(ops[graphs], ref) + 0.01 * float(
            ref.abs().max()), f"fla further from fp32 than the torch ops, graphs={graphs}"


def test_kernel_note_where_fla_would_run_but_is_missing(monkeypatch):
    """run, chat and serve say so where a hybrid's DeltaNet layers fall back to the torch ops on
    cuda (the note names the fix); nowhere else."""
    from types import SimpleNamespace
    hybrid, dense = SimpleNamespace(linear_layers=(0, 1, 2)), SimpleNamespace(linear_layers=())
    cuda, cpu, bf16 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16
    monkeypatch.setattr(la, "fla_kernels", lambda: None)
    assert 'pip install "freetoken[cuda]"' in la.kernel_note(hybrid, cuda, bf16)
    assert la.kernel_note(hybrid, cuda, torch.float32) is None  # fp32 runs the torch ops anyway
    assert la.kernel_note(hybrid, cpu, bf16) is None
    assert la.kernel_note(dense, cuda, bf16) is None
    monkeypatch.setattr(la, "fla_kernels", lambda: (fla_contract, fla_contract))
    assert la.kernel_note(hybrid, cuda, bf16) is None


@pytest.mark.parametrize("family", mtm.HYBRID)
def test_engine_through_fla_contract_keeps_and_restores_states(family, tmp_path, monkeypatch):
    """The tiny hybrids in fp32 on cpu with every gated delta rule sent through the engine's fla
    path (fla_for answering for fp32 too, the kernels replaced by fla's contract): a long prompt
    in chunks of 5 with states kept every 4 tokens, then a prompt whose first 8 tokens come from
    the prefix cache with the state kept there restored: both equal the torch ops' logits."""
    from freetoken import kv_cache
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    path = mtm.build_ftw(tmp_path, family, seed=7)[1]
    prompt = [5, 77, 300, 12, 9, 141, 250, 33, 61, 199, 8, 120, 45, 370]

    def scores():
        cfg = EngineConfig(device="cpu", dtype="fp32", expert_cache_frac=0.5, prefill_chunk=5,
                           state_interval=4)
        with Engine(path, cfg) as engine:
            engine.score(prompt[:11] + [1, 2])  # keeps states at 4 and 8 tokens
            cached = engine.score(prompt, prefix_cache=True)
            assert engine.last_stats.cached_tokens == 8
            return cached, engine.score(prompt)

    ops_cached, ops_cold = scores()
    monkeypatch.setattr(la, "fla_for", lambda v: (fla_contract, fla_contract))
    fla_cached, fla_cold = scores()
    for ours, ref, what in ((fla_cold, ops_cold, "cold"), (fla_cached, ops_cached, "cached"),
                            (fla_cached, fla_cold[8:], "cached against cold")):
        assert float((ours - ref).abs().max()) <= 1e-4, what


def test_warm_fla_calls_each_kernel_once_at_the_models_head_shape(monkeypatch):
    """At load, where fla runs the rule: one chunked segment and one recurrent token at the
    model's head shape (fla's autotuning then happens in the load); nothing for a model without
    DeltaNet layers or where the torch ops run."""
    from types import SimpleNamespace
    calls = []

    def kernel(name):
        def call(q, k, v, **kwargs):
            calls.append((name, tuple(q.shape), tuple(v.shape), tuple(kwargs["initial_state"].shape)))
            return fla_contract(q, k, v, **kwargs)
        return call
    cfg = SimpleNamespace(linear_layers=(0, 2), linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=16, linear_value_head_dim=24)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    la.warm_fla(cfg, cpu, bf16)  # fla_for: the torch ops on cpu
    kernels = (kernel("chunk"), kernel("recurrent"))
    monkeypatch.setattr(la, "fla_for", lambda v: kernels)
    la.warm_fla(SimpleNamespace(linear_layers=()), cpu, bf16)
    assert calls == []
    la.warm_fla(cfg, cpu, bf16)
    assert calls == [("chunk", (1, 64, 2, 16), (1, 64, 4, 24), (1, 4, 16, 24)),
                     ("recurrent", (1, 1, 2, 16), (1, 1, 4, 24), (1, 4, 16, 24))]
