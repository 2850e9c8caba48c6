"""The tiny MoE's training text and tokenizer: the Python standard library's .py sources split
into train and validation by file, a byte-level BPE trained on train, the saved HF tokenizer files
(with the chat template), the packed token streams, and the held-out split saved next to the
checkpoint (save_split / load_split). Deterministic for a given Python version and seed. Used by
tools/train_tiny_moe.py and tools/perplexity.py."""
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


def split_corpus(paths, seed: int, val_frac: float, max_mb: float):
    """Shuffle files with `seed`, put the first ~val_frac of the bytes in validation, and fill
    train up to max_mb. Returns (train, val), each a list of (path, text) in that order."""
    order = list(paths)
    random.Random(seed).shuffle(order)
    files = []
    for path in order:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            files.append((path, text))
    budget = int(max_mb * 1e6)
    total = min(budget, sum(len(t) for _, t in files))
    train, val, val_chars, train_chars = [], [], 0, 0
    for path, text in files:
        if val_chars < val_frac * total:
            val.append((path, text))
            val_chars += len(text)
        elif train_chars + len(text) <= budget - val_chars:
            train.append((path, text))
            train_chars += len(text)
    return train, val


def read_corpus(paths, seed: int, val_frac: float, max_mb: float):
    """split_corpus's texts only: (train_texts, val_texts)."""
    train, val = split_corpus(paths, seed, val_frac, max_mb)
    return [t for _, t in train], [t for _, t in val]


# ------------------------------------------------------------------- the held-out split
# tools/train_tiny_moe.py writes these next to its checkpoint; tools/perplexity.py --split reads
# them, so the held-out text is the one the trainer kept back whatever Python reads it later.
VAL_IDS, VAL_FILES = "val_ids.npy", "val_files.txt"


def save_split(out: pathlib.Path, root: pathlib.Path, val_paths, val_ids: np.ndarray) -> None:
    """The validation stream's token ids (int32, encode_stream's packing) and its files (paths
    relative to the library root, in stream order, one a line)."""
    np.save(out / VAL_IDS, np.asarray(val_ids, dtype=np.int32))
    names = [pathlib.Path(p).relative_to(root).as_posix() for p in val_paths]
    (out / VAL_FILES).write_text("".join(n + "\n" for n in names), encoding="utf-8")


def load_split(where: pathlib.Path) -> np.ndarray:
    """The validation token ids save_split wrote: `where` is the trainer's --out folder or the
    .npy file itself."""
    where = pathlib.Path(where)
    path = where / VAL_IDS if where.is_dir() else where
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no saved validation split (train_tiny_moe.py writes "
                                f"{VAL_IDS} into its --out folder)")
    ids = np.load(path, allow_pickle=False)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(f"{path}: expected a 1-d integer array, got {ids.dtype} {ids.shape}")
    return ids


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
