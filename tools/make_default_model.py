"""Build the model bundled in the package (freetoken/data/default.ftw) from a trained checkpoint.

The bundled model is the small qwen3_moe that tools/train_tiny_moe.py trains on the Python
standard library's sources (6 layers x 32 experts, top-4, vocab 4096, ~9.4M parameters, bf16,
~19 MB). This script converts that HF checkpoint with ftw.convert, WITHOUT its chat template:
the model only ever saw raw source code, so `run` must send prompts as they are (a template
would wrap `def fibonacci(n):` in role markers the model never saw, and it then writes noise).

The bundled file was made by (on the H200 host, ~4.5 minutes of training, seed 1234):

    PYTHONUNBUFFERED=1 python tools/train_tiny_moe.py --out tiny-moe --minutes 4.5 --include-tests
    python tools/make_default_model.py --from-checkpoint tiny-moe   # writes freetoken/data/default.ftw

It kept the step-500 weights (best validation loss 2.7172 on 64 windows; 2.2652 on all 295
validation windows of the final evaluation), Python 3.12.3 stdlib, torch 2.11, transformers 5.17.
Reproducible up to the last bits of GPU kernels (see train_tiny_moe.py); tests pin the shipped
file's greedy tokens, not the training run's.
"""
import argparse
import json
import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "freetoken" / "data" / "default.ftw"
MAX_BYTES = 24 * 2 ** 20  # keeps the wheel small; the trained default is ~19 MB
CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                    "tokenizer_config.json", "train_meta.json")


class DefaultModelError(Exception):
    """The checkpoint cannot become the bundled model (missing files, over the size budget)."""


def strip_chat_template(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """Copy of checkpoint src in dst without chat_template.jinja or tokenizer_config's template."""
    if not (src / "config.json").is_file() or not (src / "model.safetensors").is_file():
        raise DefaultModelError(f"{src} is not a train_tiny_moe.py checkpoint (no config.json / "
                                "model.safetensors): pass the --out folder of that script")
    dst.mkdir(parents=True, exist_ok=True)
    for name in CHECKPOINT_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    cfg_path = dst / "tokenizer_config.json"
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text())
        cfg.pop("chat_template", None)
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return dst


def build(checkpoint, out_path=DEFAULT_OUT) -> pathlib.Path:
    """Converts the trained checkpoint (chat template dropped) to out_path."""
    from ftw.convert import convert

    out_path = pathlib.Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = strip_chat_template(pathlib.Path(checkpoint), pathlib.Path(tmp) / "hf")
        convert(str(src), str(out_path), dtype="auto", force=True, progress=False)
    size = out_path.stat().st_size
    if size > MAX_BYTES:
        raise DefaultModelError(f"{out_path} is {size} bytes, over the {MAX_BYTES}-byte budget: "
                                "train a smaller preset")
    return out_path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--from-checkpoint", required=True, type=pathlib.Path,
                   help="HF checkpoint folder written by tools/train_tiny_moe.py --out")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="output .ftw path")
    args = p.parse_args(argv)
    try:
        out = build(args.from_checkpoint, args.out)
    except DefaultModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    meta_path = args.from_checkpoint / "train_meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    print(f"wrote {out} ({out.stat().st_size / 2 ** 20:.2f} MiB) from {args.from_checkpoint} "
          f"(train_meta: {meta or 'none'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
