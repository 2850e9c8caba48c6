"""granitemoe (Granite 3.x MoE) beyond the oracle tests: convert from the hub layout (experts
fused as `input_linear` / `output_linear`, router `router.layer`) and from transformers' in-memory
save (`experts.gate_up_proj` / `down_proj`, `router.weight`), bitwise; the four multipliers read
(GraniteMoeConfig's 1.0 when absent) and bad ones refused; the route (top-k logits, softmax over
those k, rounded to the hidden dtype); each multiplier moves the output; the cuda path (under
Triton's interpreter here) with its attention scale equals the torch path."""
import json
import re

import pytest
import torch

from convert_support import assert_tensors_landed, hf_tensors
import ftw
import make_tiny_model as mtm
from freetoken.config import ModelConfig
from freetoken.experts.reference import DenseReferenceExperts
from freetoken.kv_cache import KVCache
from freetoken.loader import load_model
from freetoken.models.granitemoe import GraniteMoeBlock
from ftw.convert import convert
from ftw.errors import ConvertError

# Independent oracle: HF suffix after `model.layers.{i}.` -> FTW suffix (non-expert tensors).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
    "block_sparse_moe.router.layer.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.router.weight": "ffn_gate_inp.weight",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
MULTIPLIERS = {"attention_multiplier": 0.2, "embedding_multiplier": 1.5, "residual_multiplier": 0.7,
               "logits_scaling": 1.8}


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_round_trip_every_layout(tmp_path, layout):
    """Every source tensor lands bitwise under its FTW name (bf16 source, q/k/v/o biases)."""
    src = mtm.build(tmp_path / "hf", "granitemoe", layout=layout, dtype="bf16", attention_bias=True)
    out = convert(src, tmp_path / "m.ftw", threads=2)
    hf = hf_tensors(src)
    hub = "model.layers.0.block_sparse_moe.input_linear.weight"
    assert (hub in hf) == (layout == "per_expert")
    with ftw.open(out, verify=True) as f:
        assert f.config["family"] == "granitemoe" and f.config["source_dtype"] == "bf16"
        experts = assert_tensors_landed(f, hf, set(), LAYER_NAMES, GLOBAL_NAMES)
        assert len(experts) == 3 * 8 * 3  # every layer sparse
        assert f.metadata["source.ignored_tensors"] == []


def test_config_fields(tmp_path):
    src = mtm.build(tmp_path / "hf", "granitemoe", config_style="legacy")
    legacy = json.loads((src / "config.json").read_text())
    assert "head_dim" not in legacy and legacy["num_local_experts"] == 8
    with ftw.open(convert(src, tmp_path / "m.ftw")) as f:
        c = f.config
    assert {k: c[k] for k in MULTIPLIERS} == MULTIPLIERS
    assert (c["router_scoring"], c["moe_layers"], c["moe_intermediate_size"]) == ("softmax_of_topk", [0, 1, 2], 48)
    assert (c["head_dim"], c["qk_norm"], c["shared_expert_intermediate_size"]) == (16, "none", 0)


def test_multipliers_default_to_one(tmp_path):
    """GraniteMoeConfig's defaults: every multiplier 1.0 (an attention scale of 1, not 1/sqrt(hd))."""
    src = mtm.build(tmp_path / "hf", "granitemoe", config_style="legacy")
    cfg = json.loads((src / "config.json").read_text())
    for key in MULTIPLIERS:
        cfg.pop(key)
    (src / "config.json").write_text(json.dumps(cfg))
    with ftw.open(convert(src, tmp_path / "m.ftw")) as f:
        assert {k: f.config[k] for k in MULTIPLIERS} == dict.fromkeys(MULTIPLIERS, 1.0)


@pytest.mark.parametrize("key, value", [("logits_scaling", 0), ("residual_multiplier", -0.5),
                                        ("attention_multiplier", "0.1"), ("embedding_multiplier", None)])
def test_bad_multipliers_are_refused(tmp_path, key, value):
    src = mtm.build(tmp_path / "hf", "granitemoe", layout="fused", config_style="legacy")
    cfg = json.loads((src / "config.json").read_text())
    cfg[key] = value
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConvertError, match=re.escape(f"{key} is {value!r}")):
        convert(src, tmp_path / "m.ftw")


def test_route_rounds_the_top_k_softmax_to_the_hidden_dtype():
    """Example: logits [1, 3, 2, 0], k=2 takes experts 1 and 2, weights softmax([3, 2]) =
    [.731, .269], then as bf16 holds them."""
    block = GraniteMoeBlock(ModelConfig(
        family="granitemoe", vocab_size=8, hidden_size=4, num_layers=1, num_heads=1, num_kv_heads=1,
        head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=8, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=4))
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    ids, w = block.route(logits)
    assert ids.tolist() == [[1, 2]] and w.dtype == torch.float32
    want = torch.softmax(torch.tensor([3.0, 2.0]), dim=-1)
    torch.testing.assert_close(w[0], want)
    _, w16 = block.route(logits.bfloat16())
    assert torch.equal(w16[0], want.bfloat16().float()) and not torch.equal(w16[0], want)


@pytest.mark.parametrize("key", sorted(MULTIPLIERS))
def test_each_multiplier_moves_the_output(tmp_path, key):
    """Each multiplier of the tiny model, set to 1 instead, moves the output beyond the oracle
    tests' 1e-4: a loader or model that dropped one would fail them."""
    f = ftw.open(convert(mtm.build(tmp_path / "hf", "granitemoe"), tmp_path / "m.ftw"))

    def run(config_dict):
        config = ModelConfig.from_dict(config_dict)
        experts = DenseReferenceExperts(f.load_banks(), config, "cpu", torch.float32)
        model = load_model(f, config, "cpu", torch.float32, experts)
        with torch.no_grad():
            return model(torch.arange(3, 19), torch.arange(16), KVCache(config, 16, "cpu", torch.float32))

    with f:
        assert (run({**f.config, key: 1.0}) - run(f.config)).abs().max() > 1e-2
