"""The captured decode step's split-K attention (freetoken/models/split_attention.py) against an
fp64 softmax(q k^T) v over the attended slots (every other slot NaN), again for a new position
on the same launch, and inside the model's captured-step forward against SDPA; layers.py takes
it on cuda (layers._triton_decode_attention), and only in the captured step.

interpreter: the Triton kernels on cpu tensors under TRITON_INTERPRET=1 (tests/conftest.py sets it
  without CUDA; skipped where Triton does not import); bf16 is compared within a step more there (the interpreter truncates).
gpu: the same on cuda, a replayed graph with pos changed, the model's captured step.
"""
import pytest
import torch

from freetoken.kv_cache import KVCache
from freetoken.models import fused, split_attention

from fused_support import (DTYPES, captured_step, check_cuda_only, interpreter,
                           kernel_checks_test, make_model, rand, worst)


# ---- decode attention: split-K over the slots the new token attends to ---------------------------

def ref_decode_attention(q, k_cache, v_cache, pos: int, scale: float, window=None):
    """softmax(q k^T * scale) v over slots [lo, pos], query head h on kv head h // G, in fp64
    (the fp32 answer to well below fp32's rounding) -> [1, H * hd] fp64."""
    lo = 0 if window is None else max(pos - window + 1, 0)
    _, H, hd = q.shape
    G = H // k_cache.shape[0]
    k = k_cache[:, lo:pos + 1].double().repeat_interleave(G, dim=0)  # [H, n, hd]
    v = v_cache[:, lo:pos + 1].double().repeat_interleave(G, dim=0)
    w = torch.softmax(torch.einsum("hd,hnd->hn", q[0].double(), k) * scale, dim=-1)
    return torch.einsum("hn,hnd->hd", w, v).reshape(1, H * hd)


def assert_attention(got, want, dtype, what):
    """fp32: within 1e-5 of the largest output. bf16: the fp64 answer rounded once (half a
    step, a whole one under the interpreter, which truncates), give or take 2e-5 of the largest
    output (the kernel's weights p keep ~16 bits in their two bf16 halves)."""
    assert got.shape == want.shape and got.dtype == dtype, (what, got.shape, got.dtype)
    assert not got.isnan().any(), f"{what}: NaN in the output"
    err, top = (got.double() - want).abs(), float(want.abs().max())
    if dtype == torch.float32:
        tol = 1e-5 * top
    else:
        step = 2.0 ** -7 if got.device.type == "cpu" else 2.0 ** -8
        tol = step * want.abs() + 2e-5 * top
    bad = err > tol
    assert not bad.any(), f"{what}: {int(bad.sum())} of {got.numel()} off, {worst(got, want)}"


def decode_cache(KV, slots, hd, dtype, device, seed):
    """Keys and values as StaticKV.store sees them: the [KV, slots, hd] halves of a layer's
    [2, KV, slots, hd] block (views with the cache's strides)."""
    kv = rand(2, KV, slots, hd, dtype=dtype, device=device, seed=seed)
    return kv[0], kv[1]


def garbage_outside(cache, lo: int, pos: int):
    """NaN in every slot the token must not read: before lo, after pos, past the span."""
    cache[:, :lo] = float("nan")
    cache[:, pos + 1:] = float("nan")


DECODE_CASES = [  # (H, KV, hd, span, pos, sliding_window, chunk); chunk None: decode_chunk's
    (8, 8, 64, 256, 0, None, None),  # G = 1, the first slot
    (32, 4, 128, 256, 255, None, None),  # G = 8, the span's last slot
    (16, 4, 64, 512, 200, None, None),  # G = 4, the middle
    (16, 4, 128, 512, 256, None, None),  # the first slot of a chunk
    (16, 4, 128, 512, 255, None, None),  # the last slot of a chunk
    (16, 1, 64, 256, 100, None, None),  # G = 16
    (12, 2, 64, 256, 130, None, None),  # G = 6, padded to 16 query rows
    (8, 1, 128, 1024, 700, 100, None),  # a window that cuts: slots 601..700
    (8, 2, 64, 256, 200, 4096, None),  # a window that does not
    (8, 2, 64, 256, 77, 1, None),  # a window of one: the token itself
    (8, 2, 128, 512, 300, 200, 128),  # two tiles per chunk: the first skipped, the last cut
    (8, 2, 64, 256, 250, None, 16),  # 16 slots per chunk (one partial tile each)
    (6, 2, 96, 100, 99, None, None),  # hd and span not powers of two
]


def check_decode_attention(device, dtype):
    for i, (H, KV, hd, span, pos, window, chunk) in enumerate(DECODE_CASES):
        q = rand(1, H, hd, dtype=dtype, device=device, scale=2.0, seed=i)
        k, v = decode_cache(KV, span + 32, hd, dtype, device, seed=50 + i)
        want = ref_decode_attention(q, k, v, pos, hd ** -0.5, window)
        lo = 0 if window is None else max(pos - window + 1, 0)
        garbage_outside(k, lo, pos)
        garbage_outside(v, lo, pos)
        p = torch.tensor([pos], device=device)
        got = split_attention.decode_attention(q, k, v, p, span, hd ** -0.5, window, chunk=chunk)
        assert_attention(got, want, dtype, f"case {i}: H={H} KV={KV} hd={hd} span={span} "
                                           f"pos={pos} window={window} chunk={chunk}")


def check_decode_attention_new_pos(device, dtype):
    """One launch serves every position: run again (or, on cuda, a captured graph replayed)
    with only the device's pos changed gives each position's answer."""
    H, KV, hd, span, window = 16, 2, 128, 512, 300
    q = rand(1, H, hd, dtype=dtype, device=device, seed=3)
    k, v = decode_cache(KV, span, hd, dtype, device, seed=4)
    pos = torch.zeros(1, dtype=torch.int64, device=device)

    def launch():
        return split_attention.decode_attention(q, k, v, pos, span, hd ** -0.5, window)
    if device == "cuda":
        launch()  # compiles outside the capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                out = launch()
        torch.cuda.current_stream().wait_stream(side)
    for p in (0, 63, 64, 299, 300, 400, span - 1, 5):
        pos.fill_(p)
        if device == "cuda":
            graph.replay()
            torch.cuda.synchronize()
        else:
            out = launch()
        want = ref_decode_attention(q, k, v, p, hd ** -0.5, window)
        assert_attention(out, want, dtype, f"pos {p}")


PAGED_CASES = [  # (H, KV, hd, span, pos, sliding_window, chunk, page size)
    (16, 4, 64, 256, 200, None, None, 16),  # a page of 16: four per tile
    (8, 2, 128, 512, 300, 200, 128, 64),  # a page per tile, a window that cuts
    (6, 2, 96, 100, 99, None, None, 7),  # pages that straddle tiles and chunks
    (8, 1, 64, 256, 63, None, 16, 64),  # the last slot of the first page
]


def paged_cache(k, page_size: int, seed: int):
    """k [KV, span, hd] (positions) as pages in a shuffled storage: (storage [KV, slots, hd],
    page_table [pages] int64) with position s at row page_table[s // P] * P + s % P; the
    storage's other pages (twice as many) NaN."""
    KV, span, hd = k.shape
    num_pages = -(-span // page_size)
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(3 * num_pages, generator=g)[:num_pages]
    storage = torch.full((KV, 3 * num_pages * page_size, hd), float("nan"), dtype=k.dtype,
                         device=k.device)
    rows = (table[:, None] * page_size + torch.arange(page_size)).flatten()[:span]
    storage[:, rows.to(k.device)] = k
    return storage, table.to(k.device)


def check_decode_attention_paged(device, dtype):
    """Through a page table (kv_cache.py's layout): the answer of the same keys and values
    stored in position order."""
    for i, (H, KV, hd, span, pos, window, chunk, P) in enumerate(PAGED_CASES):
        q = rand(1, H, hd, dtype=dtype, device=device, scale=2.0, seed=i)
        k, v = decode_cache(KV, span, hd, dtype, device, seed=70 + i)
        want = ref_decode_attention(q, k, v, pos, hd ** -0.5, window)
        lo = 0 if window is None else max(pos - window + 1, 0)
        garbage_outside(k, lo, pos)
        garbage_outside(v, lo, pos)
        (ks, table), (vs, _) = paged_cache(k, P, seed=i), paged_cache(v, P, seed=i)
        p = torch.tensor([pos], device=device)
        got = split_attention.decode_attention(q, ks, vs, p, span, hd ** -0.5, window,
                                               chunk=chunk, pages=(table, P))
        assert_attention(got, want, dtype, f"paged case {i}: span={span} pos={pos} P={P}")


DECODE_CHECKS = [check_decode_attention, check_decode_attention_new_pos,
                 check_decode_attention_paged]


test_decode_attention = kernel_checks_test(DECODE_CHECKS)


@pytest.mark.skipif(not fused.available(), reason="needs Triton")
def test_decode_chunk():
    assert split_attention.decode_chunk(256, 4) == split_attention.DECODE_BLOCK_N
    for span in (256, 4096, 32768, 1 << 20):
        chunk = split_attention.decode_chunk(span, 4)
        assert chunk & (chunk - 1) == 0 and split_attention.DECODE_BLOCK_N <= chunk <= 1024
        assert 4 * -(-span // chunk) <= split_attention.DECODE_PROGRAMS or chunk == 1024


def test_decode_attention_selection(monkeypatch):
    """decode_attention on cuda with the fused kernels only; never on cpu or with fused.enabled
    off."""
    from freetoken.models import layers
    check_cuda_only(monkeypatch, layers._triton_decode_attention)


# ---- the model's captured decode step with decode_attention ----------------------------------

def static_decode_logits(model, device, span=32, prefill=12, capture=False):
    """Logits [1, V] of one decode step through StaticKV (the captured step's forward) after a
    prefill of `prefill` tokens; capture: inside a CUDA graph, replayed once."""
    from freetoken.graphs import StaticKV
    ids = torch.arange(prefill + 1, device=device) * 7 % 50
    kv = KVCache(model.config, 64, device, model.token_embd.weight.dtype)
    with torch.inference_mode():
        model(ids[:prefill], torch.arange(prefill, device=device), kv)
        tok, pos = ids[prefill:].clone(), torch.tensor([prefill], device=device)
        static = StaticKV(kv, pos, span, model.config.sliding_window)
        if not capture:
            return model(tok, pos, static, 1)
        return captured_step(model, tok, pos, static)


def assert_logits_near(ours, ref, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    else:  # bf16 roundings that differ by a step propagate through the layers
        assert float((ours - ref).abs().max()) <= 0.05 * float(ref.abs().max())


WINDOWS = {"no_window": None, "window_5": 5}  # 5 cuts the 13 cached tokens


@interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", WINDOWS)
def test_model_decode_attention_interpreted(window, dtype, monkeypatch):
    """The captured step's forward with decode_attention (the only kernel: layers' selection
    forced on cpu) against its SDPA path; head_dim 10 and G = 3 are padded in the kernel."""
    from freetoken.models import layers
    dt = DTYPES[dtype]
    model = make_model("qwen3_moe", "cpu", dt, sliding_window=WINDOWS[window])
    ref = static_decode_logits(model, "cpu")
    calls = []
    real = split_attention.decode_attention

    def counted(*args, **kwargs):
        calls.append(args[3:])  # pos, span, scale, window
        return real(*args, **kwargs)
    monkeypatch.setattr(split_attention, "decode_attention", counted)
    monkeypatch.setattr(layers, "_triton_decode_attention", lambda q: True)
    ours = static_decode_logits(model, "cpu")
    assert len(calls) == model.config.num_layers
    assert [(int(p), span, w) for p, span, _, w in calls[:1]] == [(12, 32, WINDOWS[window])]
    assert_logits_near(ours, ref, dt)


@pytest.mark.parametrize("window", WINDOWS)
def test_decode_attention_stays_off_cpu_and_eager_steps(window, monkeypatch):
    """cpu: the captured step's forward keeps SDPA; and
    an eager decode step whose window needs a mask (an int start, not StaticKV's pos) never
    takes the kernel even where the selection says yes."""
    from freetoken.models import layers

    def refuse(*args, **kwargs):
        raise AssertionError("decode_attention was called")
    monkeypatch.setattr(split_attention, "decode_attention", refuse)
    model = make_model("qwen3_moe", "cpu", torch.float32, sliding_window=WINDOWS[window])
    static = static_decode_logits(model, "cpu")
    monkeypatch.setattr(layers, "_triton_decode_attention", lambda q: True)
    ids = torch.arange(13) * 7 % 50
    kv = KVCache(model.config, 64, "cpu", torch.float32)
    with torch.inference_mode():
        model(ids[:12], torch.arange(12), kv)
        eager = model(ids[12:], torch.tensor([12]), kv)
    torch.testing.assert_close(eager, static, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", WINDOWS)
def test_model_decode_attention_cuda(window, dtype, monkeypatch):
    """The path on cuda: the captured step, replayed, against the same step's forward with
    layers._triton_decode_attention patched off (SDPA over the masked span)."""
    from freetoken.models import layers
    dt = DTYPES[dtype]
    model = make_model("qwen3_moe", "cuda", dt, sliding_window=WINDOWS[window])
    selection = layers._triton_decode_attention
    monkeypatch.setattr(layers, "_triton_decode_attention", lambda q: False)
    ref = static_decode_logits(model, "cuda")
    monkeypatch.setattr(layers, "_triton_decode_attention", selection)
    calls = []
    real = split_attention.decode_attention
    monkeypatch.setattr(split_attention, "decode_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    ours = static_decode_logits(model, "cuda", capture=True)
    assert calls, "decode_attention was not taken"
    assert_logits_near(ours, ref, dt)
