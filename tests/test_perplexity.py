"""tools/perplexity.py on a tiny qwen3_moe (I = 48: nvfp4's 16-blocks fit, the 32-blocks do
not): the stored model's mean NLL and the nvfp4 row's equal transformers' on the same windows
(the nvfp4 oracle: transformers with every expert weight replaced by ftw.quant's
quantize-then-dequantize of it) within 1e-4; the types whose blocks do not fit are rows saying
so; the held-out split is built with train_tiny_moe.py's own settings."""
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

import make_tiny_model as mtm
import perplexity
from ftw import quant as Q
from ftw.convert import convert

SEQ_LEN, NUM_WINDOWS = 24, 3


def fake_quant(w: torch.Tensor, quant: str) -> torch.Tensor:
    x = w.detach().numpy()
    return torch.from_numpy(Q.dequantize(Q.quantize(x, quant), quant, x.shape))


def hf_nll(hf, windows) -> float:
    with torch.no_grad():
        logits = hf(windows[:, :-1]).logits
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppl")
    src = mtm.build(root / "hf", "qwen3_moe", dtype="bf16", seed=4)
    path = str(convert(src, root / "m.ftw", threads=2))
    text = root / "held_out.txt"
    text.write_text(open(perplexity.__file__, encoding="utf-8").read(), encoding="utf-8")
    return src, path, text


def test_rows_equal_transformers(tiny, capsys):
    src, path, text = tiny
    rows = perplexity.main([path, "--text", str(text), "--windows", str(NUM_WINDOWS),
                            "--seq-len", str(SEQ_LEN)])
    out = capsys.readouterr().out
    windows = perplexity.token_windows(path, [text.read_text(encoding="utf-8")], SEQ_LEN, NUM_WINDOWS)
    assert windows.shape == (NUM_WINDOWS, SEQ_LEN + 1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    want = {"bf16": hf_nll(hf, windows)}
    I = hf.config.moe_intermediate_size
    for layer in hf.model.layers:
        ex = layer.mlp.experts
        for e in range(ex.gate_up_proj.shape[0]):  # gate and up are separate nvfp4 tensors (own g)
            ex.gate_up_proj.data[e, :I] = fake_quant(ex.gate_up_proj[e, :I], "nvfp4")
            ex.gate_up_proj.data[e, I:] = fake_quant(ex.gate_up_proj[e, I:], "nvfp4")
            ex.down_proj.data[e] = fake_quant(ex.down_proj[e], "nvfp4")
    want["nvfp4"] = hf_nll(hf, windows)
    got = {name: nll for name, _, nll, _ in rows}
    assert [r[0] for r in rows] == ["bf16", "q8_0", "q4_0", "mxfp4", "nvfp4"]
    for name in ("bf16", "nvfp4"):
        assert abs(got[name] - want[name]) <= 1e-4, (name, got[name], want[name])
    assert want["nvfp4"] != want["bf16"]  # the quantized row is another model
    mb = {name: m for name, m, _, _ in rows}
    assert mb["nvfp4"] < mb["bf16"] / 3  # 4.5 bits a weight against 16
    for name in ("q8_0", "q4_0", "mxfp4"):
        assert got[name] is None
        assert re.search(rf"^{name} +n/a: {name} needs cols to be a multiple of 32", out, re.M)
    ppl = dict(zip(["bf16", "nvfp4"], (math.exp(want["bf16"]), math.exp(want["nvfp4"]))))
    assert f"{ppl['nvfp4']:>9.3f}" in out and f"{(ppl['nvfp4'] / ppl['bf16'] - 1) * 100:>+8.2f}%" in out


def test_the_split_is_the_trainers():
    """SPLIT holds the flags tools/make_default_model.py's training run used (its documented
    command, train_tiny_moe.py's defaults otherwise)."""
    import train_tiny_moe
    args = train_tiny_moe.parse_args(["--out", "unused", "--include-tests"])
    assert perplexity.SPLIT == dict(seed=args.seed, include_tests=args.include_tests,
                                    val_frac=args.val_frac, max_corpus_mb=args.max_corpus_mb,
                                    max_file_kb=args.max_file_kb)


def test_held_out_texts_are_the_validation_files(tmp_path):
    """From a library of small files: the held-out texts are whole files, none of them in the
    training texts train_tiny_moe.py would read from the same library."""
    from tiny_corpus import list_sources, read_corpus
    rng = np.random.default_rng(0)
    for i in range(60):
        (tmp_path / f"m{i}.py").write_text(f"x_{i} = {int(rng.integers(1000))}\n" * (1 + i % 7))
    val = perplexity.held_out_texts(tmp_path)
    train, val_again = read_corpus(list_sources(tmp_path, True, 256), 1234, 0.05, 40.0)
    assert val == val_again and val and not set(val) & set(train)


def split_dir(tmp_path, path, text, name="split"):
    """A folder as train_tiny_moe.py leaves it: val_ids.npy of the text (the model's
    tokenizer, encode_stream's packing) beside the model's tokenizer.json."""
    from tiny_corpus import encode_stream
    folder = tmp_path / name
    folder.mkdir()
    tok = perplexity.model_tokenizer(path)
    np.save(folder / "val_ids.npy", encode_stream(tok, [text.read_text(encoding="utf-8")]))
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_split_scores_the_saved_ids(tiny, tmp_path, capsys):
    """--split DIR scores the saved token ids: the same rows as --text on the text they encode."""
    src, path, text = tiny
    folder = split_dir(tmp_path, path, text)
    common = ["--windows", str(NUM_WINDOWS), "--seq-len", str(SEQ_LEN), "--types", "nvfp4"]
    by_text = perplexity.main([path, "--text", str(text), *common])
    for where in (folder, folder / "val_ids.npy"):  # the folder or the file itself
        capsys.readouterr()
        assert perplexity.main([path, "--split", str(where), *common]) == by_text
        assert f"held-out split saved in {folder}" in capsys.readouterr().out


def test_split_refuses_another_runs_ids(tiny, tmp_path):
    src, path, text = tiny
    with pytest.raises(SystemExit, match="no saved validation split"):
        perplexity.main([path, "--split", str(tmp_path), "--types", ""])
    other = split_dir(tmp_path, path, text, "other")  # another run's tokenizer beside the ids
    tok = perplexity.model_tokenizer(path)
    tok.add_tokens(["<|not the model's|>"])
    tok.save(str(other / "tokenizer.json"))
    with pytest.raises(SystemExit, match="not .*'s tokenizer"):
        perplexity.main([path, "--split", str(other), "--types", ""])
    big = split_dir(tmp_path, path, text, "big")
    np.save(big / "val_ids.npy", np.array([0, 1, tok.get_vocab_size() + 5] * 40, dtype=np.int32))
    with pytest.raises(SystemExit, match="outside"):
        perplexity.main([path, "--split", str(big), "--types", ""])
    with pytest.raises(SystemExit):  # one source of text at a time
        perplexity.main([path, "--split", str(big), "--text", str(text)])


def test_types_name_the_stored_row_or_quant_types():
    assert perplexity.parse_types("bf16,q8_0,q4_0,mxfp4,nvfp4", "bf16") == ["q8_0", "q4_0", "mxfp4", "nvfp4"]
    assert perplexity.parse_types("none,nvfp4,,nvfp4", "fp32") == ["nvfp4"]
    assert perplexity.parse_types("", "bf16") == []
    with pytest.raises(SystemExit, match="stored as bf16"):
        perplexity.parse_types("fp16,q8_0", "bf16")
    with pytest.raises(SystemExit, match="not a quant type"):
        perplexity.parse_types("q8_0,q5_k", "bf16")
