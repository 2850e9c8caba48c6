"""The prefix cache and the KV pages behind a live server on the bundled model (real engine, cpu):
a repeated or extended prompt reports its cached tokens through the openai and anthropic SDKs
with the same greedy text, /metrics counts them, and a client that leaves mid-stream gives
every KV page back (free, or in the prefix tree)."""
import re
import threading

import anthropic
import openai
import pytest

from freetoken.api import default_model_path
from freetoken.config import EngineConfig
from freetoken.engine import Engine
from freetoken.kv_cache import PAGE_SIZE
from serve_support import http, live_server

CTX = 512
# long enough for whole pages of cache (a page holds PAGE_SIZE tokens)
PROMPT = ("def read_config(path):\n    \"\"\"Reads the settings file at path and returns them as a "
          "dict of names to values, skipping comments and blank lines.\"\"\"\n    settings = {}\n"
          "    with open(path) as f:\n        for line in f:\n")
GREEDY = dict(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def served():
    """(engine, base url, worker) of a fresh server: the prefix cache starts empty."""
    engine = Engine(default_model_path(), EngineConfig(device="cpu", ctx_size=CTX))
    assert len(engine.tokenizer.encode(PROMPT)) > PAGE_SIZE
    with live_server(engine, name="default") as (url, worker):
        yield engine, url, worker
    engine.close()


def hit_tokens(url) -> float:
    status, text = http("GET", url + "/metrics")
    assert status == 200
    return float(re.search(r"^freetoken_prefix_cache_hit_tokens_total (\S+)$", text, re.M)[1])


def test_openai_repeated_and_extended_prompts_report_cached_tokens(served):
    engine, url, worker = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    before = hit_tokens(url)
    first = client.completions.create(model="default", prompt=PROMPT, **GREEDY)
    again = client.completions.create(model="default", prompt=PROMPT, **GREEDY)
    assert again.choices[0].text == first.choices[0].text
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == again.usage.prompt_tokens - 1  # all but the last token, always prefilled
    # the next turn: the prompt with the answer and more text after it
    turn = PROMPT + first.choices[0].text + "\n    return settings\n"
    chat = [{"role": "user", "content": turn}]  # (no template: the one message is the prompt)
    whole = client.chat.completions.create(model="default", messages=chat, **GREEDY)
    assert whole.usage.prompt_tokens_details.cached_tokens >= cached
    streamed = client.chat.completions.create(model="default", messages=chat, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= \
        whole.usage.prompt_tokens_details.cached_tokens
    reused = cached + whole.usage.prompt_tokens_details.cached_tokens + \
        chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert hit_tokens(url) - before == reused
    assert worker.wait_idle(60)
    engine.kv_manager.check_idle()


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_repeated_prompt_reads_the_cache(served, stream):
    engine, url, worker = served
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    options = dict(model="default", max_tokens=8, extra_body={"temperature": 0},
                   messages=[{"role": "user", "content": PROMPT + " # anthropic"}])

    def ask():
        if stream:
            with client.messages.stream(**options) as s:
                return s.get_final_message()
        return client.messages.create(**options)
    first, again = ask(), ask()
    assert again.content == first.content
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == \
        first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)


@pytest.mark.parametrize("streamed", [True, False])
def test_client_leaving_mid_generation_frees_its_pages(served, streamed, monkeypatch):
    """The engine is held at its next step once a token is out until the server has seen the
    client go, so the cancel always lands mid-generation (at that step, or just before it where
    the worker sees the cancel between a token's post and the next step)."""
    engine, url, worker = served
    gate, step, start = threading.Event(), engine.step, worker._start
    jobs = []

    def held():
        if any(r.num_generated for r in engine.scheduler.running):
            assert gate.wait(60), "the test never opened the gate"
        step()

    def started(job):
        jobs.append(job)
        start(job)
    monkeypatch.setattr(engine, "step", held)
    monkeypatch.setattr(worker, "_start", started)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    options = dict(model="default", prompt=PROMPT + " # leaving", temperature=0, max_tokens=100)
    if streamed:
        s = client.completions.create(stream=True, **options)
        next(iter(s))
        s.close()
    else:
        with pytest.raises(openai.APITimeoutError):
            client.with_options(timeout=1).completions.create(**options)
    assert len(jobs) == 1 and jobs[0].cancelled.wait(60), "the disconnect did not cancel the job"
    gate.set()
    assert worker.wait_idle(60)
    assert engine.last_stats.stop_reason == "interrupted"
    assert 0 < engine.last_stats.num_generated < options["max_tokens"]
    engine.kv_manager.check_idle()
    assert engine.kv_manager.pool.num_free + engine.kv_manager.radix.num_pages == \
        engine.kv_manager.pool.num_pages
    monkeypatch.undo()  # the server goes on with the next request
    again = client.completions.create(**options | {"max_tokens": 4})
    assert again.usage.prompt_tokens_details.cached_tokens > 0
