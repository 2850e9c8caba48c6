"""tools/train_tiny_moe.py: corpus split, schedule, balance loss, and a seconds-long CPU run
that must leave a loadable HF checkpoint with a consistent tokenizer, its held-out split
(val_ids.npy, val_files.txt) that tools/perplexity.py --split scores as the trainer did, and an
.ftw every quant type runs; SIGINT during training keeps the weights trained so far."""
import json
import math
import os
import pathlib
import signal
import sysconfig

import numpy as np
import pytest
import torch

import train_tiny_moe as ttm
from tiny_corpus import read_corpus, split_corpus


def test_sources_skip_tests_and_split_is_deterministic_and_disjoint():
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    paths = ttm.list_sources(root, include_tests=False, max_file_kb=256)
    assert paths and not any({"test", "tests", "__pycache__"} & set(p.parts) for p in paths)
    assert all(p.stat().st_size <= 256 * 1024 for p in paths)
    a = read_corpus(paths, seed=1, val_frac=0.1, max_mb=0.5)
    b = read_corpus(paths, seed=1, val_frac=0.1, max_mb=0.5)
    assert a == b
    train, val = a
    assert train and val and not set(train) & set(val)
    assert sum(map(len, train)) + sum(map(len, val)) <= 0.5e6
    assert read_corpus(paths, seed=2, val_frac=0.1, max_mb=0.5)[1] != val
    # split_corpus: the same split with each text's file (the one it was read from)
    train_files, val_files = split_corpus(paths, seed=1, val_frac=0.1, max_mb=0.5)
    assert [t for _, t in train_files] == train and [t for _, t in val_files] == val
    assert all(p.read_text(encoding="utf-8") == t for p, t in val_files)


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
    # the held-out split is saved beside the checkpoint: the validation files' token ids, as the
    # trainer's evaluations score them, and their names
    from tiny_corpus import encode_stream, load_split
    from tokenizers import Tokenizer
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    _, val = split_corpus(ttm.list_sources(root, False, 256), 1234, 0.05, 0.3)
    assert (out / "val_files.txt").read_text().splitlines() == [
        p.relative_to(root).as_posix() for p, _ in val]
    ids = load_split(out)
    assert ids.dtype == np.int32 and np.array_equal(
        ids, encode_stream(Tokenizer.from_file(str(out / "tokenizer.json")), [t for _, t in val]))
    meta = json.loads((out / "train_meta.json").read_text())
    assert meta["split"]["val_tokens"] == len(ids) and meta["split"]["val_files"] == len(val)
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
    # tools/perplexity.py --split scores exactly the windows the trainer scored: its stored row is
    # the reloaded checkpoint's val loss (fp32 compute of the bf16 weights), and every quant
    # type (the smoke experts' I = 32 holds 32-blocks) gets a number
    import perplexity
    rows = perplexity.main([str(tmp_path / "m.ftw"), "--split", str(out), "--windows", "8",
                            "--seq-len", "64"])
    assert [r[0] for r in rows] == ["bf16", "q8_0", "q4_0", "mxfp4", "nvfp4"]
    assert all(r[2] is not None and math.isfinite(r[2]) for r in rows), rows
    assert abs(rows[0][2] - res["bf16_val_loss"]) < 1e-3, (rows[0][2], res["bf16_val_loss"])


def test_sigint_keeps_the_trained_weights(tmp_path, monkeypatch):
    """`timeout -s INT` (or Ctrl-C) in the training loop ends training there, in the final
    evaluation skips it, and during the checkpoint's writes waits for them: the checkpoint, its
    held-out split and the .ftw are written whole (the GPU run's safety net)."""
    lr_at, evaluate, convert_ftw = ttm.lr_at, ttm.evaluate, ttm.convert_ftw

    def interrupt_at_step_3(step, *a, **k):
        if step == 3:
            raise KeyboardInterrupt
        return lr_at(step, *a, **k)

    def final_eval_interrupted(*a, expert_counts=False, **k):
        if expert_counts:  # the final evaluation, over every window
            raise KeyboardInterrupt
        return evaluate(*a, expert_counts=expert_counts, **k)

    def sigint_while_converting(*a):
        os.kill(os.getpid(), signal.SIGINT)
        convert_ftw(*a)

    before = signal.getsignal(signal.SIGINT)  # (SIG_IGN where pytest runs as a background job)
    monkeypatch.setattr(ttm, "lr_at", interrupt_at_step_3)
    monkeypatch.setattr(ttm, "evaluate", final_eval_interrupted)
    monkeypatch.setattr(ttm, "convert_ftw", sigint_while_converting)
    out = tmp_path / "ckpt"
    res = ttm.main(["--out", str(out), "--device", "cpu", "--preset", "smoke", "--steps", "50",
                    "--max-corpus-mb", "0.3", "--eval-every", "2", "--eval-seqs", "4",
                    "--sample-tokens", "1", "--ftw", str(tmp_path / "m.ftw")])
    assert res["steps"] == 3 and res["best_step"] == 2
    assert res["val_loss"] == res["best_val"] and res["bf16_val_loss"] is None  # checks skipped
    meta = json.loads((out / "train_meta.json").read_text())
    assert meta["steps"] == 3 and meta["val_loss"] == res["best_val"]
    assert (out / "model.safetensors").is_file() and (out / "val_ids.npy").is_file()
    assert (tmp_path / "m.ftw").stat().st_size > 0
    assert signal.getsignal(signal.SIGINT) == before  # restored
