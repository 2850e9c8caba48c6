"""Limits and failures of a live server (RecordedEngine: no model, exact control): the API key
(both headers, /health open), 413 over the body limit, 503 when the bounded queue is full, a
client that goes away cancels its generation, an engine failure is a 500 in the API's shape and
the server goes on, each API's error shape; /metrics, /health, /tokenize, /detokenize."""
import threading

import anthropic
import openai
import pytest

from serve_support import RecordedEngine, http, live_server, qwen_tokenizer

KEY = "sk-test-key"
CTX = 10 ** 7  # RecordedEngine keeps no KV: room for generations that only a cancel ends
ENDLESS = 10 ** 6  # tokens: minutes of streaming, unless the cancel works
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server():
    engine = RecordedEngine(qwen_tokenizer(), ctx_size=CTX)
    with live_server(engine, api_key=KEY, max_queue=2, max_body_mb=0.01) as (url, worker):
        yield engine, url, worker


@pytest.fixture
def engine(server):
    engine = server[0]
    engine.output, engine.endless, engine.fail, engine.gate = "Hi there.", False, False, None
    engine.closed.clear()
    return engine


def oai(url, key=KEY):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def test_api_key(engine, server):
    url = server[1]
    assert oai(url).chat.completions.create(model="m", messages=HELLO).choices[0].message.content \
        == "Hi there."
    with pytest.raises(openai.AuthenticationError):
        oai(url, "wrong").chat.completions.create(model="m", messages=HELLO)
    claude = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)  # sends x-api-key
    assert claude.messages.create(model="m", max_tokens=20, messages=HELLO).content[0].text == \
        "Hi there."
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=20, messages=HELLO)
    assert e.value.body["error"]["type"] == "authentication_error"
    status, body = http("GET", url + "/v1/models")
    assert status == 401 and "Authorization: Bearer" in body["error"]["message"]
    assert http("GET", url + "/health") == (200, {"status": "ok", "model": "test-model"})


def test_body_over_the_limit_is_413(engine, server):
    big = [{"role": "user", "content": "x" * 20000}]
    with pytest.raises(openai.APIStatusError) as e:
        oai(server[1]).chat.completions.create(model="m", messages=big)
    assert e.value.status_code == 413
    status, body = http("POST", server[1] + "/v1/messages", {"messages": big, "max_tokens": 5},
                        headers={"x-api-key": KEY})
    assert status == 413 and body["error"]["type"] == "request_too_large"
    chunked = iter([b'{"messages": "', b"x" * 8000, b"x" * 8000, b'"}'])  # no Content-Length
    status, body = http("POST", server[1] + "/v1/chat/completions", raw=chunked,
                        headers={"x-api-key": KEY})
    assert status == 413 and "over the server's limit" in body["error"]["message"]


def test_full_queue_is_503_and_then_drains(engine, server):
    engine.gate = threading.Event()  # admitted generations wait at their first token
    client = oai(server[1])
    streams = [client.chat.completions.create(model="m", messages=HELLO, stream=True)
               for _ in range(2)]  # returns once the response started: both are admitted
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="m", messages=HELLO)
    assert e.value.status_code == 503 and "busy" in e.value.message
    assert e.value.response.headers["retry-after"] == "1"
    engine.gate.set()
    for s in streams:
        assert "".join(c.choices[0].delta.content or "" for c in s) == "Hi there."
    assert client.chat.completions.create(model="m", messages=HELLO).choices[0].message.content \
        == "Hi there."


@pytest.mark.parametrize("streamed", [True, False])
def test_disconnect_cancels_the_generation(engine, server, streamed):
    engine.endless = True  # runs to ENDLESS tokens unless cancelled
    client = oai(server[1])
    if streamed:
        s = client.chat.completions.create(model="m", messages=HELLO, stream=True,
                                           max_tokens=ENDLESS)
        next(iter(s))
        s.close()
    else:
        with pytest.raises(openai.APITimeoutError):
            client.with_options(timeout=0.5).chat.completions.create(
                model="m", messages=HELLO, max_tokens=ENDLESS, extra_body={"top_k": 0})
    assert engine.closed.wait(60), "the generation was not cancelled"
    assert engine.last_stats.num_generated < ENDLESS
    engine.endless = False
    assert client.chat.completions.create(model="m", messages=HELLO).choices[0].message.content \
        == "Hi there."


def test_engine_failure_is_a_500_and_the_server_goes_on(engine, server):
    engine.fail = True
    client = oai(server[1])
    with pytest.raises(openai.InternalServerError, match="recorded engine failure"):
        client.chat.completions.create(model="m", messages=HELLO)
    with pytest.raises(openai.APIError, match="recorded engine failure"):
        list(client.chat.completions.create(model="m", messages=HELLO, stream=True))
    claude = anthropic.Anthropic(base_url=server[1], api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.InternalServerError) as e:
        claude.messages.create(model="m", max_tokens=20, messages=HELLO)
    assert e.value.body["error"]["type"] == "api_error"
    engine.fail = False
    assert client.chat.completions.create(model="m", messages=HELLO).choices[0].message.content \
        == "Hi there."


ANTHROPIC_BAD = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": CTX}, "--ctx-size"),
    ({"temperature": 3}, "temperature"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [{"name": "web", "type": "web_search_20250305"}]}, "server tool"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"wat": 1}, "unknown field"),
]


@pytest.mark.parametrize("change, message", ANTHROPIC_BAD, ids=[m for _, m in ANTHROPIC_BAD])
def test_anthropic_bad_parameters_are_400s(engine, server, change, message):
    body = {"model": "m", "max_tokens": 20, "messages": HELLO, **change}
    status, r = http("POST", server[1] + "/v1/messages", body, headers={"x-api-key": KEY})
    assert status == 400, r
    assert r["type"] == "error" and r["error"]["type"] == "invalid_request_error"
    assert message in r["error"]["message"]


def test_metrics_tokenize_detokenize(engine, server):
    url, auth = server[1], {"Authorization": f"Bearer {KEY}"}
    oai(url).chat.completions.create(model="m", messages=HELLO)
    status, tokens = http("POST", url + "/tokenize", {"prompt": "hello world"}, headers=auth)
    assert status == 200 and tokens["tokens"] == engine.tokenizer.encode("hello world")
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == CTX
    status, text = http("POST", url + "/detokenize", {"tokens": tokens["tokens"]}, headers=auth)
    assert (status, text) == (200, {"prompt": "hello world"})
    assert http("POST", url + "/detokenize", {"tokens": [-1]}, headers=auth)[0] == 400
    assert http("GET", url + "/v1/models")[0] == 401  # here: under xdist the module's other
    status, metrics = http("GET", url + "/metrics", headers=auth)  # tests may run elsewhere
    assert status == 200
    assert 'freetoken_requests_total{endpoint="/v1/chat/completions",status="200"}' in metrics
    assert 'freetoken_requests_total{endpoint="/v1/models",status="401"}' in metrics
    for name in ("freetoken_queue_depth 0.0", "freetoken_running_sequences 0.0",
                 "freetoken_time_to_first_token_seconds_count", "freetoken_prompt_tokens_total",
                 "freetoken_prefix_cache_hit_tokens_total 0.0", "freetoken_expert_hits_total"):
        assert name in metrics, name
