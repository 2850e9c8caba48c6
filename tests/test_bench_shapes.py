"""tools/bench_shapes.py: synthetic models of large shapes (no FTW file) run through the real
Engine on the CPU, their configs equal what convert makes of transformers' config, their banks
are registered as load_banks registers them; bench_agent --shape and bench_batch --shape end to
end on tiny shrunk shapes."""
import numpy as np
import pytest
import torch

import bench_shapes
from bench_shapes import SHAPES, SyntheticFile, model_config, shape_config
from freetoken.config import EngineConfig
from freetoken.engine import Engine
from freetoken.sampling import SamplingParams

SMALL = {"qwen3-30b-a3b": dict(layers=2, experts=8), "qwen3.6-35b-a3b": dict(layers=4, experts=8),
        "gpt-oss-20b": dict(layers=2, experts=8)}
CLASSES = {"qwen3_moe": "Qwen3MoeConfig", "qwen3_5_moe_text": "Qwen3_5MoeTextConfig",
           "gpt_oss": "GptOssConfig"}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_config_is_what_convert_makes_of_the_transformers_config(name):
    """Every field of a shape is a field of transformers' config class, and the config equals
    what convert (hf_config.normalise) makes of that class's own config.json."""
    import transformers
    hf = shape_config(name)
    cls = getattr(transformers, CLASSES[hf["model_type"]])
    # Qwen3MoeConfig has no head_dim field: its model reads one when the config has it (the
    # published Qwen3-30B-A3B config: 128, not hidden / heads)
    extra = {"model_type", "head_dim"} if hf["model_type"] == "qwen3_moe" else {"model_type"}
    unknown = [k for k in hf if k not in extra and not hasattr(cls(), k)]
    assert not unknown, unknown
    written = cls(**{k: v for k, v in hf.items() if k != "model_type"}).to_dict()
    assert model_config(written) == model_config(hf)


def test_shapes_are_the_published_models():
    """The numbers the shapes stand for (Qwen3.6's attention and Gated DeltaNet fields are
    those Qwen3_5MoeTextConfig documents as the released model's, its defaults)."""
    import transformers
    q3 = model_config(shape_config("qwen3-30b-a3b"))
    assert (q3["num_layers"], q3["num_experts"], q3["num_experts_per_tok"], q3["hidden_size"],
            q3["moe_intermediate_size"], q3["num_heads"], q3["num_kv_heads"], q3["head_dim"],
            q3["vocab_size"]) == (48, 128, 8, 2048, 768, 32, 4, 128, 151936)
    q36 = model_config(shape_config("qwen3.6-35b-a3b"))
    assert (q36["num_layers"], q36["num_experts"], q36["num_experts_per_tok"], q36["hidden_size"],
            q36["moe_intermediate_size"], q36["shared_expert_intermediate_size"],
            q36["vocab_size"]) == (40, 256, 8, 2048, 512, 512, 248320)
    assert q36["layer_types"] == ["full_attention" if i % 4 == 3 else "linear_attention"
                                  for i in range(40)] and q36["shared_expert_gate"]
    released = transformers.Qwen3_5MoeTextConfig()
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "linear_conv_kernel_dim",
                "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim"):
        assert shape_config("qwen3.6-35b-a3b")[key] == getattr(released, key), key
    assert q36["partial_rotary_factor"] == released.rope_parameters["partial_rotary_factor"]
    oss = model_config(shape_config("gpt-oss-20b"))
    assert (oss["num_layers"], oss["num_experts"], oss["num_experts_per_tok"], oss["hidden_size"],
            oss["moe_intermediate_size"], oss["num_heads"], oss["num_kv_heads"], oss["head_dim"],
            oss["layer_window"], oss["vocab_size"]) == (24, 32, 4, 2880, 2880, 64, 8, 64, 128, 201088)
    assert oss["layer_types"][:2] == ["sliding_attention", "full_attention"]


def test_shrink_options():
    hf = shape_config("qwen3.6-35b-a3b", layers=6, experts=4, tiny=True, vocab_size=1000)
    assert (hf["num_hidden_layers"], hf["num_experts"], hf["num_experts_per_tok"],
            hf["vocab_size"], hf["hidden_size"]) == (6, 4, 4, 1000, 64)
    assert hf["layer_types"][3] == "full_attention" and len(hf["layer_types"]) == 6
    with pytest.raises(SystemExit, match="not a field"):
        shape_config("gpt-oss-20b", moe_intermediate_size=8)  # gpt_oss: intermediate_size
    with pytest.raises(SystemExit, match="unknown shape"):
        shape_config("qwen9")


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_engine_runs_the_synthetic_model(name):
    """Each family loads through Engine from the synthetic file (strict names and shapes) and
    gives finite logits that differ between tokens and positions; a greedy generation runs."""
    f = SyntheticFile(name, tiny=True, **SMALL[name])
    with Engine(f, EngineConfig(device="cpu", ctx_size=128)) as engine:
        assert engine.path == f"synthetic:{name}"
        logits = engine.score(list(range(3, 40)))  # [37, V]
        assert torch.isfinite(logits).all()
        assert (logits.std(dim=-1) > 0.1).all()  # no row flat
        assert (logits[1:] - logits[:-1]).abs().amax() > 0.1  # rows differ
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        out = list(engine.generate(list(range(3, 20)), params))
        assert len(out) == 4 and all(0 <= t < f.config["vocab_size"] for t in out)
        if name == "qwen3.6-35b-a3b":  # anchors from the tokenizer and template: <|im_end|>
            assert engine.anchors.closer_ids == {bench_shapes.EOS_ID}


def test_banks_filled_shared_and_registered_like_load_banks():
    """Banks: the converter's slot layout, finite bf16 values, no two slots alike; register runs
    once per bank in layer order; a reopened file shares the buffers and does not register
    them again until the file that did is closed."""
    f = SyntheticFile("gpt-oss-20b", layers=3, experts=4, tiny=True)
    seen = []
    banks = f.load_banks(register=lambda data: seen.append(data.ctypes.data))
    assert list(banks) == [0, 1, 2] and seen == [banks[i].data.ctypes.data for i in range(3)]
    info = banks[0].info
    assert [p.name for p in info.projections] == ["gate", "up", "down", "gate_bias", "up_bias",
                                                  "down_bias"]
    assert info.slot_stride % 4096 == 0 and banks[0].data.nbytes == 4 * info.slot_stride
    slots = [b.data.reshape(4, -1) for b in banks.values()]
    values = torch.from_numpy(np.concatenate(slots).view(np.int16)).view(torch.bfloat16)
    assert torch.isfinite(values).all() and 0.005 < values.float().std() < 0.2
    rows = {bytes(s[e]) for s in slots for e in range(4)}
    assert len(rows) == 12
    other = f.reopen()
    again = []
    shared = other.load_banks(register=again.append)
    assert again == [] and shared[1].data.ctypes.data == banks[1].data.ctypes.data
    f.close()
    other.load_banks(register=again.append)
    assert len(again) == 3


def test_tokenizer_covers_the_vocab():
    """Every id of the shape's vocab decodes to text (plain tokens pad the tiny tokenizer)."""
    from freetoken.tokenizer import Tokenizer
    tok = Tokenizer(bench_shapes.tokenizer_json(600))
    assert tok.vocab_size == 600
    assert tok.token(0) == "<|endoftext|>" and tok.token(bench_shapes.EOS_ID) == "<|im_end|>"
    assert all(tok.decode([i]) for i in range(3, 600))


def test_bench_agent_with_shape(capsys):
    """bench_agent --shape: the default mode reuses at least the previous turn's prompt; --edits
    on the hybrid shape prefills fewer tokens with states at anchors than with no reuse."""
    import bench_agent
    tiny = ["--shape", "qwen3-30b-a3b", "--layers", "2", "--experts", "8", "--tiny",
            "--device", "cpu", "--system", "70", "--turns", "3", "--tool", "8,16", "--reply", "2,4",
            "--from", "2"]
    rows = bench_agent.main(tiny)
    assert [r[0] for r in rows] == [1, 2, 3] and rows[0][2] == 0
    assert all(prev[1] <= r[2] < r[1] for prev, r in zip(rows, rows[1:]))  # to the token
    assert "qwen3-30b-a3b (qwen3_moe) random bf16" in capsys.readouterr().out
    results, reqs = bench_agent.main(["--shape", "qwen3.6-35b-a3b", "--layers", "4", "--experts",
                                      "8", "--tiny", "--device", "cpu", "--edits", "--system",
                                      "64", "--turns", "4", "--tool", "16,32", "--reply", "4,8"])
    a, c = (results[m] for m in (bench_agent.MODES[0], bench_agent.MODES[2]))
    assert [r[0] for r in a] == [len(p) for _, p, _, _ in reqs]  # no reuse: every token
    assert sum(r[0] for r in c) < sum(r[0] for r in a)
    assert "qwen3.6-35b-a3b (qwen3_5_moe_text) random bf16" in capsys.readouterr().out


def test_bench_batch_with_shape(capsys):
    """bench_batch --shape on the hybrid shape: its rows print for B = 1 and 2."""
    import bench_batch
    bench_batch.main(["--shape", "qwen3.6-35b-a3b", "--layers", "4", "--experts", "8", "--tiny",
                      "--device", "cpu", "--tokens", "2", "--warmup", "1", "--history", "4",
                      "--batches", "1,2", "--workloads", "uniform"])
    out = capsys.readouterr().out
    assert "qwen3.6-35b-a3b (qwen3_5_moe_text)" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("uniform")]
    assert [r[1] for r in rows] == ["1", "2"] and all(float(r[2]) > 0 for r in rows)


def test_full_shapes_describe_their_banks():
    """The full shapes (banks not built): the converter's slot sizes give Qwen3.6-35B-A3B its
    ~64 GB of bf16 experts, Qwen3-30B-A3B ~58 GB, gpt-oss-20b ~38 GB (biases in its slots)."""
    sizes = {name: SyntheticFile(name).bank_bytes / 1e9 for name in SHAPES}
    assert 64 < sizes["qwen3.6-35b-a3b"] < 65 and 57 < sizes["qwen3-30b-a3b"] < 58.5
    assert 38 < sizes["gpt-oss-20b"] < 38.5


def test_llm_takes_a_synthetic_file():
    """The Python API (LLM) loads a synthetic file too; its chat template encodes a prompt."""
    from freetoken import LLM
    with LLM(SyntheticFile("qwen3-30b-a3b", tiny=True, **SMALL["qwen3-30b-a3b"]), device="cpu",
             ctx_size=128) as llm:
        ids = llm.encode("the expert cache")
        assert ids[0] == 1 and bench_shapes.EOS_ID in ids  # <|im_start|> ... <|im_end|>
        assert isinstance(llm.generate("the expert cache", max_tokens=3, ignore_eos=True), str)
        assert llm.stats.num_generated == 3


def test_bench_batch_decode_beside_prefill_both_modes(capsys):
    """bench_batch --during-prefill --beside-mode interleave,thread: a row per mode, the decode
    steps beside the prefill in both (the thread's on a thread of their own), nothing filled."""
    import bench_batch
    bench_batch.main(["--shape", "qwen3-30b-a3b", "--layers", "2", "--experts", "8", "--tiny",
                      "--device", "cpu", "--tokens", "2", "--warmup", "1", "--history", "4",
                      "--workloads", "uniform", "--during-prefill", "64",
                      "--beside-mode", "interleave,thread"])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("uniform")]
    assert [r[1] for r in rows] == ["interleave", "thread"]
    assert all(float(r[3]) > 0 and float(r[6]) > 0 for r in rows)
    notes = [line for line in out.splitlines() if line.startswith("#   64 tokens")]
    assert len(notes) == 2 and all("fills 0," in n for n in notes)
