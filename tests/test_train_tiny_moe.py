"""tools/train_tiny_moe.py: corpus split, schedule, balance loss, and a seconds-long CPU run
that must leave a loadable HF checkpoint with a consistent tokenizer."""
import json
import math
import pathlib
import sysconfig

import pytest
import torch

import train_tiny_moe as ttm


def test_sources_skip_tests_and_split_is_deterministic_and_disjoint():
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    paths = ttm.list_sources(root, include_tests=False, max_file_kb=256)
    assert paths and not any({"test", "tests", "__pycache__"} & set(p.parts) for p in paths)
    assert all(p.stat().st_size <= 256 * 1024 for p in paths)
    a = ttm.read_corpus(paths, seed=1, val_frac=0.1, max_mb=0.5)
    b = ttm.read_corpus(paths, seed=1, val_frac=0.1, max_mb=0.5)
    assert a == b
    train, val = a
    assert train and val and not set(train) & set(val)
    assert sum(map(len, train)) + sum(map(len, val)) <= 0.5e6
    assert ttm.read_corpus(paths, seed=2, val_frac=0.1, max_mb=0.5)[1] != val


def test_lr_schedule_warms_up_then_decays_to_min():
    assert ttm.lr_at(0, 100, 10, 1.0) == pytest.approx(0.1)
    assert ttm.lr_at(9, 100, 10, 1.0) == pytest.approx(1.0)
    assert ttm.lr_at(10, 100, 10, 1.0) == pytest.approx(1.0)
    assert ttm.lr_at(100, 100, 10, 1.0) == pytest.approx(0.1)
    mid = ttm.lr_at(55, 100, 10, 1.0)
    assert 0.1 < mid < 1.0


def test_balance_loss_is_one_when_uniform_and_larger_when_collapsed():
    uniform = (torch.zeros(64, 8),)
    assert ttm.balance_loss(uniform * 3, k=2).item() == pytest.approx(1.0)
    collapsed = torch.zeros(64, 8)
    collapsed[:, :2] = 5.0  # every token prefers experts 0 and 1
    assert ttm.balance_loss((collapsed,), k=2).item() > 3.0
    # per layer, not pooled: two layers collapsed onto different experts still count as collapsed
    other = collapsed.roll(4, dims=1)
    assert ttm.balance_loss((collapsed, other), k=2).item() > 3.0


def test_smoke_run_saves_a_loadable_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = tmp_path / "ckpt"
    res = ttm.main(["--out", str(out), "--device", "cpu", "--preset", "smoke", "--steps", "5",
                    "--max-corpus-mb", "0.3", "--eval-every", "5", "--eval-seqs", "8",
                    "--sample-tokens", "2", "--ftw", str(tmp_path / "m.ftw")])
    assert res["steps"] == 5 and res["best_step"] == 5
    assert res["val_loss"] < math.log(384)  # 5 steps already beat the uniform guess
    assert abs(res["bf16_val_loss"] - res["val_loss"]) < 0.5
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["tie_word_embeddings"]
    assert config["eos_token_id"] == [0, 2] and config["dtype"] == "bfloat16"
    tok_json = json.loads((out / "tokenizer.json").read_text())
    specials = {t["content"]: t["id"] for t in tok_json["added_tokens"]}
    assert specials == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.eos_token_id == config["eos_token_id"][0] == config["pad_token_id"]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config.num_experts == 8 and model.config.num_experts_per_tok == 2
    ids = torch.tensor([tok("def f(x):\n    return x")["input_ids"]])
    assert torch.isfinite(model(input_ids=ids).logits).all()
    try:
        import ftw.convert  # noqa: F401
    except ImportError:
        return  # the script only prints how to convert later
    assert (tmp_path / "m.ftw").stat().st_size > 0
