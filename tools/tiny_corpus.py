"""The tiny MoE's training text and tokenizer: the Python standard library's .py sources split
into train and validation by file, a byte-level BPE trained on train, the saved HF tokenizer files
(with the chat template) and the packed token streams. Deterministic for a given Python version
and seed. Used by tools/train_tiny_moe.py."""
from __future__ import annotations

import json
import os
import pathlib
import random

import numpy as np

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
EOT_ID, IM_END_ID = 0, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


# ------------------------------------------------------------------------------- corpus
def list_sources(root: pathlib.Path, include_tests: bool, max_file_kb: int) -> list[pathlib.Path]:
    """All .py files under root in sorted (deterministic) order, minus tests and huge files."""
    skip = SKIP_DIRS - ({"test", "tests", "idle_test"} if include_tests else set())
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for name in sorted(filenames):
            path = pathlib.Path(dirpath) / name
            if name.endswith(".py") and path.stat().st_size <= max_file_kb * 1024:
                found.append(path)
    return found


def read_corpus(paths, seed: int, val_frac: float, max_mb: float):
    """Shuffle files with `seed`, put the first ~val_frac of the bytes in validation, and fill
    train up to max_mb. Returns (train_texts, val_texts)."""
    order = list(paths)
    random.Random(seed).shuffle(order)
    texts = []
    for path in order:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            texts.append(text)
    budget = int(max_mb * 1e6)
    total = min(budget, sum(len(t) for t in texts))
    train, val, val_chars, train_chars = [], [], 0, 0
    for text in texts:
        if val_chars < val_frac * total:
            val.append(text)
            val_chars += len(text)
        elif train_chars + len(text) <= budget - val_chars:
            train.append(text)
            train_chars += len(text)
    return train, val


# ---------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, f"special token {s} got id {tok.token_to_id(s)}"
    return tok


def save_tokenizer(tok, out: pathlib.Path, max_len: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
           "eos_token": SPECIAL_TOKENS[EOT_ID], "pad_token": SPECIAL_TOKENS[EOT_ID],
           "unk_token": None, "model_max_length": max_len, "clean_up_tokenization_spaces": False,
           "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def encode_stream(tok, texts: list[str]) -> np.ndarray:
    """Token ids of all texts, each followed by <|endoftext|>, as one int32 array."""
    ids = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(EOT_ID)
    return np.asarray(ids, dtype=np.int32)
