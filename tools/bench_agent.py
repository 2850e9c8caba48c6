"""Multi-turn agent replay: TTFT per turn with and without the prefix cache (issue 32).

The session is synthetic but stated: a system prompt of --system tokens, then --turns turns,
each a tool output of --tool LO,HI tokens followed by the model's reply of --reply LO,HI
generated tokens (greedy; fewer where it ends at EOS). Token ids and lengths come from --seed.
One engine with the prefix cache runs the session; a second one without it prefills the same
prompts (one token each: TTFT is all it measures). Per turn: prompt tokens, tokens taken from
the cache, TTFT with and without it; then, from turn --from on, the p50 of each TTFT, their
ratio and the cached share of the prompt tokens.

--api N (issue 33) replays the session through the HTTP API instead: a `freetoken serve` server
in this process on 127.0.0.1, N concurrent clients (the official openai SDK, /v1/completions
with token-id prompts, streamed, usage included), each its own session (seed + its index);
first with the prefix cache, then on a server without it. Per turn and client: TTFT (request
sent -> first streamed token), decode tok/s, cached tokens (the API's usage); then TTFT
p50/p99/worst, decode tok/s and the cached share. Then the API's decode against the engine's
own (`freetoken run`'s path), side by side on the same request: client 0's last prompt with
--reply's longest reply (ignore_eos: every round the same tokens), --rounds times through the
API (one client, in a process of its own as an agent is) and then as often through
Engine.generate, every round from the same cached prefix; the medians of each and their ratio.

    python tools/bench_agent.py qwen3.ftw --expert-cache-frac 0.25         # the issue's session
    python tools/bench_agent.py --device cpu --system 256 --turns 6 --tool 32,64 --reply 4,8
--decode-beside interleave|thread: how running decodes go on beside a streamed prefill forward
(config.Tuning decode_beside; docs/MEASUREMENTS.md#decode-beside-a-streamed-prefill), e.g.

    python tools/bench_agent.py --shape qwen3-30b-a3b --api 4 --turns 6 --from 3 \
        --expert-cache-frac 0.25 --reply 32,64 --no-baseline --decode-beside thread
--edits (issue 36) replays a session whose context is edited: each turn's tool output and reply
end with the model's turn-closing token (its first EOS id); after turn i its tool output is
truncated to 8 tokens (i % 3 == 1), the turn is regenerated: its prompt again with a new reply
(i % 3 == 2), or a turn from the middle is dropped (i % 3 == 0). Replies are fixed tokens forced
through decode (a constraint), so that every mode sees the same session: (a) no reuse, (b) states
only at the end of each prefill and generation (hybrid models; others: the plain prefix cache),
(c) states at anchors. Per request: its kind, prompt tokens, the edited suffix (tokens after the
longest common prefix with the previous request's prompt + reply), then per mode the tokens
prefilled, the prefill forwards (chunks) and TTFT; then, from request --from on, the worst
prefilled / suffix of (c) and the TTFT p99 of each mode.

    python tools/bench_agent.py qwen3_next.ftw --edits --expert-cache-frac 0.25
    python tools/bench_agent.py tiny_qwen3_next.ftw --device cpu --edits --system 64 --turns 6 --tool 16,32 --reply 4,8

--shape NAME instead of a model: a synthetic model of that shape, random weights with its expert
banks built in host memory (tools/bench_shapes.py: qwen3-30b-a3b, qwen3.6-35b-a3b, gpt-oss-20b),
shared by every engine of the run; --layers, --experts, --tiny and --set KEY=VALUE shrink it.

    python tools/bench_agent.py --shape qwen3.6-35b-a3b --edits --expert-cache-frac 0.25
    python tools/bench_agent.py --shape qwen3.6-35b-a3b --layers 4 --experts 8 --tiny --device cpu \
        --edits --system 64 --turns 6 --tool 16,32 --reply 4,8
"""
import argparse
import os
import platform
import statistics

import numpy as np

from bench_shapes import ModelSource, add_shape_args


def span(text: str):
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None,
                   help="FTW model (default: the bundled one, or --shape)")
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
    p.add_argument("--prefill-chunk", type=int, default=None, help="[default: the engine's]")
    p.add_argument("--decode-beside", default="interleave", choices=("interleave", "thread"),
                   help="decodes beside a streamed prefill: between its layers or on a thread of "
                        "their own (the tuning's decode_beside)")
    p.add_argument("--step-log", metavar="FILE",
                   help="--api: the scheduler's step log (one line per step: its time, the chunks "
                        "it prefilled, its decode steps, the graphs it captured) into FILE")
    p.add_argument("--api", type=int, default=0, metavar="N",
                   help="replay through the HTTP API with N concurrent clients (0: the engine directly)")
    p.add_argument("--rounds", type=int, default=3,
                   help="--api: rounds of the API-against-engine decode comparison")
    p.add_argument("--no-baseline", action="store_true",
                   help="--api: only the server with the prefix cache (not the one without)")
    p.add_argument("--no-warm-up", action="store_true",
                   help="skip Engine.warm_up (cuda: the kernels then compile at the first "
                        "requests that need them)")
    p.add_argument("--edits", action="store_true",
                   help="a session with context edits: re-prefilled tokens per mode (see above)")
    p.add_argument("--state-budget", type=int, default=None, help="bytes of kept states (--edits)")
    add_shape_args(p)
    return p.parse_args(argv)


def session(a, vocab: int, seed=None):
    """(system ids, [(tool ids, reply length)] per turn), fixed by a.seed (or seed)."""
    rng = np.random.default_rng(a.seed if seed is None else seed)
    ids = lambda n: rng.integers(10, vocab, n).tolist()  # noqa: E731 (skips the low special ids)
    turns = [(ids(int(rng.integers(a.tool[0], a.tool[1] + 1))),
              int(rng.integers(a.reply[0], a.reply[1] + 1))) for _ in range(a.turns)]
    return ids(a.system), turns


def main(argv=None):
    a = parse_args(argv)
    if a.api:
        return api_main(a)
    if a.edits:
        return edits_main(a)
    from freetoken.config import EngineConfig, Tuning
    from freetoken.engine import Engine
    from freetoken.sampling import SamplingParams

    source = ModelSource(a)
    total = a.system + a.turns * (a.tool[1] + a.reply[1]) + 1
    options = dict(device=a.device, dtype=a.dtype, expert_cache_frac=a.expert_cache_frac,
                   policy=a.policy, ctx_size=total, parallel=1, prefill_chunk=a.prefill_chunk,
                   tuning=Tuning(decode_beside=a.decode_beside))
    rows = []
    with Engine(source(), EngineConfig(**options)) as cached, \
            Engine(source(), EngineConfig(prefix_cache=False, **options)) as cold:
        if not a.no_warm_up:  # the compiles out of the first turn (as `freetoken serve`)
            cached.warm_up(), cold.warm_up()
        system, turns = session(a, cached.model_config.vocab_size)
        device = cached.device
        print(f"# {platform.node()} {device}"
              + (f" ({__import__('torch').cuda.get_device_name(device)})"
                 if device.type == "cuda" else "")
              + f"; {source.built()}; system {a.system} tokens, {a.turns} turns, tool {a.tool}, "
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


def replay_client(url: str, a, vocab: int, k: int, out: list, last_prompt: dict) -> None:
    """Client k's session through the API: (client, turn, prompt, cached, TTFT s, decode tok/s)
    per turn into out; its last prompt into last_prompt[k]."""
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    system, turns = session(a, vocab, a.seed + k)
    prompt = list(system)
    for i, (tool, reply_len) in enumerate(turns, 1):
        prompt += tool
        n, cached, ttft, rate = api_request(client, prompt, reply_len)
        out.append((k, i, len(prompt), cached, ttft, rate))
        # the reply as the model's token ids would be re-tokenized text: keep ids exact instead
        prompt += [11] * n
    last_prompt[k] = prompt


def api_request(client, prompt: list, max_tokens: int, ignore_eos: bool = False):
    """One streamed /v1/completions request: (completion tokens, cached tokens, TTFT s, decode
    tok/s from the first streamed token to the end)."""
    import time
    t0 = time.perf_counter()
    stream = client.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True} if ignore_eos else None)
    t_first, usage = None, None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text and t_first is None:
            t_first = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
    t_end = time.perf_counter()
    n = usage.completion_tokens
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    t_first = t_first or t_end
    rate = (n - 1) / (t_end - t_first) if n > 1 and t_end > t_first else 0.0
    return n, cached or 0, t_first - t0, rate


def api_rates_from_another_process(url: str, prompt: list, max_tokens: int, rounds: int) -> list:
    """The decode tok/s of `rounds` streamed requests sent by a client in a process of its own,
    as an agent is: a client thread here would take the GIL from the server's threads between
    its SSE chunks (the session's clients above do; their TTFTs are seconds, their decode rates
    not compared)."""
    import json
    import subprocess
    import sys
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import openai, bench_agent; "
            "url, n, rounds = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]); "
            "prompt = json.loads(sys.stdin.read()); "
            "c = openai.OpenAI(base_url=url + '/v1', api_key='none', max_retries=0, timeout=3600); "
            "print(json.dumps([bench_agent.api_request(c, prompt, n, ignore_eos=True)[3] "
            "for _ in range(rounds)]))")
    out = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__)),
                          url, str(max_tokens), str(rounds)], input=json.dumps(prompt),
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def api_main(a):
    """--api N: the session through the HTTP API (module docstring)."""
    import statistics
    import threading
    from freetoken.config import EngineConfig, Tuning
    from freetoken.engine import Engine
    from freetoken.sampling import SamplingParams
    from freetoken.server.config import ServeConfig
    from freetoken.server.serve import BackgroundServer, build_app

    source = ModelSource(a)
    total = a.system + a.turns * (a.tool[1] + a.reply[1]) + 1
    options = dict(device=a.device, dtype=a.dtype, expert_cache_frac=a.expert_cache_frac,
                   policy=a.policy, ctx_size=total, parallel=a.api, prefill_chunk=a.prefill_chunk,
                   tuning=Tuning(decode_beside=a.decode_beside))
    print(f"# {platform.node()}; {source.label}; {a.api} concurrent clients through the HTTP API (openai "
          f"SDK, streamed /v1/completions); system {a.system} tokens, {a.turns} turns, tool "
          f"{a.tool}, reply {a.reply}, seed {a.seed}+client; greedy; decode beside a prefill: "
          f"{a.decode_beside}")
    results = {}
    if a.step_log:
        import logging
        open(a.step_log, "w").close()
        # append: uvicorn's logging set-up (dictConfig) closes every handler when the server
        # starts, and a closed handler opened "w" never opens again
        handler = logging.FileHandler(a.step_log, mode="a")
        handler.setFormatter(logging.Formatter("%(relativeCreated)10.0f ms %(message)s"))
        step_log = logging.getLogger("freetoken.scheduler")
        step_log.addHandler(handler)
        step_log.setLevel(logging.DEBUG)
    for cache in (True,) if a.no_baseline else (True, False):
        with Engine(source(), EngineConfig(prefix_cache=cache, **options)) as engine:
            if cache and a.shape:
                print(f"# {source.built()}", flush=True)
            if not a.no_warm_up:
                print(f"# kernels warmed in {engine.warm_up():.1f} s (as `freetoken serve` "
                      "does before it listens)", flush=True)
            app, worker = build_app(engine, ServeConfig(port=0, max_queue=4 * a.api), "bench")
            server = BackgroundServer(app).start()
            rows, last_prompt, reply_n = [], {}, a.reply[1]
            try:
                vocab = engine.model_config.vocab_size
                threads = [threading.Thread(target=replay_client,
                                            args=(server.url, a, vocab, k, rows, last_prompt))
                           for k in range(a.api)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                if cache:  # the same request through the API, then the engine (module docstring)
                    prompt = last_prompt[0][:total - reply_n]
                    api_rates = api_rates_from_another_process(server.url, prompt, reply_n,
                                                               a.rounds)
            finally:
                server.stop()
                worker.close()
            if cache:
                direct_rates = []
                for _ in range(a.rounds):
                    list(engine.generate(prompt, SamplingParams(temperature=0, max_tokens=reply_n,
                                                                ignore_eos=True)))
                    direct_rates.append(engine.last_stats.decode_tok_s)
        results[cache] = rows
        print(f"{'prefix cache' if cache else 'no prefix cache'}:")
        print(f"{'client':>6} {'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT ms':>9} {'decode tok/s':>12}")
        for k, i, n, c, ttft, rate in sorted(rows):
            print(f"{k:>6} {i:>4} {n:>7} {c:>7} {ttft * 1e3:>9.1f} {rate:>12.1f}")
    for cache, rows in results.items():
        late = [r for r in rows if r[1] >= a.start] or rows
        ttfts = sorted(r[4] for r in late)
        p99 = ttfts[min(len(ttfts) - 1, int(round(0.99 * (len(ttfts) - 1))))]
        rates = [r[5] for r in rows if r[5] > 0]
        share = sum(r[3] for r in late) / sum(r[2] for r in late)
        print(f"{'with' if cache else 'without'} the prefix cache, turns {a.start}+: TTFT p50 "
              f"{statistics.median(ttfts) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, worst (all turns) "
              f"{max(r[4] for r in rows) * 1e3:.1f} ms; decode {statistics.median(rates):.1f} tok/s "
              f"per client (median); cached {100 * share:.1f}% of prompt tokens")
    api, direct = statistics.median(api_rates), statistics.median(direct_rates)
    print(f"the same request ({len(prompt)} prompt tokens, {reply_n} generated, {a.rounds} rounds "
          f"each): API decode {api:.1f} tok/s ({', '.join(f'{r:.1f}' for r in api_rates)}), "
          f"engine directly {direct:.1f} tok/s ({', '.join(f'{r:.1f}' for r in direct_rates)}); "
          f"direct/API time per token {direct / api:.2f}")
    return results


EDITS = {1: "truncate", 2: "regenerate", 0: "drop"}  # after turn i: EDITS[i % 3]
MODES = ("a: no reuse", "b: prefill ends", "c: anchors")
TRUNCATED = 8  # tokens a tool output keeps once it has been used


def edit_session(a, vocab: int, close: int) -> list:
    """[(kind, prompt ids, reply ids)] of an edited session (module docstring), fixed by a.seed:
    kind says what changed since the previous request (append: a new tool output)."""
    rng = np.random.default_rng(a.seed)
    ids = lambda n: rng.integers(10, vocab, n).tolist()  # noqa: E731 (skips the low special ids)
    system, turns = session(a, vocab)
    segments = [system + [close]]  # system, then per kept turn its tool output and its reply
    out, kind = [], "append"
    for i, (tool, reply_len) in enumerate(turns, 1):
        segments.append(tool + [close])
        reply = ids(reply_len)
        out.append((kind, sum(segments, []), reply))
        segments.append(reply + [close])
        kind = EDITS[i % 3]
        if kind == "truncate":
            segments[-2] = tool[:TRUNCATED] + [close]
        elif kind == "regenerate":
            reply = ids(reply_len)
            segments.pop()
            out.append((kind, sum(segments, []), reply))
            segments.append(reply + [close])
        elif len(segments) > 5:  # drop: the middle kept turn (never the latest)
            j = 1 + 2 * ((len(segments) - 1) // 4)
            del segments[j:j + 2]
        kind = "append" if kind == "regenerate" else kind
    return out


class Forced:
    """A constraint (Engine.generate) that makes the generation the given token ids."""

    def __init__(self, ids: list):
        self.ids, self.i = ids, 0

    def mask(self, logits):
        out = logits.new_full(logits.shape, float("-inf"))
        out[self.ids[self.i]] = 0.0
        return out

    def advance(self, token_id: int) -> None:
        self.i += 1


def _common(x: list, y: list) -> int:
    return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))


def edits_main(a):
    """--edits: the edited session once per mode (module docstring); returns {mode: [(prefilled,
    TTFT s, prefill forwards)] per request} and the requests [(kind, prompt, reply, suffix)]."""
    from freetoken.anchors import Anchors
    from freetoken.config import EngineConfig
    from freetoken.engine import Engine
    from freetoken.sampling import SamplingParams

    source = ModelSource(a)
    total = a.system + 2 * a.turns * (a.tool[1] + a.reply[1] + 2) + 1
    options = dict(device=a.device, dtype=a.dtype, expert_cache_frac=a.expert_cache_frac,
                   policy=a.policy, ctx_size=total, parallel=1, prefill_chunk=a.prefill_chunk,
                   state_budget=a.state_budget)
    results, reqs = {}, None
    for mode in MODES:
        config = EngineConfig(prefix_cache=not mode.startswith("a"), **options)
        with Engine(source(), config) as engine:
            if not a.no_warm_up:  # the compiles out of mode (a)'s first request
                engine.warm_up()
            if reqs is None:
                close = engine.model_config.eos_token_ids[0]
                reqs, before = [], []
                for kind, prompt, reply in edit_session(a, engine.model_config.vocab_size, close):
                    reqs.append((kind, prompt, reply, max(1, len(prompt) - _common(prompt, before))))
                    before = prompt + reply
                print(f"# {platform.node()} {engine.device}; {source.built()}; system {a.system} tokens, "
                      f"{a.turns} turns, tool {a.tool}, reply {a.reply} (forced), seed {a.seed}; "
                      f"states kept: {engine.state is not None}, page {engine.kv_pages.page_size}")
            if mode.startswith("b") and engine.anchors is not None:  # no closers, no interval
                engine.anchors = Anchors(frozenset(), total + 1, engine.anchors.page_size)
            rows = results[mode] = []
            for kind, prompt, reply, _ in reqs:
                params = SamplingParams(temperature=0, max_tokens=len(reply), ignore_eos=True)
                list(engine.generate(prompt, params, Forced(reply)))
                st = engine.last_stats
                rows.append((st.num_prefilled, st.ttft_s, st.num_prefill_forwards))
    print(f"{'req':>3} {'kind':>10} {'prompt':>7} {'suffix':>6} "
          + " ".join(f"{m[:1] + ' prefill':>9} {m[:1] + ' fwd':>5} {m[:1] + ' TTFT ms':>9}"
                     for m in MODES))
    for k, (kind, prompt, _, suffix) in enumerate(reqs):
        print(f"{k:>3} {kind:>10} {len(prompt):>7} {suffix:>6} "
              + " ".join(f"{results[m][k][0]:>9} {results[m][k][2]:>5} "
                         f"{results[m][k][1] * 1e3:>9.1f}" for m in MODES))
    late = range(min(a.start, len(reqs) - 1), len(reqs))
    worst = max(results[MODES[2]][k][0] / reqs[k][3] for k in late)
    p99 = {}
    for m in MODES:
        ttfts = sorted(results[m][k][1] for k in late)
        p99[m] = ttfts[min(len(ttfts) - 1, int(round(0.99 * (len(ttfts) - 1))))]
    print(f"requests {late[0]}+: (c) prefilled <= {worst:.2f}x the edited suffix; TTFT p99 "
          + ", ".join(f"{m} {p99[m] * 1e3:.1f} ms" for m in MODES)
          + f"; (a)/(c) {p99[MODES[0]] / p99[MODES[2]]:.2f}x")
    return results, reqs


if __name__ == "__main__":
    main()
