"""`freetoken bench` on a bench shape that has no .ftw file (bench_shapes.SyntheticFile), for the
cells bench_decode.py measures: the user's command's numbers (the engine's own prefill and decode
timings, its real router on random weights) beside the developer bench's (synthetic routing
traces on the same banks). Prints `freetoken bench`'s markdown table.

    python3 tools/bench_cli_cells.py --shape qwen3-30b-a3b --expert-cache-frac 0.25 \\
        --policy hybrid,offload,cpu -p 512 -n 64 -r 2
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_shapes import SHAPES, SyntheticFile  # noqa: E402
from freetoken.api import engine_config  # noqa: E402
from freetoken.bench import make_config, report, run_bench  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--tiny", action="store_true", help="the shape's CPU-test size")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("-p", "--n-prompt", default="512")
    ap.add_argument("-n", "--n-gen", default="64")
    ap.add_argument("--expert-cache-frac", default="0.25")
    ap.add_argument("--policy", default="hybrid,offload,cpu")
    ap.add_argument("-r", "--repetitions", default="2")
    ap.add_argument("--device", default="auto")
    ap.add_argument("-o", "--output", default="md")
    a = ap.parse_args(argv)
    file = SyntheticFile(a.shape, layers=a.layers, experts=a.experts, tiny=a.tiny)
    print(file.describe(), flush=True)
    config = make_config(a.n_prompt, a.n_gen, None, a.expert_cache_frac, a.policy,
                         a.repetitions, "1")
    report(run_bench(file, config, engine_config(device=a.device)), a.output,
           lambda line: print(line, flush=True))
    print(file.describe(), flush=True)  # with the banks' build rate


if __name__ == "__main__":
    main()
