"""Record routing traces of a model on a fixed set of prompts, one trace file per prompt.

Each prompt runs through the Python API with trace_out (the same recorder as
`freetoken run --trace-out`), so the files are what tools/replay_cache.py reads. The default
prompts fit the bundled model's corpus (Python standard library sources): code completions, a
docstring, a loop, and one chat-formatted question written out in the <|im_start|> markup the
tokenizer knows (the bundled model never saw chat data: that trace shows routing off its corpus).

    python tools/collect_traces.py docs/traces                  # bundled model, 256 tokens each
    python tools/collect_traces.py OUT --model m.ftw --temp 0   # greedy
    python tools/replay_cache.py OUT/*.npz --png OUT/miss_rate.png

Sampling is seeded (prompt i uses --seed + i), so the same model, options and device give the
same traces. Prints one line per prompt: tokens, stop reason, and the start of the text.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

# (file stem, prompt); sent as is, without any chat template
PROMPTS = (
    ("fibonacci", "def fibonacci(n):"),
    ("stack", "class Stack:\n    def __init__(self):"),
    ("import_os", "import os\n"),
    ("docstring", 'def read_config(path):\n    """Read the configuration file at *path* and return '
                  'a dict of its sections."""\n'),
    ("for_loop", "    for i, line in enumerate(lines):\n"),
    ("chat_question", "<|im_start|>user\nHow do I reverse a list in Python?<|im_end|>\n"
                      "<|im_start|>assistant\n"),
)


def collect(out_dir, model=None, device="auto", max_tokens=256, temperature=0.8, seed=0,
            prompts=PROMPTS) -> list[dict]:
    """Runs every prompt with a fresh traced engine; returns one summary dict per prompt."""
    from freetoken import LLM

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (stem, prompt) in enumerate(prompts):
        path = out / f"{i + 1:02d}-{stem}.npz"
        # one engine per prompt: a traced engine writes one file, holding its latest generation
        with LLM(model, device=device, trace_out=str(path)) as llm:
            text = llm.generate(prompt, chat=False, max_tokens=max_tokens,
                                temperature=temperature, seed=seed + i)
            st = llm.stats
            rows.append({"file": path.name, "prompt": prompt, "text": text,
                         "prompt_tokens": len(llm.encode(prompt, chat=False)),
                         "generated": st.num_generated, "stop": st.stop_reason,
                         "bytes": path.stat().st_size})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", help="folder for the .npz files (created)")
    ap.add_argument("--model", default=None, help="model .ftw [default: the bundled model]")
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("-n", "--max-tokens", type=int, default=256, help="tokens to generate per prompt")
    ap.add_argument("--temp", type=float, default=0.8, help="temperature (0 = greedy)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the first prompt (+1 per prompt)")
    args = ap.parse_args(argv)
    from freetoken.errors import FreetokenError
    try:
        rows = collect(args.out_dir, args.model, args.device, args.max_tokens, args.temp, args.seed)
    except FreetokenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for r in rows:
        head = r["text"].strip().splitlines()[0][:60] if r["text"].strip() else ""
        print(f"{r['file']:<24} prompt {r['prompt_tokens']:>3} tok, generated {r['generated']:>3} "
              f"({r['stop']}), {r['bytes']:>6} B  {head!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
