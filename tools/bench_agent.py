"""Multi-turn agent replay: TTFT per turn with and without the prefix cache (issue 32).

The session is synthetic but stated: a system prompt of --system tokens, then --turns turns,
each a tool output of --tool LO,HI tokens followed by the model's reply of --reply LO,HI
generated tokens (greedy; fewer where it ends at EOS). Token ids and lengths come from --seed.
One engine with the prefix cache runs the session; a second one without it prefills the same
prompts (one token each: TTFT is all it measures). Per turn: prompt tokens, tokens taken from
the cache, TTFT with and without it; then, from turn --from on, the p50 of each TTFT, their
ratio and the cached share of the prompt tokens.

    python tools/bench_agent.py qwen3.ftw --expert-cache-frac 0.25         # the issue's session
    python tools/bench_agent.py --device cpu --system 256 --turns 6 --tool 32,64 --reply 4,8
"""
import argparse
import platform
import statistics

import numpy as np


def span(text: str):
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None, help="FTW model (default: the bundled one)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--expert-cache-frac", type=float, default=None)
    p.add_argument("--policy", default="hybrid")
    p.add_argument("--system", type=int, default=4096, help="system prompt tokens")
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--tool", type=span, default=(300, 2000), help="tool output tokens LO,HI")
    p.add_argument("--reply", type=span, default=(100, 400), help="reply tokens LO,HI")
    p.add_argument("--from", dest="start", type=int, default=5, help="first turn of the summary")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def session(a, vocab: int):
    """(system ids, [(tool ids, reply length)] per turn), fixed by a.seed."""
    rng = np.random.default_rng(a.seed)
    ids = lambda n: rng.integers(10, vocab, n).tolist()  # noqa: E731 (skips the low special ids)
    turns = [(ids(int(rng.integers(a.tool[0], a.tool[1] + 1))),
              int(rng.integers(a.reply[0], a.reply[1] + 1))) for _ in range(a.turns)]
    return ids(a.system), turns


def main(argv=None):
    a = parse_args(argv)
    from freetoken.api import default_model_path
    from freetoken.config import EngineConfig
    from freetoken.engine import Engine
    from freetoken.sampling import SamplingParams

    path = a.model or default_model_path()
    total = a.system + a.turns * (a.tool[1] + a.reply[1]) + 1
    options = dict(device=a.device, dtype=a.dtype, expert_cache_frac=a.expert_cache_frac,
                   policy=a.policy, ctx_size=total, parallel=1)
    rows = []
    with Engine(path, EngineConfig(**options)) as cached, \
            Engine(path, EngineConfig(prefix_cache=False, **options)) as cold:
        system, turns = session(a, cached.model_config.vocab_size)
        device = cached.device
        print(f"# {platform.node()} {device}"
              + (f" ({__import__('torch').cuda.get_device_name(device)})"
                 if device.type == "cuda" else "")
              + f"; {path}; system {a.system} tokens, {a.turns} turns, tool {a.tool}, "
                f"reply {a.reply}, seed {a.seed}; greedy")
        print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT cache ms':>14} "
              f"{'TTFT cold ms':>13} {'x':>6}")
        prompt = list(system)
        for i, (tool, reply_len) in enumerate(turns, 1):
            prompt += tool
            reply = list(cached.generate(prompt, SamplingParams(temperature=0,
                                                                max_tokens=reply_len)))
            st = cached.last_stats
            list(cold.generate(prompt, SamplingParams(temperature=0, max_tokens=1)))
            cold_ttft = cold.last_stats.ttft_s
            rows.append((i, len(prompt), st.cached_tokens, st.ttft_s, cold_ttft))
            print(f"{i:>4} {len(prompt):>7} {st.cached_tokens:>7} {st.ttft_s * 1e3:>14.1f} "
                  f"{cold_ttft * 1e3:>13.1f} {cold_ttft / st.ttft_s:>6.2f}", flush=True)
            prompt += reply
    late = [r for r in rows if r[0] >= a.start] or rows
    p50_cache = statistics.median(r[3] for r in late)
    p50_cold = statistics.median(r[4] for r in late)
    share = sum(r[2] for r in late) / sum(r[1] for r in late)
    print(f"turns {late[0][0]}..{late[-1][0]}: TTFT p50 {p50_cache * 1e3:.1f} ms with the cache, "
          f"{p50_cold * 1e3:.1f} ms without ({p50_cold / p50_cache:.2f}x); "
          f"{100 * share:.1f}% of prompt tokens from the cache")
    return rows


if __name__ == "__main__":
    main()
