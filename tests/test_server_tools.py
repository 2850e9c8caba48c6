"""Tool calls and reasoning through the live server and the official SDKs' types: a recorded Qwen
answer (RecordedEngine, real tokenizer and template) comes back as OpenAI tool_calls /
reasoning_content and Anthropic tool_use / thinking blocks, streamed and not, with the same
content; malformed tool JSON comes back as text with a normal finish; earlier tool turns are
rendered into the prompt in Qwen's format."""
import json

import anthropic
import openai
import pytest

from serve_support import RecordedEngine, live_server, qwen_tokenizer
from test_server_parsers import MALFORMED, THINK_AND_CALLS

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "weather in Paris and Zürich?"}]


@pytest.fixture(scope="module")
def server():
    engine = RecordedEngine(qwen_tokenizer())
    with live_server(engine) as (url, _):
        yield engine, url


@pytest.fixture
def engine(server):
    engine = server[0]
    engine.output, engine.endless, engine.fail = THINK_AND_CALLS, False, False
    return engine


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="none", max_retries=0)


@pytest.fixture
def claude(server):
    return anthropic.Anthropic(base_url=server[1], api_key="none", max_retries=0)


def test_openai_tool_calls(engine, oai):
    r = oai.chat.completions.create(model="m", messages=ASK, tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check both."
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"] * 2
    assert [json.loads(c.function.arguments) for c in calls] == [
        {"city": "Paris", "unit": "c"}, {"city": "Zürich"}]
    assert len({c.id for c in calls}) == 2
    assert choice.message.model_extra["reasoning_content"].startswith("The user wants")
    assert r.usage.prompt_tokens == len(engine.prompts[-1])
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_openai_streamed_tool_calls_join_to_the_same(engine, oai):
    whole = oai.chat.completions.create(model="m", messages=ASK, tools=[WEATHER])
    calls, content, reasoning, finish = {}, "", "", None
    for chunk in oai.chat.completions.create(model="m", messages=ASK, tools=[WEATHER],
                                              stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for c in delta.tool_calls or []:
            calls.setdefault(c.index, [c.function.name, ""])[1] += c.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == whole.choices[0].message.content
    assert reasoning == whole.choices[0].message.model_extra["reasoning_content"]
    assert [calls[i] for i in sorted(calls)] == [
        [c.function.name, c.function.arguments] for c in whole.choices[0].message.tool_calls]


def test_openai_malformed_tool_json_is_text(engine, oai):
    engine.output = MALFORMED
    r = oai.chat.completions.create(model="m", messages=ASK, tools=[WEATHER])
    assert r.choices[0].message.content == MALFORMED and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    text = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER], stream=True) if c.choices)
    assert text == MALFORMED


def test_without_tools_calls_stay_text(engine, oai):
    r = oai.chat.completions.create(model="m", messages=ASK)
    assert "<tool_call>" in r.choices[0].message.content and not r.choices[0].message.tool_calls
    r = oai.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="none")
    assert "<tool_call>" in r.choices[0].message.content


def test_anthropic_tool_use_and_thinking(engine, claude):
    tools = [{"name": "get_weather", "description": "Weather of a city",
              "input_schema": WEATHER["function"]["parameters"]}]
    m = claude.messages.create(model="m", max_tokens=500, messages=ASK, tools=tools)
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert m.stop_reason == "tool_use"
    assert m.content[0].thinking.startswith("The user wants")
    assert [b.input for b in m.content[2:]] == [{"city": "Paris", "unit": "c"}, {"city": "Zürich"}]
    with claude.messages.stream(model="m", max_tokens=500, messages=ASK, tools=tools) as s:
        streamed = s.get_final_message()
    assert [b.type for b in streamed.content] == [b.type for b in m.content]
    assert [b.model_dump(exclude={"id"}) for b in streamed.content] == \
        [b.model_dump(exclude={"id"}) for b in m.content]
    assert streamed.stop_reason == "tool_use" and streamed.usage.output_tokens == \
        m.usage.output_tokens


def test_anthropic_malformed_tool_json_is_text(engine, claude):
    engine.output = MALFORMED
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    with claude.messages.stream(model="m", max_tokens=500, messages=ASK, tools=tools) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["text"] and final.content[0].text == MALFORMED
    assert final.stop_reason == "end_turn"


def test_earlier_tool_turns_rendered_in_qwen_format(engine, oai, claude):
    turns = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    oai.chat.completions.create(model="m", messages=turns, tools=[WEATHER])
    openai_prompt = engine.tokenizer.decode(engine.prompts[-1], skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in openai_prompt
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in openai_prompt
    blocks = ASK + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                           "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "18 C, sunny"}]}]}]
    tools = [{"name": "get_weather", "description": "Weather of a city",
              "input_schema": WEATHER["function"]["parameters"]}]
    claude.messages.create(model="m", max_tokens=100, messages=blocks, tools=tools)
    assert engine.tokenizer.decode(engine.prompts[-1], skip_special_tokens=False) == openai_prompt
    count = claude.messages.count_tokens(model="m", messages=blocks, tools=tools)
    assert count.input_tokens == len(engine.prompts[-1])


def test_thinking_disabled_reaches_the_template(engine, claude):
    claude.messages.create(model="m", max_tokens=50, messages=ASK,
                           thinking={"type": "disabled"})
    prompt = engine.tokenizer.decode(engine.prompts[-1], skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
