"""POST /v1/responses (stateless, function tools) through the openai SDK: a recorded Qwen answer
comes back as reasoning, message and function_call items, the streamed events accumulate (the
SDK's own accumulator) to the same output, earlier function calls and outputs in `input` are
rendered like chat completions' tool turns, and refused options are 400s."""
import json

import openai
import pytest

from serve_support import RecordedEngine, live_server, qwen_tokenizer
from test_server_parsers import MALFORMED, THINK_AND_CALLS

TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture(scope="module")
def server():
    engine = RecordedEngine(qwen_tokenizer())
    with live_server(engine) as (url, _):
        yield engine, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


@pytest.fixture
def engine(server):
    server[0].output = THINK_AND_CALLS
    return server[0]


def shape(output):
    """Output items without their generated ids."""
    out = []
    for i in output:
        d = i.model_dump(exclude_none=True)
        out.append({k: v for k, v in d.items() if k not in ("id", "call_id")})
    return out


def test_function_calls(engine, server):
    client = server[1]
    r = client.responses.create(model="m", input="weather in Paris and Zürich?", tools=[TOOL])
    assert [i.type for i in r.output] == ["reasoning", "message", "function_call",
                                          "function_call"]
    assert r.output_text == "Let me check both." and r.status == "completed"
    calls = [i for i in r.output if i.type == "function_call"]
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris", "unit": "c"},
                                                        {"city": "Zürich"}]
    assert r.usage.input_tokens == len(engine.prompts[-1])
    assert r.usage.input_tokens_details.cached_tokens == 0
    with client.responses.stream(model="m", input="weather in Paris and Zürich?",
                                 tools=[TOOL]) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert shape(final.output) == shape(r.output)
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"


def test_malformed_call_is_text_and_length_is_incomplete(engine, server):
    engine.output = MALFORMED
    r = server[1].responses.create(model="m", input="hi", tools=[TOOL])
    assert [i.type for i in r.output] == ["message"] and r.output_text == MALFORMED
    r = server[1].responses.create(model="m", input="hi", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_input_items_render_like_chat_tool_turns(engine, server):
    client = server[1]
    client.responses.create(model="m", tools=[TOOL], instructions="be brief", input=[
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C, sunny"}])
    via_responses = engine.prompts[-1]
    chat = openai.OpenAI(base_url=str(client.base_url), api_key="none", max_retries=0)
    chat.chat.completions.create(model="m", tools=[{"type": "function", "function": {
        k: v for k, v in TOOL.items() if k != "type"}}], messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}])
    assert via_responses == engine.prompts[-1]


@pytest.mark.parametrize("change, message", [
    ({"previous_response_id": "resp_1"}, "stores no responses"),
    ({"tools": [{"type": "web_search"}]}, "only function tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"bogus": 1}, "unknown field")])
def test_refused(engine, server, change, message):
    with pytest.raises(openai.BadRequestError, match=message):
        server[1].responses.create(model="m", input="hi", extra_body=change)
