"""tools/make_tiny_model.py: every family x layout builds, reloads in transformers, has the
expected tensor names; legacy configs, shards, tokenizer and chat template work."""
import json
import re

import pytest

import torch
import transformers
from safetensors import safe_open  # noqa: E402

import make_tiny_model as mtm  # noqa: E402

PER_EXPERT = {
    "qwen3_moe": r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight",
    "qwen2_moe": r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight",
    "olmoe": r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight",
    "mixtral": r"model\.layers\.\d+\.block_sparse_moe\.experts\.\d+\.w[123]\.weight",
    "qwen3_next": r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight",
    "qwen3_5_moe_text": r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight",
    "glm4_moe": r"model\.layers\.[0-2]\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight",  # 3: MTP
    "deepseek_v3": r"model\.layers\.[0-2]\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight",  # 3: MTP
    "deepseek_v2": r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight",
    "dots1": r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight",
    "ernie4_5_moe": r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight",
    "hunyuan_v1_moe": r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight",
    "minimax_m2": r"model\.layers\.\d+\.block_sparse_moe\.experts\.\d+\.w[123]\.weight",
    "phimoe": r"model\.layers\.\d+\.block_sparse_moe\.experts\.\d+\.w[123]\.weight",
}
ROUTER = {"mixtral": "model.layers.{i}.block_sparse_moe.gate.weight",
          "hunyuan_v1_moe": "model.layers.{i}.mlp.gate.wg.weight",
          "minimax_m2": "model.layers.{i}.block_sparse_moe.gate.weight",
          "phimoe": "model.layers.{i}.block_sparse_moe.gate.weight"}
W123 = ("mixtral", "minimax_m2", "phimoe")  # per-expert w1 (gate), w3 (up), w2 (down)


def tensor_shapes(path):
    shapes = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                shapes[k] = tuple(s.get_slice(k).get_shape())
    return shapes


def load_logits(path):
    model = mtm.load_hf(path, dtype=torch.float32)
    ids = torch.arange(3, 19).unsqueeze(0)
    with torch.no_grad():
        return model, model(ids).logits


@pytest.mark.parametrize("family", mtm.FAMILIES)
@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_build_names_and_reload(tmp_path, family, layout):
    path = mtm.build(tmp_path / "m", family, layout=layout, dtype="bf16")
    shapes = tensor_shapes(path)
    cfg = mtm.DEFAULTS[family]
    E, D = cfg["num_experts"], cfg["hidden_size"]
    I = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    moe_layers = range(cfg.get("first_k_dense_replace", cfg.get("moe_layer_start_index", 0)),
                       cfg["num_hidden_layers"])
    if family in mtm.VLM:  # the VLM checkpoint: its text model under model.language_model.
        assert any(k.startswith("model.visual.") for k in shapes) and "lm_head.weight" in shapes
        assert not any(k.startswith("model.layers.") for k in shapes)
        shapes = {re.sub(r"^model\.language_model\.", "model.", k): v for k, v in shapes.items()}
    if family in mtm.VLM and layout == "per_expert":  # the hub's fused [E, in, out], gate then up
        for i in moe_layers:
            assert shapes[f"model.layers.{i}.mlp.experts.gate_up_proj"] == (E, D, 2 * I)
            assert shapes[f"model.layers.{i}.mlp.experts.down_proj"] == (E, I, D)
        assert shapes["model.layers.0.self_attn.o_proj.bias"] == (D,)
    elif family == "gpt_oss":  # fused [E, in, out] (gate/up interleaved) and biases in every layout
        for i in moe_layers:
            assert shapes[f"model.layers.{i}.mlp.experts.gate_up_proj"] == (E, D, 2 * I)
            assert shapes[f"model.layers.{i}.mlp.experts.gate_up_proj_bias"] == (E, 2 * I)
            assert shapes[f"model.layers.{i}.mlp.experts.down_proj"] == (E, I, D)
            assert shapes[f"model.layers.{i}.mlp.experts.down_proj_bias"] == (E, D)
            assert shapes[f"model.layers.{i}.mlp.router.bias"] == (E,)
            assert shapes[f"model.layers.{i}.self_attn.sinks"] == (4,)
            assert shapes[f"model.layers.{i}.self_attn.o_proj.bias"] == (D,)
    elif family == "llama4_text":  # fused [E, in, out] in every layout (gate then up), MoE in
        # layers 1 and 3 beside a shared expert, dense MLPs 112 wide in 0 and 2
        for i in (1, 3):
            assert shapes[f"model.layers.{i}.feed_forward.experts.gate_up_proj"] == (E, D, 2 * I)
            assert shapes[f"model.layers.{i}.feed_forward.experts.down_proj"] == (E, I, D)
            assert shapes[f"model.layers.{i}.feed_forward.router.weight"] == (E, D)
            assert shapes[f"model.layers.{i}.feed_forward.shared_expert.up_proj.weight"] == (I, D)
        assert shapes["model.layers.2.feed_forward.gate_proj.weight"] == (112, D)
    elif family == "granitemoe":  # fused in every layout: the hub's input/output_linear, or
        # transformers 5's names, all under block_sparse_moe.
        hub = layout == "per_expert"
        gate_up, down, router = (("input_linear.weight", "output_linear.weight", "router.layer.weight")
                                 if hub else ("experts.gate_up_proj", "experts.down_proj", "router.weight"))
        for i in moe_layers:
            assert shapes[f"model.layers.{i}.block_sparse_moe.{gate_up}"] == (E, 2 * I, D)
            assert shapes[f"model.layers.{i}.block_sparse_moe.{down}"] == (E, D, I)
            assert shapes[f"model.layers.{i}.block_sparse_moe.{router}"] == (E, D)
    elif layout == "per_expert":
        experts = [k for k in shapes if re.fullmatch(PER_EXPERT[family], k)]
        assert len(experts) == len(moe_layers) * E * 3
        assert not any(k.endswith("gate_up_proj") for k in shapes)
        router = ROUTER.get(family, "model.layers.{i}.mlp.gate.weight").format(i=moe_layers[0])
        w1 = "w1" if family in W123 else "gate_proj"
        assert shapes[router] == (E, D)
        assert shapes[f"{router.split('.gate.')[0]}.experts.3.{w1}.weight"] == (I, D)
    else:
        for i in moe_layers:
            assert shapes[f"model.layers.{i}.mlp.experts.gate_up_proj"] == (E, 2 * I, D)
            assert shapes[f"model.layers.{i}.mlp.experts.down_proj"] == (E, D, I)
            router = {"hunyuan_v1_moe": "gate.wg", "phimoe": "router"}.get(family, "gate")
            assert shapes[f"model.layers.{i}.mlp.{router}.weight"] == (E, D)
        assert not any(".experts.0." in k for k in shapes)
    if family == "qwen2_moe":
        assert shapes["model.layers.0.mlp.shared_expert_gate.weight"] == (1, D)
        assert "model.layers.0.self_attn.q_proj.bias" in shapes
    if family == "olmoe":
        assert shapes["model.layers.0.self_attn.q_norm.weight"] == (4 * 16,)
    if family == "qwen3_moe":
        assert shapes["model.layers.0.self_attn.q_norm.weight"] == (16,)
    if family == "glm4_moe":  # layer 0 dense; correction bias, 2 shared experts, q bias, q norm
        assert shapes["model.layers.0.mlp.gate_proj.weight"] == (112, D)
        assert shapes["model.layers.1.mlp.gate.e_score_correction_bias"] == (E,)
        assert shapes["model.layers.1.mlp.shared_experts.up_proj.weight"] == (2 * I, D)
        assert shapes["model.layers.0.self_attn.q_proj.bias"] == (4 * 16,)
        assert shapes["model.layers.0.self_attn.q_norm.weight"] == (16,)
        assert ("model.layers.3.eh_proj.weight" in shapes) == (layout == "per_expert")  # MTP
    if family == "dots1":  # layer 0 dense; correction bias, 2 shared experts, q/o bias, q norm
        assert shapes["model.layers.0.mlp.gate_proj.weight"] == (112, D)
        assert shapes["model.layers.1.mlp.gate.e_score_correction_bias"] == (E,)
        assert shapes["model.layers.1.mlp.shared_experts.up_proj.weight"] == (2 * I, D)
        assert shapes["model.layers.0.self_attn.o_proj.bias"] == (D,)
        assert shapes["model.layers.0.self_attn.q_norm.weight"] == (16,)
    if family in mtm.MLA:  # layer 0 dense; the kv latent (32) + rope key (8); 4 heads of 16 + 8, v 12
        assert shapes["model.layers.0.mlp.gate_proj.weight"] == (112, D)
        assert shapes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (32 + 8, D)
        assert shapes["model.layers.0.self_attn.kv_b_proj.weight"] == (4 * (16 + 12), 32)
        assert shapes["model.layers.0.self_attn.o_proj.weight"] == (D, 4 * 12)
        shared = cfg["n_shared_experts"] * I
        assert shapes["model.layers.1.mlp.shared_experts.up_proj.weight"] == (shared, D)
        bias = "model.layers.1.mlp.gate.e_score_correction_bias"
        assert (bias in shapes) == (family == "deepseek_v3")
        q = ("q_a_proj", (24, D)) if family == "deepseek_v3" else ("q_proj", (4 * (16 + 8), D))
        assert shapes[f"model.layers.0.self_attn.{q[0]}.weight"] == q[1]
        mtp = family == "deepseek_v3" and layout == "per_expert"
        assert ("model.layers.3.shared_head.head.weight" in shapes) == mtp
    if family == "ernie4_5_moe":  # layer 0 dense; the [1, E] bias, 2 shared experts; tied
        assert shapes["model.layers.0.mlp.gate_proj.weight"] == (112, D)
        statics = "gate.moe_statics" if layout == "fused" else "moe_statics"
        assert shapes[f"model.layers.1.mlp.{statics}.e_score_correction_bias"] == (1, E)
        assert shapes["model.layers.1.mlp.shared_experts.up_proj.weight"] == (2 * I, D)
        assert "lm_head.weight" not in shapes and "model.layers.0.self_attn.q_proj.bias" not in shapes
    if family == "hunyuan_v1_moe":  # a shared MLP as wide as the experts; q/k norms per head
        assert shapes["model.layers.0.mlp.shared_mlp.up_proj.weight"] == (I, D)
        assert shapes["model.layers.0.self_attn.query_layernorm.weight"] == (16,)
        assert shapes["model.layers.0.self_attn.key_layernorm.weight"] == (16,)
    if family == "minimax_m2":  # the correction bias; q/k norms over the whole projection
        moe = "block_sparse_moe" if layout == "per_expert" else "mlp"
        assert shapes[f"model.layers.0.{moe}.e_score_correction_bias"] == (E,)
        assert shapes["model.layers.0.self_attn.q_norm.weight"] == (4 * 16,)
        assert shapes["model.layers.0.self_attn.k_norm.weight"] == (2 * 16,)
    if family == "phimoe":  # LayerNorms with biases; q/k/v/o and lm_head biases
        assert shapes["model.layers.0.input_layernorm.bias"] == (D,) and shapes["model.norm.bias"] == (D,)
        assert shapes["model.layers.0.self_attn.o_proj.bias"] == (D,)
        assert shapes["lm_head.bias"] == (cfg["vocab_size"],)
    if family in mtm.HYBRID:  # 3 Gated DeltaNet layers, then attention with a 2x-wide q_proj
        assert shapes["model.layers.3.self_attn.q_proj.weight"] == (2 * 4 * 16, D)
        assert "model.layers.0.linear_attn.A_log" in shapes and "model.layers.0.self_attn.q_proj.weight" not in shapes
        qkv = ("in_proj_qkvz", 2 * 2 * 16 + 2 * 4 * 24) if family == "qwen3_next" else ("in_proj_qkv", 2 * 2 * 16 + 4 * 24)
        assert shapes[f"model.layers.2.linear_attn.{qkv[0]}.weight"] == (qkv[1], D)
    config = json.loads((path / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    assert "rope_parameters" in config.get("text_config", config)
    _, logits = load_logits(path)
    assert logits.shape == (1, 16, cfg["vocab_size"])
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.1  # not a near-constant random model


@pytest.mark.parametrize("family", mtm.FAMILIES)
def test_legacy_config_loads(tmp_path, family):
    layers = 4 if family in mtm.HYBRID else 2  # transformers needs an attention layer in a hybrid
    path = mtm.build(tmp_path / "m", family, config_style="legacy", num_hidden_layers=layers)
    top = json.loads((path / "config.json").read_text())
    config = top["text_config"] if family in mtm.VLM else top  # a VLM's: legacy inside text_config
    assert "rope_parameters" not in config and "dtype" not in config
    assert top["torch_dtype"] == "float32"
    # gpt_oss's tiny one: yarn; qwen3_vl_moe's: plain with M-RoPE sections
    assert (config["rope_scaling"] is None) == (family not in ("gpt_oss", *mtm.VLM))
    assert config["rope_theta"] == mtm.DEFAULTS[family]["rope_theta"]
    key = mtm.LEGACY_EXPERTS_KEY[family]
    other = {"num_experts", "num_local_experts"} - {key}
    assert config[key] == 8 and not other & set(config)
    assert ("head_dim" in config) == (family in ("qwen3_moe", "glm4_moe", "gpt_oss", *mtm.HYBRID,
                                                 *mtm.VLM, "dots1", "ernie4_5_moe",
                                                 "hunyuan_v1_moe", "minimax_m2", "llama4_text"))
    if family in mtm.HYBRID:  # as the published Qwen3-Next config reads
        assert config["partial_rotary_factor"] == 0.25 and config["full_attention_interval"] == 4
        assert "layer_types" not in config
    nested = mtm.build(tmp_path / "n", family, num_hidden_layers=layers)
    _, a = load_logits(path)
    _, b = load_logits(nested)
    torch.testing.assert_close(a, b)  # same weights, same model whichever config style


def test_rope_scaling_legacy_roundtrip(tmp_path):
    scaling = {"rope_type": "linear", "factor": 2.0}
    path = mtm.build(tmp_path / "m", "qwen3_moe", config_style="legacy", rope_scaling=scaling)
    assert json.loads((path / "config.json").read_text())["rope_scaling"] == scaling
    model, logits = load_logits(path)
    assert model.config.rope_parameters["rope_type"] == "linear"
    assert torch.isfinite(logits).all()


def test_sharded_build_has_index(tmp_path):
    path = mtm.build(tmp_path / "m", "qwen2_moe", shards=3)
    files = sorted(path.glob("*.safetensors"))
    assert len(files) >= 2
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in files}
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in index["weight_map"]
    assert set(index["weight_map"]) == set(tensor_shapes(path))
    _, logits = load_logits(path)
    assert torch.isfinite(logits).all()


def test_dense_layer_and_tied_embeddings(tmp_path):
    path = mtm.build(tmp_path / "m", "qwen3_moe", layout="fused", mlp_only_layers=[0],
                     tie_word_embeddings=True, dtype="fp16")
    shapes = tensor_shapes(path)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (96, 64)
    assert "model.layers.0.mlp.experts.gate_up_proj" not in shapes
    assert "model.layers.1.mlp.experts.gate_up_proj" in shapes
    assert "lm_head.weight" not in shapes
    model, logits = load_logits(path)
    assert torch.isfinite(logits).all()


def test_seed_determinism(tmp_path):
    a = mtm.build(tmp_path / "a", "mixtral", seed=3, num_hidden_layers=1)
    b = mtm.build(tmp_path / "b", "mixtral", seed=3, num_hidden_layers=1)
    c = mtm.build(tmp_path / "c", "mixtral", seed=4, num_hidden_layers=1)
    read = lambda p: (p / "model.safetensors").read_bytes()  # noqa: E731
    assert read(a) == read(b) != read(c)


def test_routing_not_degenerate(tmp_path):
    path = mtm.build(tmp_path / "m", "olmoe", num_experts=16, num_hidden_layers=4)
    coverage = mtm.expert_coverage(path, num_tokens=32)
    assert len(coverage) == 4 and min(coverage) >= 12, coverage


def test_bad_options_are_named_errors(tmp_path):
    with pytest.raises(mtm.TinyModelError, match="unknown family"):
        mtm.build(tmp_path, "llama")
    with pytest.raises(mtm.TinyModelError, match="no such field"):
        mtm.build(tmp_path, "mixtral", num_expertz=4)
    assert mtm.main([str(tmp_path), "--set", "oops"]) == 2


def test_tokenizer_roundtrip_and_chat_template(tmp_path):
    from jinja2 import Template
    from tokenizers import Tokenizer

    path = mtm.build(tmp_path / "m", "qwen3_moe", num_hidden_layers=1)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.get_vocab_size() == mtm.DEFAULTS["qwen3_moe"]["vocab_size"]
    text = "def fibonacci(n):\n    return n  # ünïcode ✓ 123\n"
    ids = tok.encode(text).ids
    assert len(ids) < len(text.encode())  # merges were learned
    assert tok.decode(ids) == text
    config = json.loads((path / "config.json").read_text())
    tcfg = json.loads((path / "tokenizer_config.json").read_text())
    assert tok.token_to_id(tcfg["eos_token"]) == config["eos_token_id"]
    assert tok.token_to_id(tcfg["bos_token"]) == config["bos_token_id"]
    prompt = Template(tcfg["chat_template"]).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    enc = tok.encode(prompt).ids
    assert enc[0] == tok.token_to_id("<|im_start|>") and tok.token_to_id("<|im_end|>") in enc
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    assert hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                      add_generation_prompt=True) == prompt


def test_vlm_layout(tmp_path):
    """The Qwen3.5/3.6 VLM checkpoint: text under model.language_model., a vision tower, an mtp
    shard in the index; transformers' text model loads it (vision and mtp ignored)."""
    path = mtm.build(tmp_path / "m", "qwen3_5_moe_text", layout="vlm")
    shapes = tensor_shapes(path)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe" and config["text_config"]["model_type"] == "qwen3_5_moe_text"
    assert "model.language_model.layers.3.self_attn.q_proj.weight" in shapes and "lm_head.weight" in shapes
    assert any(k.startswith("model.visual.") for k in shapes) and "mtp.fc.weight" in shapes
    assert not any(k.startswith("model.layers.") for k in shapes)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(shapes)
    _, logits = load_logits(path)
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    with pytest.raises(mtm.TinyModelError, match="qwen3_5_moe_text, llama4_text only"):
        mtm.build(tmp_path / "x", "qwen3_moe", layout="vlm")


def test_list_cli(capsys):
    assert mtm.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(f in out for f in mtm.FAMILIES)
