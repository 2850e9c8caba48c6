"""A bounded soak of a live server on the bundled model (real engine, cpu): 8 client threads x 40
requests (10 in the default run; the 40 are marked slow) mixing the APIs, streamed and whole, logprobs and grammars, clients that leave early
and bad inputs. No 5xx (as the clients saw them and as /metrics counted them), every request
answered within its timeout, and afterwards every KV page free or in the prefix tree."""
import random
import re
import threading

import anthropic
import openai
import pytest

from freetoken.api import default_model_path
from freetoken.config import EngineConfig
from freetoken.engine import Engine
from serve_support import http, live_server

THREADS = 8
TIMEOUT_S = 60  # per request; a request past it is a hang
CTX, KV_TOKENS = 192, 768  # a small pool: finished prompts' pages are evicted as others come
HEADS = ["def read_config(path):\n    \"\"\"Reads the settings file and returns a dict.\"\"\"\n",
         "class ExpertCache:\n    \"\"\"Keeps the hottest experts on the GPU.\"\"\"\n    def",
         "import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n"]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                  "maximum": 9}}, "required": ["n"]}


def prompt(rng) -> str:
    """A shared head (cache hits) and a varied tail, sometimes several pages long."""
    return rng.choice(HEADS) + "    x = %d\n" % rng.randrange(100) * rng.choice([1, 4, 12])


def status_of(error) -> int:
    return getattr(error, "status_code", None) or 0


def one_request(kind: str, rng, url: str) -> int:
    """Runs one request of kind; returns the HTTP status the client saw (0: left early)."""
    oai = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)
    chat = dict(model="default", messages=[{"role": "user", "content": prompt(rng)}],
                max_tokens=rng.choice([1, 4, 8]), temperature=rng.choice([0, 0.8]),
                seed=rng.randrange(1000))
    if kind == "chat":
        r = oai.chat.completions.create(**chat)
        assert r.choices[0].finish_reason in ("stop", "length")
    elif kind == "chat_stream":
        chunks = list(oai.chat.completions.create(stream=True, logprobs=True, top_logprobs=2,
                                                  stream_options={"include_usage": True}, **chat))
        assert chunks[-1].usage.completion_tokens >= 1
    elif kind == "completion":
        r = oai.completions.create(model="default", prompt=prompt(rng), max_tokens=4, logprobs=1)
        # (usage counts an EOS; logprobs cover the tokens of the text)
        assert len(r.choices[0].logprobs.tokens) in (r.usage.completion_tokens - 1,
                                                      r.usage.completion_tokens)
    elif kind == "grammar":
        oai.chat.completions.create(response_format={"type": "json_schema", "json_schema": {
            "name": "n", "schema": SCHEMA}}, **chat | {"max_tokens": 12})
    elif kind == "anthropic":
        claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0,
                                     timeout=TIMEOUT_S)
        with claude.messages.stream(model="default", max_tokens=4, messages=chat["messages"]) \
                as s:
            assert s.get_final_message().usage.output_tokens >= 1
    elif kind == "leave_stream":
        s = oai.completions.create(model="default", prompt=prompt(rng), max_tokens=64,
                                   stream=True)
        next(iter(s))
        s.close()
        return 0
    elif kind == "leave_whole":
        try:
            oai.with_options(timeout=0.05).completions.create(model="default", max_tokens=64,
                                                               prompt=prompt(rng))
        except openai.APITimeoutError:
            return 0
    elif kind == "bad":
        body = rng.choice([{"max_tokens": 0}, {"temperature": -1}, {"frobnicate": 1},
                           {"max_tokens": CTX}, {"response_format": {"type": "json_schema",
                            "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}])
        status, r = http("POST", url + "/v1/chat/completions", {**chat, **body})
        assert status == 400 and r["error"]["type"] == "invalid_request_error", r
        return status
    elif kind == "not_json":
        status, _ = http("POST", url + "/v1/messages", raw=b"{nope")
        assert status == 400
        return status
    return 200


KINDS = ["chat", "chat_stream", "completion", "grammar", "anthropic", "leave_stream",
         "leave_whole", "bad", "not_json"]


@pytest.mark.parametrize("requests", [10, pytest.param(40, marks=pytest.mark.slow)])
def test_soak(requests):
    engine = Engine(default_model_path(), EngineConfig(device="cpu", ctx_size=CTX,
                                                       kv_tokens=KV_TOKENS))
    with live_server(engine, name="default") as (url, worker):
        seen, failures = [], []

        def client(i):
            rng = random.Random(i)
            for _ in range(requests):
                kind = rng.choice(KINDS)
                try:
                    seen.append((kind, one_request(kind, rng, url)))
                except Exception as e:  # every failure is reported below, with its kind
                    failures.append((kind, status_of(e), f"{type(e).__name__}: {e}"))

        threads = [threading.Thread(target=client, args=(i,), daemon=True)
                   for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S * requests)
        assert not any(t.is_alive() for t in threads), "a client hung"
        assert not failures, failures[:5]
        assert len(seen) == THREADS * requests
        assert {k for k, _ in seen} == set(KINDS)
        assert worker.wait_idle(TIMEOUT_S), "the engine did not go idle"
        engine.kv_manager.check_idle()
        assert engine.kv_manager.radix.num_pages > 0  # the cache was used, and is still there
        status, metrics = http("GET", url + "/metrics")
        counted = re.findall(r'^freetoken_requests_total\{endpoint="[^"]*",status="(\d+)"\}',
                             metrics, re.M)
        assert counted and not [s for s in counted if s.startswith("5")], metrics
        assert float(re.search(r"^freetoken_prefix_cache_hit_tokens_total (\S+)$", metrics,
                               re.M)[1]) > 0
        assert http("GET", url + "/health")[0] == 200
    engine.close()
