"""Record routing traces of a model on a fixed set of prompts, one trace file per prompt.

Each prompt runs through the Python API with trace_out (the same recorder as
`freetoken run --trace-out`), so the files are what tools/replay_cache.py reads. The default
prompts fit the bundled model's corpus (Python standard library sources): code completions, a
docstring, a loop, and one chat-formatted question written out in the <|im_start|> markup the
tokenizer knows (the bundled model never saw chat data: that trace shows routing off its corpus).

    python tools/collect_traces.py docs/traces                  # bundled model, 256 tokens each
    python tools/collect_traces.py docs/traces/more --prompts more -n 320 --seed 100   # 24 more
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

# a wider set (issue 38: more and longer traces to tune cache policies on), same style of openings
MORE_PROMPTS = (
    ("json_load", "import json\n\ndef load(path):\n"),
    ("dataclass", "from dataclasses import dataclass\n\n@dataclass\nclass Point:\n"),
    ("argparse", "def main(argv=None):\n    parser = argparse.ArgumentParser("),
    ("regex", "import re\n\n_PATTERN = re.compile("),
    ("exception", "class ParseError(Exception):\n    \"\"\"Raised when"),
    ("context_mgr", "    def __enter__(self):\n        return self\n\n    def __exit__(self, "),
    ("walk", "for root, dirs, files in os.walk(top):\n"),
    ("socket", "import socket\n\ndef connect(host, port):\n"),
    ("thread", "import threading\n\nclass Worker(threading.Thread):\n    def run(self):\n"),
    ("property", "    @property\n    def name(self):\n"),
    ("test_case", "import unittest\n\nclass TestParser(unittest.TestCase):\n    def setUp(self):\n"),
    ("generator", "def chunks(iterable, size):\n    \"\"\"Yield successive chunks"),
    ("dict_merge", "def merge(a, b):\n    result = dict(a)\n    for key, value in b.items():\n"),
    ("subprocess", "import subprocess\n\ndef run(cmd):\n    proc = subprocess.Popen("),
    ("csv", "import csv\n\ndef read_rows(path):\n    with open(path, newline='') as f:\n"),
    ("logging", "import logging\n\nlogger = logging.getLogger(__name__)\n\n"),
    ("repr", "    def __repr__(self):\n        return "),
    ("sort_key", "def sort_key(item):\n    \"\"\"Return a key"),
    ("try_except", "    try:\n        value = int(text)\n    except ValueError:\n"),
    ("class_init", "class Connection:\n    def __init__(self, host, port, timeout=None):\n"),
    ("datetime", "import datetime\n\ndef parse_date(s):\n"),
    ("path", "def find_files(directory, suffix):\n    result = []\n"),
    ("struct", "import struct\n\ndef unpack_header(data):\n"),
    ("iter", "class Counter:\n    def __iter__(self):\n"),
)
PROMPT_SETS = {"default": PROMPTS, "more": MORE_PROMPTS}


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
    ap.add_argument("--prompts", default="default", choices=tuple(PROMPT_SETS),
                    help="prompt set: the 6 default ones or 24 more")
    args = ap.parse_args(argv)
    from freetoken.errors import FreetokenError
    try:
        rows = collect(args.out_dir, args.model, args.device, args.max_tokens, args.temp, args.seed,
                       PROMPT_SETS[args.prompts])
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
