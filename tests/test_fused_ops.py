"""The fused kernels of the attention segment (freetoken/models/fused.py) against the torch code
they replace, and the model wired with them (the router's kernel too: its own checks are
tests/test_fused_router.py; the split-K decode attention's tests/test_split_attention.py).

interpreter: the Triton kernels on cpu tensors under TRITON_INTERPRET=1 (tests/conftest.py sets it
  without CUDA; skipped where Triton does not import). The interpreter casts fp32 -> bf16 by truncation, not to nearest, so
  bf16 results are compared within a few rounding steps there; the gpu tests hold the exact ones.
gpu: the same comparisons on cuda (bit-exact where no reduction is involved), the model with
  the fused kernels and with fused.enabled patched off (its torch path), fewer kernels per
  decode layer.
cpu: the cpu path is the torch composition of before, op for op, and never calls a kernel
  (split_attention's included).

Kernels per decode layer on a GPU host (eager T=1 step over a static KV span, torch.profiler):
    python tests/test_fused_ops.py
The helpers these tests share with the router's, the KV store's and the attention's:
tests/fused_support.py.
"""
import pytest
import torch
import torch.nn.functional as F

from freetoken.kv_cache import KVCache
from freetoken.models import fused, fused_gemv, fused_router, split_attention
from freetoken.models.rope import apply_rotary

from fused_support import (DTYPES, FAMILIES, assert_near, captured_step, cos_sin, interpreter,
                           kernel_checks_test, make_model, rand, run_tokens)


# ---- references: the torch code the kernels replace --------------------------------------------

def ref_rms(x, w, eps):
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


# ---- kernel checks, run by the interpreter tests (cpu) and the gpu tests (cuda) ----------------

def check_rms_norm(device, dtype):
    exact = False  # the row statistics may round differently (reduction order)
    for i, shape in enumerate([(1, 7), (5, 300), (2, 3, 33), (3, 2048)]):
        x = rand(*shape, dtype=dtype, device=device, scale=3, seed=i)
        w = rand(shape[-1], dtype=dtype, device=device, seed=100 + i) * 0.3 + 1
        assert_near(fused.rms_norm(x, w, 1e-6), ref_rms(x, w, 1e-6), exact, f"rms {shape}")
    wide = rand(4, 50, dtype=dtype, device=device, seed=7)
    x = wide[:, 3:40]  # rows not back to back
    w = rand(37, dtype=dtype, device=device, seed=8) + 1
    assert_near(fused.rms_norm(x, w, 1e-5), ref_rms(x, w, 1e-5), exact, "rms strided")
    assert fused.rms_norm(x[:0], w, 1e-5).shape == (0, 37)


def check_add_rms_norm(device, dtype):
    for i, (N, D) in enumerate([(1, 7), (6, 300), (2, 2048)]):
        h = rand(N, D, dtype=dtype, device=device, scale=4, seed=i)
        d = rand(N, D, dtype=dtype, device=device, seed=50 + i)
        w = rand(D, dtype=dtype, device=device, seed=100 + i) * 0.3 + 1
        out, y = fused.add_rms_norm(h, d, w, 1e-6)
        # the sum is one rounding of an exact fp32 sum, on every backend but the interpreter
        assert_near(out, h + d, device != "cpu" or dtype == torch.float32, f"add {N}x{D}")
        assert_near(y, ref_rms(h + d, w, 1e-6), False, f"add+rms {N}x{D}")


def check_qk_rope(device, dtype):
    exact = device != "cpu" or dtype == torch.float32  # products and sums as torch rounds them
    for i, (T, H, KV, hd) in enumerate([(1, 6, 2, 10), (3, 4, 4, 16), (5, 32, 4, 128)]):
        qkv = rand(T, (H + 2 * KV) * hd, dtype=dtype, device=device, scale=2, seed=i)
        q, k, _ = qkv.split((H * hd, KV * hd, KV * hd), dim=-1)  # views, as Attention makes them
        cos, sin = cos_sin(T, hd, dtype, device, seed=i)
        qo, ko = fused.qk_rope(q, k, cos, sin, hd)
        q3, k3 = q.reshape(T, H, hd), k.reshape(T, KV, hd)
        assert_near(qo, apply_rotary(q3, cos, sin), exact, f"rope q {T, H, hd}")
        assert_near(ko, apply_rotary(k3, cos, sin), exact, f"rope k {T, KV, hd}")
        qw = rand(hd, dtype=dtype, device=device, seed=20 + i) * 0.3 + 1
        kw = rand(hd, dtype=dtype, device=device, seed=30 + i) * 0.3 + 1
        qo, ko = fused.qk_rope(q3.contiguous(), k, cos, sin, hd, (qw, 1e-6), (kw, 1e-5))
        want_q = apply_rotary(ref_rms(q3, qw, 1e-6), cos, sin)
        want_k = apply_rotary(ref_rms(k3, kw, 1e-5), cos, sin)
        assert_near(qo, want_q, False, f"norm+rope q {T, H, hd}")
        assert_near(ko, want_k, False, f"norm+rope k {T, KV, hd}")


test_kernels = kernel_checks_test([check_rms_norm, check_add_rms_norm, check_qk_rope])


# ---- the model with and without the fused path -------------------------------------------------

def check_model(family, device, dtype, monkeypatch, force_on_cpu=False):
    model = make_model(family, device, dtype)
    enabled = fused.enabled
    monkeypatch.setattr(fused, "enabled", lambda x: False)  # the torch path: the reference
    ref = run_tokens(model, device)
    monkeypatch.setattr(fused, "enabled", enabled)
    if force_on_cpu:  # the interpreter runs the kernels on cpu tensors
        monkeypatch.setattr(fused, "enabled", lambda x: x.dtype in fused._DTYPES)
    ours = run_tokens(model, device)
    assert all(blk.attn._qkv is not None for blk in model.blk), "the fused q/k/v did not run"
    if dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    else:  # bf16 roundings that differ by a step propagate through the layers
        assert float((ours - ref).abs().max()) <= 0.05 * float(ref.abs().max())
    torch.testing.assert_close(run_tokens(model, device), ours, rtol=0, atol=0)  # deterministic


@interpreter
@pytest.mark.slow  # (a whole model's forwards in the interpreter: seconds each)
@pytest.mark.parametrize("dtype", ["fp32"])  # (bf16: the cuda test, exact; the interpreter
@pytest.mark.parametrize("family", FAMILIES)  # truncates bf16 casts, so only loose here)
def test_model_fused_equals_torch_interpreted(family, dtype, monkeypatch):
    check_model(family, "cpu", DTYPES[dtype], monkeypatch, force_on_cpu=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_model_fused_equals_torch_cuda(family, dtype, monkeypatch):
    check_model(family, "cuda", DTYPES[dtype], monkeypatch)


# ---- cpu: unchanged ---------------------------------------------------------------------------

def reference_forward(model, ids, positions, kv):
    """MoETransformer.forward as it was before the fused path (residual adds inside each block)."""
    from freetoken.models.layers import attention_mask
    from freetoken.models.transformer import Step
    T = ids.shape[0]
    start = kv.reserve(T)
    h = model.token_embd(ids)
    cos, sin = model.rotary.cos_sin(positions, h.dtype)
    mask = attention_mask(start, T, model.config.sliding_window, h.device)
    step = Step(start, cos, sin, mask, kv, model.expert_runtime)
    for blk in model.blk:
        h = h + blk.attn(blk.attn_norm(h), blk.layer, step)
        h = h + blk.ffn(blk.ffn_norm(h), blk.layer, step)
    logits = F.linear(model.output_norm(h), model.output.weight)
    kv.commit(T)
    return logits.float()


@pytest.mark.parametrize("family", FAMILIES)
def test_cpu_path_is_the_torch_composition(family, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a fused kernel was called on the cpu path")
    for name in ("rms_norm", "add_rms_norm", "qk_rope", "fuse_qkv"):
        monkeypatch.setattr(fused, name, refuse)
    monkeypatch.setattr(fused_router, "softmax_topk", refuse)
    monkeypatch.setattr(fused_gemv, "gemv", refuse)
    monkeypatch.setattr(split_attention, "decode_attention", refuse)
    model = make_model(family, "cpu", torch.bfloat16)
    assert not fused.enabled(model.token_embd.weight)
    ids = torch.tensor([3, 17, 42, 8, 29, 11])
    with torch.inference_mode():
        def kv():
            return KVCache(model.config, 8, "cpu", torch.bfloat16)
        ours = model(ids, torch.arange(6), kv())
        ref = reference_forward(model, ids, torch.arange(6), kv())
    assert torch.equal(ours, ref)
    assert all(blk.attn._qkv is None for blk in model.blk)


def test_fused_selection():
    class FakeCuda:  # (its own: this test changes the dtype)
        is_cuda, dtype = True, torch.bfloat16
    assert not fused.enabled(torch.zeros(2))  # cpu: never, with or without Triton
    assert fused.enabled(FakeCuda()) == fused.available()
    FakeCuda.dtype = torch.int64
    assert not fused.enabled(FakeCuda())


# ---- gpu: captured decode, kernel count ---------------------------------------------------------

def decode_kernels(fused_on: bool, num_layers: int, dtype=torch.bfloat16) -> int:
    """GPU operations (kernels, copies, memsets) of one eager T=1 decode step of a tiny
    all-MoE qwen3_moe shaped as the captured step (static KV span, masked grouped attention);
    the routed experts are the identity, so what is counted is the attention segment, the
    router and the residual adds. fused_on False: fused.enabled patched off for the step."""
    from torch.profiler import ProfilerActivity, profile
    from freetoken.graphs import StaticKV
    model = make_model("qwen3_moe", "cuda", dtype, identity=True, num_layers=num_layers,
                       moe_layers=tuple(range(num_layers)), num_heads=32, num_kv_heads=4,
                       head_dim=128, hidden_size=256)
    kv = KVCache(model.config, 64, "cuda", dtype)
    ids, pos = torch.tensor([7], device="cuda"), torch.tensor([0], device="cuda")
    with pytest.MonkeyPatch.context() as mp, torch.inference_mode():
        if not fused_on:
            mp.setattr(fused, "enabled", lambda x: False)
        model(ids, pos, StaticKV(kv, pos, 32), 1)  # the inline step: lazy init, compiles
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(ids, pos, StaticKV(kv, pos, 32), 1)
            torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def kernels_per_layer(fused_on: bool) -> float:
    return (decode_kernels(fused_on, 4) - decode_kernels(fused_on, 2)) / 2


@pytest.mark.gpu
def test_fewer_kernels_per_decode_layer():
    before, after = kernels_per_layer(False), kernels_per_layer(True)
    print(f"kernels per decode layer: {before} unfused, {after} fused")
    assert after <= before - 8, (before, after)


@pytest.mark.gpu
def test_captured_step_fused_equals_torch(monkeypatch):
    """A decode step captured in a CUDA graph (the fused kernels inside) replays the eager
    unfused step's logits (fp32)."""
    from freetoken.graphs import StaticKV
    model = make_model("qwen3_moe", "cuda", torch.float32)
    ids = torch.tensor([3, 17, 42, 8, 29], device="cuda")

    def prefill(kv):
        model(ids[:4], torch.arange(4, device="cuda"), kv)
    with torch.inference_mode():
        enabled = fused.enabled
        monkeypatch.setattr(fused, "enabled", lambda x: False)  # the torch path: the reference
        kv = KVCache(model.config, 16, "cuda", torch.float32)
        prefill(kv)
        ref = model(ids[4:], torch.tensor([4], device="cuda"), kv).clone()
        monkeypatch.setattr(fused, "enabled", enabled)
        kv = KVCache(model.config, 16, "cuda", torch.float32)
        prefill(kv)
        tok, pos = ids[4:].clone(), torch.tensor([4], device="cuda")
        out = captured_step(model, tok, pos, StaticKV(kv, pos, 16))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert all(blk.attn._qkv is not None for blk in model.blk)


if __name__ == "__main__":  # kernels per decode layer, unfused vs fused (needs CUDA)
    print(f"kernels per decode layer: {kernels_per_layer(False)} unfused, "
          f"{kernels_per_layer(True)} fused")
