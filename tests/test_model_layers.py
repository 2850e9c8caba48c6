"""Model building blocks without an FTW file: rope scalings and RMSNorm against the transformers
functions (test-only oracle), the attention mask, the KV cache, and the loader's strictness."""
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from freetoken.config import ModelConfig
from freetoken.errors import ModelError
from freetoken.kv_cache import KVCache
from freetoken.loader import build_model
from freetoken.models import model_class
from freetoken.models.layers import RMSNorm, attention_mask
from freetoken.models.rope import rope_inv_freq


def tiny_config(**over) -> ModelConfig:
    kw = dict(family="qwen3_moe", vocab_size=40, hidden_size=32, num_layers=2, num_heads=4,
              num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
              max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=8, moe_layers=(1,), intermediate_size=24, qk_norm="per_head")
    kw.update(over)
    return ModelConfig(**kw)


ROPES = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "mscale": 0.7,
     "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: r["rope_type"])
@pytest.mark.parametrize("seq_len", [10, 200])
def test_rope_scalings_match_transformers(rope, seq_len):
    cfg = tiny_config(rope_theta=5e5, rope_scaling=dict(rope), head_dim=32)
    hf = transformers.Qwen3MoeConfig(hidden_size=64, num_attention_heads=2, head_dim=32,
                                     max_position_embeddings=64,
                                     rope_parameters=dict(rope, rope_theta=5e5))
    want_freq, want_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu", seq_len=seq_len)
    got_freq, got_scale = rope_inv_freq(cfg, seq_len)
    torch.testing.assert_close(got_freq, want_freq.float(), rtol=1e-6, atol=0)
    assert got_scale == pytest.approx(want_scale, rel=1e-12)


def test_unknown_rope_scaling_is_a_model_error():
    with pytest.raises(ModelError, match="longrope"):
        rope_inv_freq(tiny_config(rope_scaling={"rope_type": "longrope"}), 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_bitwise_equals_transformers(dtype):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 48, generator=gen) * 3).to(dtype)
    w = (torch.rand(48, generator=gen) + 0.5).to(dtype)
    ours, theirs = RMSNorm(48, 1e-5).to(dtype), Qwen3MoeRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(w)
        theirs.weight.copy_(w)
        assert torch.equal(ours(x), theirs(x))


def test_attention_mask_chunk_and_window():
    # a chunk of 3 tokens at slots 2..4: sees slots 0..2, 0..3, 0..4
    m = attention_mask(2, 3, None, "cpu")
    assert m.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    # window 2: each token sees itself and one earlier token
    m = attention_mask(2, 3, 2, "cpu")
    assert m.tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    assert attention_mask(5, 1, None, "cpu") is None
    assert attention_mask(0, 4, None, "cpu") == "causal" == attention_mask(0, 4, 4, "cpu")
    assert attention_mask(0, 4, 3, "cpu").tolist()[3] == [0, 1, 1, 1]
    assert attention_mask(5, 1, 3, "cpu").tolist() == [[0, 0, 0, 1, 1, 1]]


def test_kv_cache_slots_and_full_context():
    cfg = tiny_config()
    kv = KVCache(cfg, 5, "cpu", torch.float32)
    k = torch.randn(3, cfg.num_kv_heads, cfg.head_dim)
    start = kv.reserve(3)
    keys, values = kv.store(1, start, k, -k)
    assert keys.shape == (cfg.num_kv_heads, 3, cfg.head_dim)
    assert torch.equal(keys.transpose(0, 1), k) and torch.equal(values.transpose(0, 1), -k)
    kv.commit(3)
    assert (kv.num_tokens, kv.num_free) == (3, 2)
    with pytest.raises(ModelError, match="context is full.*--ctx-size"):
        kv.reserve(3)
    keys, _ = kv.store(1, kv.reserve(2), k[:2] + 1, k[:2])
    assert torch.equal(keys[:, :3].transpose(0, 1), k) and keys.shape[1] == 5
    kv.truncate(0)
    assert kv.num_tokens == 0 and kv.reserve(5) == 0


def random_tensors(cfg, seed=0):
    """{canonical name: random tensor} with exactly the shapes the model expects."""
    with torch.device("meta"):
        model = model_class(cfg.family)(cfg, None)
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(params[path].shape, generator=gen)
            for name, path in model.canonical_names().items()}


def test_canonical_names_follow_interfaces():
    names = set(random_tensors(tiny_config(tie_word_embeddings=True)))
    assert {"token_embd.weight", "output_norm.weight", "blk.0.attn_q.weight",
            "blk.0.attn_q_norm.weight", "blk.0.ffn_gate.weight", "blk.1.ffn_gate_inp.weight",
            "blk.1.ffn_norm.weight"} <= names
    assert "output.weight" not in names and "blk.1.ffn_up.weight" not in names
    qwen2 = set(random_tensors(tiny_config(family="qwen2_moe", qk_norm="none", attention_bias=True,
                                           shared_expert_intermediate_size=12,
                                           shared_expert_gate=True)))
    assert {"blk.1.attn_q.bias", "blk.1.ffn_gate_inp_shexp.weight", "blk.1.ffn_down_shexp.weight",
            "output.weight"} <= qwen2
    assert "blk.1.attn_output.bias" not in qwen2  # qwen2_moe: q/k/v biases only
    assert "blk.1.attn_output.bias" in set(random_tensors(tiny_config(attention_bias=True)))


def test_loader_is_strict():
    cfg = tiny_config()
    good = random_tensors(cfg)
    model = build_model(cfg, good, "cpu", "fp32", None)
    assert torch.equal(model.blk[0].attn.attn_q.weight, good["blk.0.attn_q.weight"])
    missing = dict(good)
    del missing["blk.1.ffn_gate_inp.weight"]
    with pytest.raises(ModelError, match="missing blk.1.ffn_gate_inp.weight"):
        build_model(cfg, missing, "cpu", "fp32", None)
    with pytest.raises(ModelError, match="unexpected blk.0.ffn_gate_inp.weight"):
        build_model(cfg, dict(good, **{"blk.0.ffn_gate_inp.weight": torch.zeros(4, 32)}),
                    "cpu", "fp32", None)
    with pytest.raises(ModelError, match=r"attn_k.weight has shape \(16, 32\).*needs \(32, 32\)"):
        build_model(cfg, dict(good, **{"blk.0.attn_k.weight": torch.zeros(16, 32)}),
                    "cpu", "fp32", None)
    with pytest.raises(ModelError, match="dtype torch.int32"):
        build_model(cfg, dict(good, **{"output_norm.weight": torch.zeros(32, dtype=torch.int32)}),
                    "cpu", "fp32", None)
    with pytest.raises(ModelError, match="family 'llama' is not supported"):
        build_model(tiny_config(family="llama"), good, "cpu", "fp32", None)


def test_loader_casts_and_copies():
    cfg = tiny_config()
    good = {k: v.to(torch.bfloat16) for k, v in random_tensors(cfg).items()}
    model = build_model(cfg, good, "cpu", torch.float32, None)
    w = model.blk[1].ffn.ffn_gate_inp.weight
    assert w.dtype == torch.float32 and not w.requires_grad
    assert w.data_ptr() != good["blk.1.ffn_gate_inp.weight"].data_ptr()


@pytest.mark.parametrize("over, what", [
    (dict(num_kv_heads=3), "not a multiple of num_kv_heads"),
    (dict(head_dim=15), "head_dim 15 is odd"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok 5"),
    (dict(moe_layers=(2,)), r"moe_layers \[2\]"),
    (dict(hidden_act="gelu"), "only silu"),
])
def test_unrunnable_config_is_a_model_error(over, what):
    with pytest.raises(ModelError, match=what):
        build_model(tiny_config(**over), {}, "cpu", "fp32", None)
