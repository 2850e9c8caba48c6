"""The KV-cache store folded into the q/k norm + rotary kernel (fused.qk_rope's cache argument)
and the captured decode step that takes it by default on cuda (layers._fused_kv_store):
the kernel writes exactly the k it returns and the given v into the token slots (a device slot
like the captured step's pos, or an int) and nothing else; the step's logits and KV cache are
bit for bit those of the separate store (StaticKV.store).

interpreter: the Triton kernels on cpu tensors under TRITON_INTERPRET=1 (tests/conftest.py sets it
  without CUDA; skipped where Triton does not import), the selection forced on cpu.
gpu: the same kernel checks on cuda, and the model's step captured in a CUDA graph and replayed.
everywhere: the selection (cuda with the fused kernels only), and the cpu path keeping the
  separate store.
"""
import pytest
import torch

from freetoken import graphs
from freetoken.models import fused, layers

from fused_support import (DTYPES, FAMILIES, check_cuda_only, cos_sin, interpreter,
                           kernel_checks_test, make_model, rand)
from test_split_attention import static_decode_logits

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def assert_bits(got, want, what):
    """Bit for bit (NaN payloads and the sign of zero included)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    g, w = got.contiguous().view(_INT_VIEW[got.dtype]), want.contiguous().view(_INT_VIEW[want.dtype])
    bad = int((g != w).sum())
    assert bad == 0, f"{what}: {bad} of {got.numel()} differ"


# ---- the kernel: q and k as without the cache, k and v in the token slots, nothing else ----------

STORE_CASES = [(1, 6, 2, 10), (3, 4, 4, 16), (1, 32, 4, 128), (3, 12, 2, 64)]  # (T, H, KV, hd)
SPAN, MAX_SLOTS = 24, 40  # the layer views cover SPAN of the cache's MAX_SLOTS


def check_qk_rope_store(device, dtype):
    nan = float("nan")
    # interpreted (cpu): a case per T and the two slot kinds, within the suite's time
    interpreted = device == "cpu"
    for i, (T, H, KV, hd) in enumerate(STORE_CASES):
        if interpreted and i not in (0, 3):
            continue
        qkv = rand(T, (H + 2 * KV) * hd, dtype=dtype, device=device, scale=2, seed=i)
        q, k, v = qkv.split((H * hd, KV * hd, KV * hd), dim=-1)  # views, as Attention makes them
        cos, sin = cos_sin(T, hd, dtype, device, seed=i)
        qw = rand(hd, dtype=dtype, device=device, seed=20 + i) * 0.3 + 1
        kw = rand(hd, dtype=dtype, device=device, seed=30 + i) * 0.3 + 1
        for norms in ((None, None), ((qw, 1e-6), (kw, 1e-5))):
            want_q, want_k = fused.qk_rope(q, k, cos, sin, hd, *norms)  # the kernel without a cache
            want_v = v.reshape(T, KV, hd)
            slots = (7, SPAN - T, torch.tensor([0]), torch.tensor([SPAN - T]))
            for slot in slots[1:3] if interpreted else slots:
                at = int(slot)
                what = f"T={T} H={H} KV={KV} hd={hd} norm={norms[0] is not None} slot={slot!r}"
                if torch.is_tensor(slot):
                    slot = slot.to(device)
                for need_k, v_in in ((True, v), (False, v.view(T, KV, hd))):
                    data = torch.full((2, 2, KV, MAX_SLOTS, hd), nan, dtype=dtype, device=device)
                    keys, values = data[1, 0, :, :SPAN], data[1, 1, :, :SPAN]  # layer 1's views
                    qo, ko = fused.qk_rope(q, k, cos, sin, hd, *norms,
                                           cache=(keys, values, slot, v_in), need_k=need_k)
                    assert_bits(qo, want_q, f"q, {what}")
                    if need_k:
                        assert_bits(ko, want_k, f"k, {what}")
                    else:
                        assert ko is None, what
                    assert_bits(data[1, 0, :, at:at + T], want_k.transpose(0, 1), f"keys, {what}")
                    assert_bits(data[1, 1, :, at:at + T], want_v.transpose(0, 1),
                                f"values, {what}")
                    data[1, :, :, at:at + T] = nan
                    assert data.isnan().all(), f"a slot other than the tokens' written, {what}"


test_qk_rope_store = kernel_checks_test([check_qk_rope_store])


# ---- the model's captured decode step with and without the fused store --------------------------

def watch_static_kv(monkeypatch):
    """Every StaticKV made from now on (graphs.StaticKV replaced by a subclass), each with the
    list of its store / views calls. -> the list of them."""
    made = []

    class Watched(graphs.StaticKV):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.calls = []
            made.append(self)

        def store(self, layer, *args):
            self.calls.append(("store", layer))  # store returns views(layer): both recorded
            return super().store(layer, *args)

        def views(self, layer):
            self.calls.append(("views", layer))
            return super().views(layer)
    monkeypatch.setattr(graphs, "StaticKV", Watched)
    return made


def check_model_fused_kv(family, device, dtype, monkeypatch, capture):
    """static_decode_logits' step with layers._fused_kv_store patched off (the reference) and as
    it is: the same logits and KV cache bit for bit, the store done by StaticKV.store in one and
    by the kernel in the other (capture: captured in a CUDA graph, run inline first, and
    replayed)."""
    model = make_model(family, device, dtype)
    L = model.config.num_layers
    made = watch_static_kv(monkeypatch)
    selection = layers._fused_kv_store
    monkeypatch.setattr(layers, "_fused_kv_store", lambda q: False)
    ref = static_decode_logits(model, device, capture=capture).clone()
    ref_cache = made[-1].pages.data.clone()
    runs = 2 if capture else 1  # captured_step runs the forward inline, then captures it
    assert made[-1].calls == [(name, i) for i in range(L) for name in ("store", "views")] * runs
    monkeypatch.setattr(layers, "_fused_kv_store", selection)
    ours = static_decode_logits(model, device, capture=capture)
    assert made[-1].calls == [("views", i) for i in range(L)] * runs, "the kernel did not store"
    assert_bits(ours, ref, "logits")
    assert_bits(made[-1].pages.data, ref_cache, "KV cache")
    assert all(blk.attn._qkv is not None for blk in model.blk), "the fused q/k/v did not run"


@interpreter
@pytest.mark.slow  # (a whole model's forwards in the interpreter: seconds each)
@pytest.mark.parametrize("dtype", ["fp32"])  # (bf16: the cuda test, exact; the interpreter
@pytest.mark.parametrize("family", FAMILIES)  # truncates bf16 casts, so only loose here)
def test_model_fused_kv_interpreted(family, dtype, monkeypatch):
    monkeypatch.setattr(fused, "enabled", lambda x: x.dtype in fused._DTYPES)  # kernels on cpu
    check_model_fused_kv(family, "cpu", DTYPES[dtype], monkeypatch, capture=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_model_fused_kv_cuda(family, dtype, monkeypatch):
    check_model_fused_kv(family, "cuda", DTYPES[dtype], monkeypatch, capture=True)


# ---- everywhere: the selection, the cpu path ---------------------------------------------------

def test_fused_kv_selection(monkeypatch):
    """On cuda with the fused kernels only; never on cpu or with fused.enabled off."""
    check_cuda_only(monkeypatch, layers._fused_kv_store)


def test_fused_kv_stays_off_cpu(monkeypatch):
    """cpu: the captured step's forward stores through StaticKV.store and calls no kernel, even
    with layers._fused_kv_store forced on (the layer asks it only where fused.enabled holds),
    with the logits of the step as it is."""
    def refuse(*args, **kwargs):
        raise AssertionError("fused.qk_rope was called on cpu")
    monkeypatch.setattr(fused, "qk_rope", refuse)
    model = make_model("qwen3_moe", "cpu", torch.float32)
    made = watch_static_kv(monkeypatch)
    ref = static_decode_logits(model, "cpu")
    monkeypatch.setattr(layers, "_fused_kv_store", lambda q: True)
    ours = static_decode_logits(model, "cpu")
    assert [name for name, _ in made[-1].calls].count("store") == model.config.num_layers
    assert_bits(ours, ref, "logits")
