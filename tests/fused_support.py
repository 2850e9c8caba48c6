"""What the fused kernels' tests share (test_fused_ops.py, test_fused_router.py,
test_fused_kv.py, test_split_attention.py): random inputs and rotary tables, the comparisons
within rounding, the check runner for the interpreter and cuda, tiny models of the three q/k
families (and glm4_moe's and minimax_m2's partial rotary, gpt_oss's sinks and window, the
deepseek families' MLA, ernie4_5_moe's interleaved rotary, hunyuan_v1_moe's q/k norm after the
rotary, granitemoe's multipliers, phimoe's LayerNorms, llama4_text's chunks and NoPE layer) with
dense torch experts, a captured decode step, and the
check of a cuda-only selection.
Not a test module itself.
"""
import pytest
import torch
import torch.nn.functional as F

from freetoken.config import ModelConfig, triton_interpreted
from freetoken.kv_cache import KVCache
from freetoken.loader import build_model
from freetoken.models import fused, model_class

INTERPRET = fused.available() and triton_interpreted()
interpreter = pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def rand(*shape, dtype, device, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def cos_sin(T, hd, dtype, device, seed=0):
    """Tables shaped and signed like Rotary.cos_sin: [T, 1, hd], the sin's first half negated."""
    g = torch.Generator().manual_seed(seed)
    ang = torch.rand(T, hd // 2, generator=g) * 50
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    sin = torch.cat((-sin[:, :hd // 2], sin[:, hd // 2:]), dim=-1)
    return cos[:, None].to(device), sin[:, None].to(device)


def assert_near(got, want, exact: bool, what: str):
    """exact: bit for bit. Otherwise within rounding: fp32 a few ulps; bf16 one rounding step
    on cuda, four under the interpreter (which truncates)."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    if exact:
        bad = (got != want).sum().item()
        assert bad == 0, f"{what}: {bad} of {got.numel()} differ, worst {worst(got, want)}"
        return
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6, msg=what)
        return
    steps = 4 if got.device.type == "cpu" else 1
    err = (got.float() - want.float()).abs()
    tol = steps * 2.0 ** -7 * want.float().abs().max()
    assert float(err.max()) <= tol, f"{what}: worst {worst(got, want)} > {float(tol)}"


def worst(got, want):
    err = (got.float() - want.float()).abs()
    i = int(err.flatten().argmax())
    return f"at flat {i}: {float(got.flatten()[i])} vs {float(want.flatten()[i])}"


DEVICES = [pytest.param("cpu", marks=interpreter), pytest.param("cuda", marks=pytest.mark.gpu)]


def _kernel_cells():
    """(dtype, device) for kernel_checks_test; bf16 in the interpreter is marked slow, out of
    the default run (the interpreter emulates bf16's casts slowly; cuda runs it exactly)."""
    for dtype in DTYPES:
        for device in DEVICES:
            (name,), marks = device.values, list(device.marks)
            if (dtype, name) == ("bf16", "cpu"):
                marks.append(pytest.mark.slow)
            yield pytest.param(dtype, name, marks=marks)


def kernel_checks_test(checks):
    """A test running each check(device, dtype) under the interpreter (cpu) and on cuda, for
    every dtype (test_fused_ops.py's checks, the router's, the KV store's, the attention's)."""
    @pytest.mark.parametrize("dtype, device", list(_kernel_cells()))
    @pytest.mark.parametrize("check", checks, ids=lambda c: c.__name__[6:])
    def test(check, dtype, device):
        assert fused.available(), "Triton does not import"
        check(device, DTYPES[dtype])
    return test


# ---- tiny models -------------------------------------------------------------------------------

FAMILIES = {  # the ways q/k come in: per-head norm, biases and no norm, full norm + clip, and
    # per-head norm with q/k/v/o biases (dots1, whose grouped sigmoid route is glm4_moe's block:
    # torch on every device, tests/test_glm4_moe.py)
    "qwen3_moe": dict(qk_norm="per_head"),
    "qwen2_moe": dict(attention_bias=True, shared_expert_intermediate_size=12,
                      shared_expert_gate=True),
    "olmoe": dict(qk_norm="full", clip_qkv=2.0),
    "dots1": dict(qk_norm="per_head", attention_bias=True, shared_expert_intermediate_size=12,
                  router_scoring="sigmoid", num_expert_groups=2, num_topk_groups=1,
                  routed_scaling_factor=2.5, norm_topk_prob=True),
}
# partial rotary (6 of 10 dims) and sigmoid grouped routing: the fused q/k norm + rotary and the
# fused router do not apply (tests/test_glm4_moe.py), so not in FAMILIES' kernel tests
PARTIAL_ROTARY_FAMILIES = {
    "glm4_moe": dict(qk_norm="per_head", attention_bias=True, partial_rotary_factor=0.6,
                     shared_expert_intermediate_size=12, router_scoring="sigmoid",
                     num_expert_groups=2, num_topk_groups=1, routed_scaling_factor=2.0,
                     norm_topk_prob=True),
    # q/k norm over the whole projection, sigmoid routing with a correction bias and no groups
    "minimax_m2": dict(qk_norm="full", partial_rotary_factor=0.6, router_scoring="sigmoid",
                       norm_topk_prob=True),
}
# rotary on interleaved pairs (ernie4_5_moe, its biased softmax route) and the q/k norm after
# the rotary (hunyuan_v1_moe): the fused q/k norm + rotary kernel does not apply
# (tests/test_ernie4_5_moe.py, tests/test_hunyuan_v1_moe.py)
OWN_QK_FAMILIES = {
    "ernie4_5_moe": dict(rope_interleaved=True, router_scoring="softmax_bias", moe_norm_min=1e-12,
                         shared_expert_intermediate_size=24, norm_topk_prob=True),
    "hunyuan_v1_moe": dict(qk_norm="per_head", qk_norm_after_rope=True,
                           shared_expert_intermediate_size=12, norm_topk_prob=True),
}
# granitemoe: its attention scale (not 1/sqrt(hd)) reaches every attention path, the embedding,
# residual and logit multipliers, the top-k softmax route in torch (tests/test_granitemoe.py)
SCALED_FAMILIES = {
    "granitemoe": dict(attention_multiplier=0.2, embedding_multiplier=1.5, residual_multiplier=0.7,
                       logits_scaling=1.8, router_scoring="softmax_of_topk"),
}
# phimoe: LayerNorms with biases (never the fused RMSNorm kernels), q/k/v/o and output head
# biases, the sparsemixer route in torch (tests/test_phimoe.py)
LAYER_NORM_FAMILIES = {
    "phimoe": dict(layer_norm=True, output_bias=True, attention_bias=True,
                   router_scoring="sparsemixer", router_jitter_noise=0.2),
}
# llama4_text: a chunked rotary layer (chunks of 3) with q/k L2-normed after interleaved rotary,
# then a layer without rotary whose q is scaled by the temperature; top-1 routing on the scaled
# input, a shared expert (tests/test_llama4_text.py)
LLAMA4_FAMILIES = {
    "llama4_text": dict(rope_interleaved=True, qk_l2_norm=True, no_rope_layers=(1,),
                        layer_types=("chunked_attention", "full_attention"), attention_chunk_size=3,
                        attn_temperature_tuning=True, floor_scale=2, attn_scale=0.5,
                        router_scoring="sigmoid_input", num_experts_per_tok=1,
                        shared_expert_intermediate_size=12),
}
# multi-head latent attention (6 heads of 6 + 8 rope dims, values of 10, a latent of 16): no
# q/k/v to fuse, no q/k rotary kernel, grouped routes (tests/test_deepseek.py)
_MLA = dict(num_kv_heads=6, head_dim=8, kv_lora_rank=16, qk_nope_head_dim=6, v_head_dim=10,
            rope_interleaved=True, num_expert_groups=2, num_topk_groups=1)
MLA_FAMILIES = {
    "deepseek_v3": dict(_MLA, q_lora_rank=12, shared_expert_intermediate_size=12,
                        router_scoring="sigmoid", routed_scaling_factor=2.5, norm_topk_prob=True),
    "deepseek_v2": dict(_MLA, shared_expert_intermediate_size=24, routed_scaling_factor=2.0),
}


# attention sinks, a sliding layer (window 3) then a full one, biases on q/k/v/o and the router:
# their attention takes layers.Attention's masked SDPA, never the split-K decode kernel
SINK_FAMILIES = {
    "gpt_oss": dict(attention_bias=True, layer_types=("sliding_attention", "full_attention"),
                    layer_window=3, attn_sinks=True, router_bias=True),
}


def tiny_config(family, **over):
    kw = dict(family=family, vocab_size=50, hidden_size=40, num_layers=2, num_heads=6,
              num_kv_heads=2, head_dim=10, rms_norm_eps=1e-6, rope_theta=1e4,
              max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=12, moe_layers=(1,), intermediate_size=24)
    kw.update({**FAMILIES, **PARTIAL_ROTARY_FAMILIES, **SINK_FAMILIES, **MLA_FAMILIES,
               **OWN_QK_FAMILIES, **SCALED_FAMILIES, **LAYER_NORM_FAMILIES, **LLAMA4_FAMILIES}[family])
    kw.update(over)
    return ModelConfig(**kw)


class DenseExperts:
    """Every routed expert computed densely in torch: the part of the expert runtime's contract
    a forward uses (begin_step, forward). identity: the layer's input comes back, no kernel."""

    def __init__(self, cfg, device, dtype, identity=False):
        g = torch.Generator().manual_seed(9)
        E, I, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.identity = identity
        self.w = {layer: [(torch.randn(E, *s, generator=g) * s[1] ** -0.5).to(device, dtype)
                          for s in ((I, D), (I, D), (D, I))] for layer in cfg.moe_layers}

    def begin_step(self, phase, num_tokens):
        pass

    def forward(self, layer, x, expert_ids, weights):
        if self.identity:
            return x
        gate, up, down = (w[expert_ids] for w in self.w[layer])  # [T, K, ...]
        h = F.silu(torch.einsum("tkid,td->tki", gate, x)) * torch.einsum("tkid,td->tki", up, x)
        y = torch.einsum("tkdi,tki->tkd", down, h)  # [T, K, D]
        return (y.float() * weights[..., None]).sum(1).to(x.dtype)


def make_model(family, device, dtype, identity=False, **over):
    cfg = tiny_config(family, **over)
    with torch.device("meta"):
        meta = model_class(family)(cfg, None)
    shapes = {n: p.shape for n, p in meta.named_parameters()}
    g = torch.Generator().manual_seed(1)
    tensors = {}
    for name, path in meta.canonical_names().items():
        shape = shapes[path]
        if name.endswith("norm.weight"):
            t = 1 + 0.3 * torch.randn(shape, generator=g)
        elif name == "token_embd.weight":
            t = torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) * 0.64 / shape[-1] ** 0.5
        tensors[name] = t
    return build_model(cfg, tensors, device, dtype, DenseExperts(cfg, device, dtype, identity))


def run_tokens(model, device, prefill=5, decode=3):
    """Logits [prefill + decode, V] fp32: one prefill forward, then one token per forward."""
    ids = torch.tensor([3, 17, 42, 8, 29, 11, 5, 40, 22][:prefill + decode], device=device)
    kv = KVCache(model.config, 16, device, model.token_embd.weight.dtype)
    with torch.inference_mode():
        rows = [model(ids[:prefill], torch.arange(prefill, device=device), kv)]
        for i in range(prefill, prefill + decode):
            rows.append(model(ids[i:i + 1], torch.arange(i, i + 1, device=device), kv))
    return torch.cat(rows)


def captured_step(model, tok, pos, static):
    """Logits of one decode step captured in a CUDA graph and replayed once (run inline first
    on the capture's side stream: lazy q/k/v concatenation, Triton compiles)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model(tok, pos, static, 1)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            out = model(tok, pos, static, 1)
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    return out


class FakeCuda:
    """What fused.enabled() reads of a tensor: a bf16 tensor on cuda."""
    is_cuda, dtype = True, torch.bfloat16


def check_cuda_only(monkeypatch, select):
    """A selection of a fused kernel (select(tensor) -> bool): yes for a cuda tensor exactly when
    Triton imports, never for a cpu tensor, never with fused.enabled patched off (how the tests
    take the torch path on cuda)."""
    assert select(FakeCuda()) == fused.available()
    assert not select(torch.zeros(1, 2, 4))  # cpu
    monkeypatch.setattr(fused, "enabled", lambda x: False)
    assert not select(FakeCuda())


def fused_path_equals_torch(family, device, dtype, monkeypatch, force_on_cpu, refused, why):
    """The family's fused path (cuda, or Triton's interpreter on cpu: force_on_cpu) equals its
    torch path, eager and as the StaticKV decode step (captured in a CUDA graph on cuda), while
    the kernels `refused` ((module, name) pairs) never run: they would compute something else
    for this family (why: the assertion's message)."""
    from test_split_attention import assert_logits_near, static_decode_logits

    def refuse(*args, **kwargs):
        raise AssertionError(why)

    model = make_model(family, device, dtype)
    enabled = fused.enabled
    monkeypatch.setattr(fused, "enabled", lambda x: False)  # the torch path: the reference
    ref = run_tokens(model, device)
    ref_step = static_decode_logits(model, device).clone()
    monkeypatch.setattr(fused, "enabled", enabled)
    if force_on_cpu:  # the interpreter runs the kernels on cpu tensors
        monkeypatch.setattr(fused, "enabled", lambda x: x.dtype in fused._DTYPES)
    for module, name in refused:
        monkeypatch.setattr(module, name, refuse)
    ours = run_tokens(model, device)
    assert all(blk.attn._qkv is not None for blk in model.blk), "the fused q/k/v did not run"
    assert_logits_near(ours, ref, dtype)
    assert_logits_near(static_decode_logits(model, device, capture=not force_on_cpu), ref_step, dtype)
    return model
