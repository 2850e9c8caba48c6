"""Perplexity of a model on held-out text, as stored and with its routed experts quantized as
each `freetoken convert --quant` type stores them: one table (issue 35's quality check).

The text is by default the validation split tools/train_tiny_moe.py kept back, rebuilt with
tools/tiny_corpus.py from a Python standard library (--stdlib, default this Python's; the
bundled model's split came from Python 3.12.3's with --include-tests and seed 1234, as
tools/make_default_model.py says: another version's library shuffles into another split, so the
header line names the library used); --split DIR scores the validation token ids a
train_tiny_moe.py run saved in its --out folder DIR (val_ids.npy: exactly its held-out split,
whatever Python runs this; the folder's tokenizer.json must be the model's); --text FILE scores
a text file instead. The tokens are cut into --windows windows of --seq-len + 1
(train_tiny_moe's val_windows), each scored from a cold start.

A quantized row's model is the FTW file with every bank's values (in its dtype, widened to fp32
exactly) quantized by ftw.quant, as `convert --quant` quantizes the same values from the source
checkpoint, written to a temporary file and run by the engine on --device cpu (the CPU kernels
read the blocks). A type whose blocks do not fit the experts' shape gets a row saying why.

    python tools/perplexity.py                      # the bundled model: its dtype, q8_0 q4_0 mxfp4 nvfp4
    python tools/perplexity.py MODEL.ftw --split TRAIN_OUT_DIR     # a train_tiny_moe.py run's own split
    python tools/perplexity.py MODEL.ftw --text held_out.txt --windows 32 --seq-len 256
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import sys
import sysconfig
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import ftw  # noqa: E402
from freetoken.api import default_model_path  # noqa: E402
from freetoken.config import EngineConfig  # noqa: E402
from freetoken.engine import Engine  # noqa: E402
from ftw import constants as C, writer  # noqa: E402
from ftw.errors import QuantShapeError  # noqa: E402
from ftw.hf_source import convert_dtype  # noqa: E402

TYPES = ("q8_0", "q4_0", "mxfp4", "nvfp4")
# how tools/make_default_model.py's training run split its corpus (train_tiny_moe.py flags)
SPLIT = dict(seed=1234, include_tests=True, val_frac=0.05, max_corpus_mb=40.0, max_file_kb=256)


def held_out_texts(stdlib: pathlib.Path) -> list:
    """The validation files train_tiny_moe.py keeps back from `stdlib` with SPLIT's settings."""
    from tiny_corpus import list_sources, read_corpus
    paths = list_sources(stdlib, SPLIT["include_tests"], SPLIT["max_file_kb"])
    _, val = read_corpus(paths, SPLIT["seed"], SPLIT["val_frac"], SPLIT["max_corpus_mb"])
    return val


def model_tokenizer(path: str):
    import tokenizers
    with ftw.open(path) as f:
        tok_json = f.metadata.get(C.KEY_TOKENIZER_JSON)
    if not tok_json:
        raise SystemExit(f"error: {path} holds no tokenizer; convert it from a checkpoint with tokenizer.json")
    return tokenizers.Tokenizer.from_str(tok_json)


def ids_windows(ids: np.ndarray, seq_len: int, num: int) -> torch.Tensor:
    """The first `num` windows [num, seq_len + 1] of a token stream (val_windows' cut)."""
    n = min(num, (len(ids) - 1) // seq_len)
    if n < 1:
        raise SystemExit(f"error: the text is {len(ids)} tokens, too short for one window of {seq_len + 1}")
    return torch.stack([torch.from_numpy(ids[i * seq_len:(i + 1) * seq_len + 1].astype(np.int64))
                        for i in range(n)])


def token_windows(path: str, texts: list, seq_len: int, num: int) -> torch.Tensor:
    """The texts tokenized with the model's tokenizer (each followed by <|endoftext|>, as
    tiny_corpus.encode_stream does) -> the first `num` windows [num, seq_len + 1]."""
    from tiny_corpus import encode_stream
    return ids_windows(encode_stream(model_tokenizer(path), texts), seq_len, num)


def split_seq_len(split: pathlib.Path) -> int:
    """The window length the run that saved `split` trained and evaluated with (512, the default
    preset's, when its train_meta.json does not say)."""
    meta = (split if split.is_dir() else split.parent) / "train_meta.json"
    if meta.is_file():
        return int(json.loads(meta.read_text()).get("split", {}).get("seq_len", 512))
    return 512


def split_windows(path: str, split: pathlib.Path, seq_len: int, num: int):
    """The validation token ids train_tiny_moe.py saved in `split` (its --out folder, or the
    val_ids.npy itself) -> (windows, a line naming them). Refused when the folder's tokenizer is
    not the model's or an id is outside the model's vocabulary."""
    import tokenizers
    from tiny_corpus import load_split
    try:
        ids = load_split(split)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: --split: {e}") from None
    folder = split if split.is_dir() else split.parent
    tok = model_tokenizer(path)
    if (folder / "tokenizer.json").is_file():
        theirs = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        if theirs.get_vocab() != tok.get_vocab():
            raise SystemExit(f"error: --split {split}: its tokenizer.json is not {path}'s tokenizer "
                             f"(the ids belong to another training run)")
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= tok.get_vocab_size()):
        raise SystemExit(f"error: --split {split}: token ids outside {path}'s vocabulary of "
                         f"{tok.get_vocab_size()}")
    source = f"held-out split saved in {folder} ({len(ids):,} tokens"
    meta = folder / "train_meta.json"
    if meta.is_file():
        info = json.loads(meta.read_text())
        sp = info.get("split", {})
        source += f", {sp.get('val_files', '?')} files of python {info.get('python', '?')}'s stdlib"
    return ids_windows(ids, seq_len, num), source + ")"


def quantized_copy(path: str, quant: str, out: pathlib.Path) -> str:
    """`path` written to `out` with every bank's weights quantized as `quant` (biases, the
    bank's dtype and every tensor as they are); QuantShapeError when the experts' shape does not
    hold the type's blocks."""
    with ftw.open(path) as f:
        tensors = [writer.tensor_from_array(n, t.dtype, np.array(f.tensor(n))) for n, t in f.tensors.items()]
        banks = []
        for layer, b in f.banks.items():
            if b.quant != C.QUANT_NONE:
                raise SystemExit(f"error: {path} is already quantized ({b.quant}); give its unquantized file")
            np_dtype = C.NUMPY_DTYPES[b.dtype]
            experts = []
            for e in range(b.num_experts):
                slot = f.slot_bytes(layer, e)
                experts.append({p.name: convert_dtype(slot[p.offset:p.offset + p.nbytes].view(np_dtype),
                                                      b.dtype, "fp32").reshape(p.shape)
                                for p in b.projections})
            banks.append(writer.bank_from_arrays(layer, b.dtype, experts, quant=quant))
        writer.write(str(out), dict(f.metadata), tensors, banks, threads=2)
    return str(out)


def mean_nll(path: str, windows: torch.Tensor, dtype: str) -> float:
    """Mean next-token negative log-likelihood (nats) over every position of every window."""
    total = 0.0
    with Engine(path, EngineConfig(device="cpu", dtype=dtype, expert_cache_frac=0.0)) as engine:
        for w in windows:
            logits = engine.score(w[:-1].tolist())  # [L, V]
            total += float(F.cross_entropy(logits.float(), w[1:], reduction="sum"))
    return total / windows[:, 1:].numel()


def expert_mb(path: str) -> float:
    with ftw.open(path) as f:
        return sum(b.num_experts * sum(p.nbytes for p in b.projections) for b in f.banks.values()) / 1e6


def parse_types(types: str, dtype: str) -> list:
    """--types -> the quant types to run after the stored row, refused before anything runs when
    one is unknown. The stored row's name (`dtype`, or 'none') is allowed and dropped: that row
    always comes first."""
    quants = []
    for t in (t.strip() for t in types.split(",")):
        if not t or t in ("none", dtype) or t in quants:
            continue
        if t in C.DTYPE_SIZES:
            raise SystemExit(f"error: --types {t}: the model's experts are stored as {dtype}; its "
                             f"row is the stored one (name {dtype} or none, or leave it out)")
        if t not in C.QUANT_TYPES:
            raise SystemExit(f"error: --types {t}: not a quant type (known: {', '.join(C.QUANT_TYPES)})")
        quants.append(t)
    return quants


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="an unquantized .ftw [the bundled model]")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--split", type=pathlib.Path, metavar="DIR",
                     help="score the held-out split a train_tiny_moe.py run saved in DIR, its --out "
                          "folder (val_ids.npy), instead of rebuilding it from --stdlib")
    src.add_argument("--text", type=pathlib.Path, help="score this text file instead of the held-out split")
    ap.add_argument("--stdlib", type=pathlib.Path, default=pathlib.Path(sysconfig.get_paths()["stdlib"]),
                    help="the Python standard library the held-out split is rebuilt from [this Python's]")
    ap.add_argument("--windows", type=int, default=64, help="windows scored [64, train_tiny_moe's --eval-seqs]")
    ap.add_argument("--seq-len", type=int, help="tokens scored per window [with --split the training "
                    "run's seq_len (its train_meta.json), else 512]")
    ap.add_argument("--types", default=",".join(TYPES),
                    help="comma list of quant types; the stored row (its dtype: bf16, fp16 or "
                         "fp32, or 'none') always comes first, naming it changes nothing")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="engine compute dtype")
    args = ap.parse_args(argv)
    path = args.model or default_model_path()
    torch.manual_seed(0)
    with ftw.open(path) as f:
        dtype = next(iter(f.banks.values())).dtype
    quants = parse_types(args.types, dtype)
    if args.seq_len is None:
        args.seq_len = split_seq_len(args.split) if args.split else 512
    if args.split:
        windows, source = split_windows(path, args.split, args.seq_len, args.windows)
    else:
        if args.text:
            texts, source = [args.text.read_text(encoding="utf-8")], str(args.text)
        else:
            texts, source = held_out_texts(args.stdlib), f"held-out split of {args.stdlib}"
        windows = token_windows(path, texts, args.seq_len, args.windows)
    print(f"# {pathlib.Path(path).name} | {source} | {windows.shape[0]} windows x {args.seq_len} "
          f"tokens | engine cpu {args.dtype} | python {platform.python_version()} torch {torch.__version__}",
          flush=True)
    hdr = f"{'experts':<8} {'expert MB':>9} {'nll':>8} {'ppl':>9} {'vs ' + dtype:>9} {'s':>6}"
    print(hdr + "\n" + "-" * len(hdr), flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = None
        for quant in ["none", *quants]:
            t0 = time.perf_counter()
            name = dtype if quant == "none" else quant
            try:
                qpath = path if quant == "none" else quantized_copy(path, quant, pathlib.Path(tmp) / f"{quant}.ftw")
            except QuantShapeError as e:
                rows.append((name, None, None, None))
                print(f"{name:<8} n/a: {e}", flush=True)
                continue
            nll = mean_nll(qpath, windows, args.dtype)
            base = nll if base is None else base
            rel = (math.exp(nll) / math.exp(base) - 1) * 100
            rows.append((name, expert_mb(qpath), nll, math.exp(nll)))
            print(f"{name:<8} {rows[-1][1]:>9.2f} {nll:>8.4f} {math.exp(nll):>9.3f} {rel:>+8.2f}% "
                  f"{time.perf_counter() - t0:>6.1f}", flush=True)
    return rows


if __name__ == "__main__":
    main()
