"""tools/collect_traces.py on the bundled model: one readable trace per prompt, reproducible with
its seed, and replayable by tools/replay_cache.py; tools/make_default_model.py's checkpoint copy."""
import json

import numpy as np
import pytest

import collect_traces
import make_default_model
import replay_cache
from freetoken.trace import read_trace

PROMPTS = (("def", "def f(x):"), ("cls", "class A:\n"))


def test_one_trace_per_prompt_replayable_and_seeded(tmp_path, capsys):
    rows = collect_traces.collect(tmp_path / "a", device="cpu", max_tokens=6, prompts=PROMPTS)
    again = collect_traces.collect(tmp_path / "b", device="cpu", max_tokens=6, prompts=PROMPTS)
    assert [r["file"] for r in rows] == ["01-def.npz", "02-cls.npz"]
    for row, other, (_, prompt) in zip(rows, again, PROMPTS):
        with np.load(tmp_path / "a" / row["file"], allow_pickle=False) as npz:  # numpy's container
            assert {"ids", "meta", "phases", "steps", "version"} <= set(npz.files)
        meta, ids = read_trace(tmp_path / "a" / row["file"])
        meta2, ids2 = read_trace(tmp_path / "b" / row["file"])
        assert meta["prompt"] == prompt and row["text"] == other["text"]
        assert np.array_equal(ids, ids2)  # seed + i: same tokens, same routes
        assert (meta["phases"] == 0).sum() == row["prompt_tokens"]
        assert (meta["phases"] == 1).sum() == row["generated"] - 1
    paths = [str(tmp_path / "a" / r["file"]) for r in rows]
    assert replay_cache.main(paths + ["--capacities", "25,100"]) == 0
    assert "global_lru" in capsys.readouterr().out


def test_default_model_drops_the_chat_template(tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (src / name).write_text("{}")
    (src / "chat_template.jinja").write_text("{{ messages }}")
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "x", "chat_template": "t"}))
    out = make_default_model.strip_chat_template(src, tmp_path / "copy")
    assert not (out / "chat_template.jinja").exists()
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"eos_token": "x"}
    with pytest.raises(make_default_model.DefaultModelError, match="train_tiny_moe"):
        make_default_model.strip_chat_template(tmp_path / "nothing", tmp_path / "copy2")
