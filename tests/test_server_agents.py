"""The request shapes behind the README's agent settings (section "Coding agents"), sent with the
official SDKs to a live server that wants an API key: not the agents themselves, but each
setting's base URL (with or without /v1, as each client appends its path), the auth header it
makes the client send, and the API, streaming and tools it uses. A recorded Qwen answer (thinking,
text, two tool calls) comes back through each one, and the wrong key is refused on each path.

  Claude Code  ANTHROPIC_BASE_URL=http://HOST:PORT (it appends /v1/messages), the key as
               ANTHROPIC_API_KEY (x-api-key) or ANTHROPIC_AUTH_TOKEN (Authorization: Bearer),
               streamed messages with tools, cache_control'd system blocks, beta headers
  Codex        base_url = "http://HOST:PORT/v1", wire_api = "responses" (it appends /responses),
               env_key's value as a bearer token, streamed responses with function tools
  OpenCode     @ai-sdk/openai-compatible, baseURL http://HOST:PORT/v1 (it appends
               /chat/completions), apiKey as a bearer token, streamed chat with tools"""
import json

import anthropic
import openai
import pytest

from serve_support import RecordedEngine, http, live_server, qwen_tokenizer
from test_server_parsers import THINK_AND_CALLS

KEY = "sk-agent-key"
MODEL = "qwen3"  # the id /v1/models reports (serve --model-name), as in the README
CALLS = [("get_weather", {"city": "Paris", "unit": "c"}), ("get_weather", {"city": "Zürich"})]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ASK = "What is the weather in Paris and Zürich?"


@pytest.fixture(scope="module")
def url():
    engine = RecordedEngine(qwen_tokenizer())
    engine.output = THINK_AND_CALLS
    with live_server(engine, name=MODEL, api_key=KEY) as (base, _):
        yield base


@pytest.mark.parametrize("auth", ["api_key", "auth_token"])  # x-api-key, Authorization: Bearer
def test_claude_code_settings(url, auth):
    client = anthropic.Anthropic(base_url=url, max_retries=0, **{auth: KEY})  # no /v1
    options = dict(
        model=MODEL, max_tokens=1024,
        system=[{"type": "text", "text": "You are a coding agent.",
                 "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": ASK}]}],
        tools=[{"name": "get_weather", "description": "Weather of a city",
                "input_schema": SCHEMA}],
        metadata={"user_id": "agent-session"})
    with client.beta.messages.stream(betas=["interleaved-thinking-2025-05-14"], **options) as s:
        message = s.get_final_message()
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert [(b.name, b.input) for b in message.content if b.type == "tool_use"] == CALLS
    assert message.stop_reason == "tool_use"
    count = client.messages.count_tokens(model=MODEL, messages=options["messages"],
                                         system=options["system"], tools=options["tools"])
    assert count.input_tokens == message.usage.input_tokens
    # its background requests name its own small model: the served model answers any name
    other = client.messages.create(model="claude-haiku-4-5", max_tokens=8,
                                   messages=options["messages"])
    assert other.model == MODEL and other.usage.output_tokens > 0
    wrong = anthropic.Anthropic(base_url=url, max_retries=0, **{auth: "wrong"})
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model=MODEL, max_tokens=16, messages=options["messages"])


def test_codex_settings(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)  # as a bearer
    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
              "parameters": SCHEMA, "strict": False}]
    with client.responses.stream(
            model=MODEL, instructions="You are a coding agent.", input=[
                {"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": ASK}]}],
            tools=tools, tool_choice="auto", parallel_tool_calls=True, store=False,
            reasoning={"effort": "medium"}, prompt_cache_key="session-1") as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call",
                                              "function_call"]
    assert [(i.name, json.loads(i.arguments)) for i in final.output
            if i.type == "function_call"] == CALLS
    wrong = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.responses.create(model=MODEL, input=ASK)


def test_opencode_settings(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)  # as a bearer
    assert [m.id for m in client.models.list()] == [MODEL]  # the "models" key to use
    tools = [{"type": "function", "function": {"name": "get_weather",
                                               "description": "Weather of a city",
                                               "parameters": SCHEMA}}]
    chunks = list(client.chat.completions.create(
        model=MODEL, stream=True, stream_options={"include_usage": True}, tools=tools,
        tool_choice="auto", max_tokens=1024,
        messages=[{"role": "system", "content": "You are a coding agent."},
                  {"role": "user", "content": ASK}]))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [(t.function.name, json.loads(t.function.arguments))
             for d in deltas for t in d.tool_calls or []]
    assert calls == CALLS
    assert "".join(d.content or "" for d in deltas) == "Let me check both."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens > 0
    status, body = http("POST", url + "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": ASK}]},
        headers={"Authorization": "Bearer wrong"})
    assert status == 401 and "API key" in body["error"]["message"]
