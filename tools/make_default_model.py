"""Build the model bundled in the package (freetoken/data/default.ftw): a tiny random qwen3_moe
from make_tiny_model.build, converted with ftw.convert. Deterministic: the same seed gives the
same checkpoint, so tests can rebuild the HF checkpoint and compare against transformers.

Placeholder until a trained model replaces it (issue 6); kept under 2 MB (fp32, so `run` on the
CPU matches transformers exactly).

    python tools/make_default_model.py            # writes freetoken/data/default.ftw
    python tools/make_default_model.py --out X.ftw
"""
import argparse
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "freetoken" / "data" / "default.ftw"
MAX_BYTES = 2 * 2 ** 20

# What the bundled model is: every field is passed to make_tiny_model.build.
SPEC = dict(family="qwen3_moe", layout="per_expert", dtype="fp32", seed=1234)


def build_checkpoint(out_dir) -> pathlib.Path:
    """The HF checkpoint (safetensors + tokenizer) behind the bundled model, in out_dir."""
    sys.path.insert(0, str(ROOT / "tools"))
    import make_tiny_model
    return make_tiny_model.build(out_dir, **SPEC)


def build(out_path=DEFAULT_OUT) -> pathlib.Path:
    """Builds the checkpoint in a temporary folder and converts it to out_path."""
    from ftw.convert import convert

    out_path = pathlib.Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = build_checkpoint(pathlib.Path(tmp) / "hf")
        convert(str(src), str(out_path), dtype="auto", force=True, progress=False)
    size = out_path.stat().st_size
    if size > MAX_BYTES:
        raise SystemExit(f"error: {out_path} is {size} bytes, over the {MAX_BYTES}-byte budget")
    return out_path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(DEFAULT_OUT), help="output .ftw path")
    args = p.parse_args(argv)
    out = build(args.out)
    print(f"wrote {out} ({out.stat().st_size / 2 ** 20:.2f} MiB, {SPEC})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
