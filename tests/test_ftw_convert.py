"""freetoken convert: bitwise round trip HF tensors -> FTW for every family and layout, config
normalisation, dense layers, dtype conversion, the fused [E, in, out] layout, determinism."""
import json
import re
import struct

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from convert_support import hf_tensors, proj_bytes, raw
import ftw
import make_tiny_model
from freetoken.cli import main
from ftw import names
from ftw.convert import convert
from ftw.hf_source import fp32_to_bf16

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
DTYPE_OF = {"qwen3_moe": "bf16", "qwen2_moe": "fp16", "mixtral": "fp32", "olmoe": "bf16"}

# Independent oracle for non-expert names (HF suffix after model.layers.{i}. -> FTW suffix).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                        r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
PROJ_OF = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    built = {}
    for family in FAMILIES:
        for layout in ("per_expert", "fused"):
            built[family, layout] = make_tiny_model.build(
                root / f"{family}-{layout}", family, layout=layout, dtype=DTYPE_OF[family],
                shards=2 if layout == "fused" else 1)
    return built


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bitwise_round_trip(models, tmp_path, family, layout):
    src = models[family, layout]
    out = convert(src, tmp_path / "m.ftw", threads=2)
    hf = hf_tensors(src)
    with ftw.open(out, verify=True) as f:
        assert f.config["family"] == family and f.config["source_dtype"] == DTYPE_OF[family]
        seen_experts = set()
        for name, t in hf.items():
            m = PER_EXPERT.fullmatch(name)
            fused = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", name)
            if m:
                layer, e, proj = int(m[1]), int(m[2]), PROJ_OF[m[3]]
                assert proj_bytes(f, layer, e, proj) == raw(t), name
                seen_experts.add((layer, e, proj))
            elif fused:
                layer, inter = int(fused[1]), f.config["moe_intermediate_size"]
                for e in range(t.shape[0]):
                    if fused[2] == "gate_up_proj":  # [E, 2I, D]: gate rows first, then up
                        assert proj_bytes(f, layer, e, "gate") == raw(t[e, :inter]), name
                        assert proj_bytes(f, layer, e, "up") == raw(t[e, inter:]), name
                        seen_experts |= {(layer, e, "gate"), (layer, e, "up")}
                    else:
                        assert proj_bytes(f, layer, e, "down") == raw(t[e]), name
                        seen_experts.add((layer, e, "down"))
            else:
                lm = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
                canon = f"blk.{lm[1]}.{LAYER_NAMES[lm[2]]}" if lm else GLOBAL_NAMES[name]
                assert f.tensors[canon].shape == tuple(t.shape)
                assert f.tensor_bytes(canon).tobytes() == raw(t), name
        c = f.config
        assert len(seen_experts) == len(c["moe_layers"]) * c["num_experts"] * 3
        assert len(f.tensors) == len([n for n in hf if not PER_EXPERT.fullmatch(n) and "experts." not in n])


def test_config_semantics(models, tmp_path):
    cfgs = {}
    for family in FAMILIES:
        with ftw.open(convert(models[family, "per_expert"], tmp_path / f"{family}.ftw")) as f:
            cfgs[family] = f.config
            assert f.tokenizer_json and "im_start" in f.chat_template
    q3, q2, mx, ol = (cfgs[k] for k in FAMILIES)
    assert (q3["qk_norm"], q2["qk_norm"], mx["qk_norm"], ol["qk_norm"]) == ("per_head", "none", "none", "full")
    assert q2["attention_bias"] and not q3["attention_bias"] and not mx["attention_bias"]
    assert (q2["shared_expert_intermediate_size"], q2["shared_expert_gate"]) == (80, True)
    assert (q3["shared_expert_intermediate_size"], q3["shared_expert_gate"]) == (0, False)
    assert mx["norm_topk_prob"] is True and q3["norm_topk_prob"] is True and q2["norm_topk_prob"] is False
    assert mx["rope_theta"] == 1e6 and mx["moe_intermediate_size"] == 48 and ol["moe_intermediate_size"] == 48
    for c in cfgs.values():
        assert c["moe_layers"] == [0, 1, 2] and c["rope_scaling"] is None and c["sliding_window"] is None
        assert (c["num_experts"], c["num_experts_per_tok"], c["head_dim"], c["num_kv_heads"]) == (8, 2, 16, 2)
        assert c["eos_token_ids"] == [2] and c["router_scoring"] == "softmax"


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_legacy_and_nested_config_styles_agree(tmp_path, family):
    a = make_tiny_model.build(tmp_path / "n", family, config_style="nested")
    b = make_tiny_model.build(tmp_path / "l", family, config_style="legacy")
    assert "rope_theta" in json.loads((b / "config.json").read_text())
    with ftw.open(convert(a, tmp_path / "n.ftw")) as fa, ftw.open(convert(b, tmp_path / "l.ftw")) as fb:
        assert fa.config == fb.config


def test_rope_scaling_and_sliding_window(tmp_path):
    src = make_tiny_model.build(tmp_path / "q", "qwen3_moe", config_style="legacy")
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(rope_scaling={"type": "yarn", "factor": 4.0}, use_sliding_window=False, sliding_window=128)
    (src / "config.json").write_text(json.dumps(cfg))
    with ftw.open(convert(src, tmp_path / "a.ftw")) as f:
        assert f.config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 512}
        assert f.config["sliding_window"] is None  # only with use_sliding_window
    cfg["use_sliding_window"] = True
    (src / "config.json").write_text(json.dumps(cfg))
    with ftw.open(convert(src, tmp_path / "b.ftw")) as f:
        assert f.config["sliding_window"] == 128


def test_dense_layers_and_tied_embeddings(tmp_path):
    src = make_tiny_model.build(tmp_path / "q3", "qwen3_moe", mlp_only_layers=[1], tie_word_embeddings=True)
    with ftw.open(convert(src, tmp_path / "a.ftw")) as f:
        assert f.config["moe_layers"] == [0, 2] and sorted(f.banks) == [0, 2]
        assert f.tensors["blk.1.ffn_gate.weight"].shape == (96, 64)
        assert f.tensors["blk.1.ffn_down.weight"].shape == (64, 96)
        assert "output.weight" not in f.tensors and f.config["tie_word_embeddings"] is True
    src = make_tiny_model.build(tmp_path / "q2", "qwen2_moe", decoder_sparse_step=2)
    with ftw.open(convert(src, tmp_path / "b.ftw")) as f:
        assert f.config["moe_layers"] == [1] and sorted(f.banks) == [1]
        assert "blk.0.ffn_up.weight" in f.tensors and "blk.1.ffn_up_shexp.weight" in f.tensors


def test_dtype_conversion(models, tmp_path):
    src = models["mixtral", "per_expert"]  # fp32 source
    hf = hf_tensors(src)
    with ftw.open(convert(src, tmp_path / "b.ftw", dtype="bf16")) as f:
        t = hf["model.layers.1.self_attn.q_proj.weight"]
        assert f.tensors["blk.1.attn_q.weight"].dtype == "bf16" and f.banks[0].dtype == "bf16"
        assert f.tensor_bytes("blk.1.attn_q.weight").tobytes() == raw(t.to(torch.bfloat16))
        w2 = hf["model.layers.0.block_sparse_moe.experts.3.w2.weight"]
        assert proj_bytes(f, 0, 3, "down") == raw(w2.to(torch.bfloat16))
    with ftw.open(convert(src, tmp_path / "h.ftw", dtype="fp16")) as f:
        assert f.tensor_bytes("token_embd.weight").tobytes() == raw(hf["model.embed_tokens.weight"].half())
    src = models["qwen3_moe", "fused"]  # bf16 source -> fp32 is exact
    hf = hf_tensors(src)
    with ftw.open(convert(src, tmp_path / "f.ftw", dtype="fp32")) as f:
        assert f.tensor_bytes("output_norm.weight").tobytes() == raw(hf["model.norm.weight"].float())


def test_fp32_to_bf16_rounds_like_torch():
    special = np.array([0.0, -0.0, 1.0, 1.00390625, 1.005859375, 1.0 + 2**-8 + 2**-16, 3.4e38, 3.39e38,
                        1e-40, -1e-45, np.inf, -np.inf, np.nan, 65504.0, 2**-126], dtype=np.float32)
    x = np.concatenate([special, np.random.default_rng(0).standard_normal(10000).astype(np.float32) * 100])
    ours = fp32_to_bf16(x)
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.uint16).numpy()
    finite = ~np.isnan(x)
    assert np.array_equal(ours[finite], ref[finite])
    assert np.isnan((ours[~finite].astype(np.uint32) << 16).view(np.float32)).all()


def _write_safetensors_reversed(path, tensors: dict):
    """A valid safetensors file with header keys and data in reverse name order."""
    names_ = sorted(tensors, reverse=True)
    header, pos, blobs = {}, 0, []
    for n in names_:
        data = raw(tensors[n])
        dt = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}[tensors[n].dtype]
        header[n] = {"dtype": dt, "shape": list(tensors[n].shape), "data_offsets": [pos, pos + len(data)]}
        blobs.append(data)
        pos += len(data)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def test_same_input_same_bytes(models, tmp_path):
    src = models["qwen2_moe", "per_expert"]
    for sub in "abc":  # same output file name: it is part of the header (files[0].name)
        (tmp_path / sub).mkdir()
    a = convert(src, tmp_path / "a" / "m.ftw", threads=1)
    b = convert(src, tmp_path / "b" / "m.ftw", threads=4)
    shuffled = tmp_path / "shuffled"
    shuffled.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (shuffled / name).write_bytes((src / name).read_bytes())
    _write_safetensors_reversed(shuffled / "model.safetensors", hf_tensors(src))
    c = convert(shuffled, tmp_path / "c" / "m.ftw", threads=3)
    assert a.read_bytes() == b.read_bytes() == c.read_bytes()


@pytest.mark.parametrize("interleaved", [False, True])
def test_fused_in_out_layout(models, tmp_path, monkeypatch, interleaved):
    """[E, in, out] expert tensors (gpt_oss/llama4 style) through a table with transposed=True."""
    src = models["qwen3_moe", "fused"]
    reference = convert(src, tmp_path / "ref.ftw")
    hf = hf_tensors(src)
    inter = 48
    syn = tmp_path / "syn"
    syn.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (syn / name).write_bytes((src / name).read_bytes())
    out = {}
    for name, t in hf.items():
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, D] -> [E, D, 2I]
            if interleaved:  # rows gate0, up0, gate1, up1, ...
                t = torch.stack([t[:, :inter], t[:, inter:]], dim=2).reshape(t.shape)
            out[name.replace("gate_up_proj", "w13")] = t.transpose(1, 2).contiguous()
        elif name.endswith("experts.down_proj"):  # [E, D, I] -> [E, I, D]
            out[name.replace("down_proj", "w2")] = t.transpose(1, 2).contiguous()
        else:
            out[name] = t
    save_file(out, syn / "model.safetensors")
    base = names.FAMILIES["qwen3_moe"]
    L = "model.layers.{i}.mlp.experts."
    family = names.Family(base.name, base.model_types, base.architectures, base.tensors, base.per_expert,
                          (names.FusedExperts(L + "w13", ("gate", "up"), transposed=True, interleaved=interleaved),
                           names.FusedExperts(L + "w2", ("down",), transposed=True)), base.ignore)
    monkeypatch.setitem(names.FAMILIES, "qwen3_moe", family)
    with ftw.open(convert(syn, tmp_path / "syn.ftw")) as f, ftw.open(reference) as ref:
        for layer, bank in ref.banks.items():
            assert f.banks[layer].projections == bank.projections
            for e in range(bank.num_experts):
                assert f.slot_bytes(layer, e).tobytes() == ref.slot_bytes(layer, e).tobytes()


def test_unused_tensors_are_skipped_with_a_note(models, tmp_path):
    src = models["olmoe", "per_expert"]
    hf = hf_tensors(src)
    hf["mtp.0.eh_proj.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    copy = tmp_path / "src"
    copy.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (copy / name).write_bytes((src / name).read_bytes())
    save_file(hf, copy / "model.safetensors")
    result = CliRunner().invoke(main, ["convert", str(copy), "-o", str(tmp_path / "m.ftw")])
    assert result.exit_code == 0, result.output
    assert "note: skipping 2 tensor(s)" in result.output
    with ftw.open(tmp_path / "m.ftw") as f:
        assert f.metadata["source.ignored_tensors"] == ["model.layers.0.self_attn.rotary_emb.inv_freq",
                                                        "mtp.0.eh_proj.weight"]


def test_cli_convert_split_and_inspect(models, tmp_path):
    src = models["qwen2_moe", "fused"]
    out = tmp_path / "m.ftw"
    r = CliRunner().invoke(main, ["convert", str(src), "-o", str(out), "--threads", "2", "--split-size", "200K"])
    assert r.exit_code == 0, r.output
    parts = sorted(p.name for p in tmp_path.iterdir())
    assert parts[0] == "m.ftw" and len(parts) > 2 and all(p.stat().st_size <= 200 << 10 for p in tmp_path.iterdir())
    r = CliRunner().invoke(main, ["inspect", str(out), "--verify"])
    assert r.exit_code == 0, r.output
    assert "all checksums verified" in r.output and "blk.2.ffn_exps" in r.output and "qwen2_moe" in r.output
    r = CliRunner().invoke(main, ["inspect", str(out), "--json"])
    info = json.loads(r.output)
    # unquantized, so version 1 (SPEC.md §9.5)
    assert info["version"] == 1 and len(info["banks"]) == 3 and len(info["files"]) == len(parts)
    assert info["metadata"]["model.config"]["shared_expert_gate"] is True
