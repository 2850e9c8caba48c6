"""The OpenAI API of a live server on the bundled model (real engine, cpu), through the official
openai SDK: greedy text equals the engine's own, alone and for concurrent requests; streamed
deltas join to the whole text; usage, stop strings, seeds; the models list; and each bad
parameter gets a 400 in OpenAI's error shape."""
import threading

import openai
import pytest

from freetoken.api import default_model_path
from freetoken.config import EngineConfig
from freetoken.engine import Engine
from freetoken.sampling import SamplingParams
from serve_support import http, live_server

CTX = 160
PROMPTS = ["def fibonacci(n):", "class Cache:\n    def", "import os\n", "for i in range("]
GREEDY = dict(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def served():
    """(engine, base url, reference greedy texts per prompt): references from the engine itself
    before the server owns it."""
    engine = Engine(default_model_path(), EngineConfig(device="cpu", ctx_size=CTX))
    refs = {}
    for p in PROMPTS:
        ids = list(engine.generate(engine.tokenizer.encode(p), SamplingParams(
            temperature=0, max_tokens=GREEDY["max_tokens"])))
        refs[p] = engine.tokenizer.decode(ids)
    with live_server(engine, name="default") as (url, _):
        yield engine, url, refs
    engine.close()


@pytest.fixture
def oai(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="none", max_retries=0)


def test_models(oai):
    assert [m.id for m in oai.models.list().data] == ["default"]


def test_completion_equals_engine_greedy(served, oai):
    refs = served[2]
    for p in PROMPTS[:2]:
        r = oai.completions.create(model="default", prompt=p, **GREEDY)
        assert r.choices[0].text == refs[p]
        assert r.usage.prompt_tokens == len(served[0].tokenizer.encode(p))
        # the reference ran it first: all but its last token (always prefilled) from the cache
        assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_without_template_is_the_raw_prompt(served, oai):
    p = PROMPTS[0]
    r = oai.chat.completions.create(model="default", messages=[{"role": "user", "content": p}],
                                    **GREEDY)
    assert r.choices[0].message.content == served[2][p]
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        oai.chat.completions.create(model="default", messages=[
            {"role": "system", "content": "be brief"}, {"role": "user", "content": p}], **GREEDY)


def test_streams_join_to_the_whole_text(served, oai):
    p = PROMPTS[1]
    chunks = list(oai.chat.completions.create(
        model="default", messages=[{"role": "user", "content": p}], stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == served[2][p]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert all(c.usage is None for c in chunks[:-1])
    pieces = [c.choices[0].text for c in oai.completions.create(
        model="default", prompt=p, stream=True, **GREEDY)]
    assert "".join(pieces) == served[2][p]


def test_stop_and_max_completion_tokens(served, oai):
    p = PROMPTS[0]
    full = served[2][p]
    stop = full[3:5]
    r = oai.completions.create(model="default", prompt=p, stop=[stop], **GREEDY)
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    r = oai.chat.completions.create(model="default", messages=[{"role": "user", "content": p}],
                                    temperature=0, max_completion_tokens=2)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2


def test_ignore_eos_reaches_the_sampling_params(served, oai):
    """ignore_eos (vLLM's extension, for fixed-length benchmarks): taken by the API, handed to the
    engine's SamplingParams; off unless asked."""
    from freetoken.server.generation import sampling
    from freetoken.server.openai_schemas import CompletionRequest
    on = CompletionRequest(prompt="x", ignore_eos=True).sampling_options(8)
    assert sampling(**on).ignore_eos is True
    assert sampling(**CompletionRequest(prompt="x").sampling_options(8)).ignore_eos is False
    r = oai.completions.create(model="default", prompt=PROMPTS[0], extra_body={"ignore_eos": True},
                               **GREEDY)
    assert r.choices[0].text == served[2][PROMPTS[0]]
    assert r.usage.completion_tokens == GREEDY["max_tokens"]


def test_seed_makes_sampling_reproducible(oai):
    options = dict(model="default", prompt=PROMPTS[2], max_tokens=12, temperature=1.0,
                   top_p=1.0, extra_body={"top_k": 0, "min_p": 0})
    first, again = (oai.completions.create(seed=5, **options).choices[0].text for _ in "ab")
    assert first == again
    others = {oai.completions.create(seed=s, **options).choices[0].text for s in (6, 7, 8)}
    assert others - {first}  # other seeds do not all give seed 5's 12 tokens


def test_concurrent_requests_all_complete_with_their_own_text(served, oai):
    results, errors = {}, []

    def ask(p):
        try:
            results[p] = oai.completions.create(model="default", prompt=p, **GREEDY).choices[0].text
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == served[2]


BAD = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": CTX}, "max_tokens is 160"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 2}, "n must be 1"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "g"}},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "not among the tools"),
    ({"tool_choice": "any", "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice must be"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "no tool calls"),
    ({"frobnicate": 1}, "unknown field"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x " * CTX}]}, "--ctx-size"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "image_url"),
]


@pytest.mark.parametrize("change, message", BAD, ids=[m for _, m in BAD])
def test_bad_parameters_are_400s(served, change, message):
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], **change}
    status, r = http("POST", served[1] + "/v1/chat/completions", body)
    assert status == 400, r
    error = r["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"


def test_not_json_and_unknown_route(served):
    status, r = http("POST", served[1] + "/v1/chat/completions", raw=b"{nope")
    assert status == 400 and "not valid JSON" in r["error"]["message"]
    status, r = http("GET", served[1] + "/v1/nothing")
    assert status == 404 and r["error"]["type"] == "not_found_error"


def test_completion_token_ids_prompt(served, oai):
    ids = served[0].tokenizer.encode(PROMPTS[0])
    r = oai.completions.create(model="default", prompt=ids, **GREEDY)
    assert r.choices[0].text == served[2][PROMPTS[0]]
    with pytest.raises(openai.BadRequestError, match="token ids"):
        oai.completions.create(model="default", prompt=[10 ** 9], **GREEDY)
