"""response_format and forced tool_choice through a live server on the bundled model (real
engine, cpu, greedy): the tiny model's own text is not JSON, but the grammar (llguidance) makes
the output parse and follow the schema, whole and streamed; json_object gives an object; with a
Qwen-format chat template, tool_choice "required" or named makes it call the tools with valid
arguments; a schema the library refuses, or a malformed response_format, is a 400 in OpenAI's
error shape. The same through POST /v1/responses (text.format, tool_choice)."""
import json

import anthropic
import openai
import pytest

from freetoken.api import default_model_path
from freetoken.config import EngineConfig
from freetoken.engine import Engine
from freetoken.tokenizer import Tokenizer
from serve_support import QWEN_TEMPLATE, live_server

TAGS = ["cpu", "gpu", "disk"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": TAGS}, "maxItems": 3}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA}}
PROMPT = [{"role": "user", "content": "Give the user as JSON:\n"}]  # (no template: raw text)


@pytest.fixture(scope="module")
def oai():
    engine = Engine(default_model_path(), EngineConfig(device="cpu", ctx_size=256))
    with live_server(engine, name="default") as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    engine.close()


def follows_schema(value) -> bool:
    return (isinstance(value, dict) and set(value) == {"name", "age", "tags"}
            and isinstance(value["name"], str) and len(value["name"]) <= 12
            and type(value["age"]) is int and 0 <= value["age"] <= 150
            and isinstance(value["tags"], list) and len(value["tags"]) <= 3
            and all(t in TAGS for t in value["tags"]))


def ask(oai, stream=False, **options):
    options = {"model": "default", "messages": PROMPT, "temperature": 0, "max_tokens": 80,
               **options}
    if stream:
        chunks = list(oai.chat.completions.create(stream=True, **options))
        return ("".join(c.choices[0].delta.content or "" for c in chunks),
                chunks[-1].choices[0].finish_reason)
    choice = oai.chat.completions.create(**options).choices[0]
    return choice.message.content, choice.finish_reason


def test_without_a_format_the_model_writes_no_json(oai):
    text, _ = ask(oai)
    with pytest.raises(ValueError):
        json.loads(text)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_follows_the_schema(oai, stream):
    text, reason = ask(oai, stream, response_format=FORMAT)
    assert reason == "stop" and follows_schema(json.loads(text)), text
    assert text == ask(oai, not stream, response_format=FORMAT)[0]


def test_json_object_output_is_an_object(oai):
    text, reason = ask(oai, response_format={"type": "json_object"},
                       messages=[{"role": "user", "content": "The answer, as JSON: "}])
    assert reason == "stop" and isinstance(json.loads(text), dict), text


BAD = [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
     "nonsense"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}},
     "nowhere"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema"),
    ({"type": "yaml"}, "json_object or json_schema"),
]


@pytest.mark.parametrize("fmt, message", BAD, ids=[m for _, m in BAD])
def test_bad_format_is_a_400(oai, fmt, message):
    with pytest.raises(openai.BadRequestError) as e:
        ask(oai, response_format=fmt)
    error = e.value.body
    assert error["type"] == "invalid_request_error" and error["param"] == "response_format"
    assert message in error["message"]


def respond(oai, stream=False, **options):
    """(output text, status, output items) of a greedy /v1/responses request."""
    options = {"model": "default", "input": PROMPT[0]["content"], "temperature": 0,
               "max_output_tokens": 80, **options}
    if stream:
        with oai.responses.stream(**options) as s:
            r = s.get_final_response()
    else:
        r = oai.responses.create(**options)
    return r.output_text, r.status, r.output


@pytest.mark.parametrize("stream", [False, True])
def test_responses_json_schema_follows_the_schema(oai, stream):
    fmt = {"type": "json_schema", "name": "user", "schema": SCHEMA, "strict": True}
    text, status, _ = respond(oai, stream, text={"format": fmt})
    assert status == "completed" and follows_schema(json.loads(text)), text
    assert text == ask(oai, response_format=FORMAT)[0]  # the same grammar as chat completions'
    assert respond(oai)[0] != text  # (the model's own text)


def test_responses_json_object_is_an_object(oai):
    text, status, _ = respond(oai, input="The answer, as JSON: ",
                              text={"format": {"type": "json_object"}})
    assert status == "completed" and isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("fmt, message", [
    ({"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}, "nonsense"),
    ({"type": "json_schema", "name": "x"}, "needs schema"),
    ({"type": "yaml"}, "json_object or json_schema")])
def test_responses_bad_format_is_a_400(oai, fmt, message):
    with pytest.raises(openai.BadRequestError) as e:
        respond(oai, text={"format": fmt})
    assert e.value.body["param"] == "text" and message in e.value.body["message"]


CITIES = ["Paris", "Zürich"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "required": ["city"],
                                          "properties": {"city": {"enum": CITIES}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def qwen_oai():
    """A client of the bundled model with a Qwen-format template (tool calls in <tool_call>)."""
    engine = Engine(default_model_path(), EngineConfig(device="cpu", ctx_size=512))
    tok = engine.tokenizer
    engine.tokenizer = Tokenizer(tok.to_json(), QWEN_TEMPLATE, tok.bos_token_id,
                                 tok.eos_token_ids)
    with live_server(engine, name="default") as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    engine.close()


@pytest.fixture
def qwen_claude(qwen_oai):
    return anthropic.Anthropic(base_url=str(qwen_oai.base_url).removesuffix("/v1/"),
                               api_key="none", max_retries=0)


def calls_of(oai, stream=False, **options):
    """(tool calls as (name, arguments), content, finish_reason) of a greedy chat."""
    options = {"model": "default", "messages": ASK, "temperature": 0, "max_tokens": 120,
               "tools": [WEATHER, TIME], **options}
    if not stream:
        choice = oai.chat.completions.create(**options).choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments))
                 for c in choice.message.tool_calls or []]
        return calls, choice.message.content, choice.finish_reason
    chunks = [c.choices[0] for c in oai.chat.completions.create(stream=True, **options)]
    calls = [(c.function.name, json.loads(c.function.arguments))
             for chunk in chunks for c in chunk.delta.tool_calls or []]
    return calls, "".join(c.delta.content or "" for c in chunks) or None, chunks[-1].finish_reason


def test_without_tool_choice_the_model_calls_nothing(qwen_oai):
    calls, content, reason = calls_of(qwen_oai)
    assert not calls and content and reason in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_calls_a_tool(qwen_oai, stream):
    calls, content, reason = calls_of(qwen_oai, stream, tool_choice="required",
                                      parallel_tool_calls=False)
    assert reason == "tool_calls" and not content and len(calls) == 1
    name, arguments = calls[0]
    assert (name, list(arguments)) in (("get_weather", ["city"]), ("get_time", ["zone"]))
    assert arguments.get("city", CITIES[0]) in CITIES


def test_named_tool_choice_calls_that_tool(qwen_oai):
    choice = {"type": "function", "function": {"name": "get_time"}}
    calls, content, reason = calls_of(qwen_oai, tool_choice=choice, parallel_tool_calls=False)
    assert reason == "tool_calls" and len(calls) == 1
    assert calls[0][0] == "get_time" and calls[0][1]["zone"] in ("UTC", "CET")


def test_parallel_calls_are_all_tool_calls(qwen_oai):
    calls, content, _ = calls_of(qwen_oai, tool_choice="required", max_tokens=60)
    assert calls and all(name in ("get_weather", "get_time") for name, _ in calls)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_anthropic_tool_choice_forces_a_tool_use(qwen_claude, choice, stream):
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
             for t in (WEATHER, TIME)]
    options = dict(model="default", max_tokens=120, messages=ASK, tools=tools,
                   tool_choice={**choice, "disable_parallel_tool_use": True},
                   extra_body={"temperature": 0})
    if stream:
        with qwen_claude.messages.stream(**options) as s:
            message = s.get_final_message()
    else:
        message = qwen_claude.messages.create(**options)
    assert message.stop_reason == "tool_use"
    uses = [b for b in message.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name in ("get_weather", "get_time")
    if choice["type"] == "tool":
        assert uses[0].name == "get_weather" and uses[0].input["city"] in CITIES


def test_anthropic_tool_choice_refusals(qwen_claude):
    tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
    thinking = {"type": "enabled", "budget_tokens": 1024}
    for choice, extra, message in [({"type": "tool", "name": "nope"}, {}, "not among the tools"),
                                   ({"type": "sometimes"}, {}, "type must be"),
                                   ({"type": "any"}, {"thinking": thinking}, "with thinking")]:
        with pytest.raises(anthropic.BadRequestError, match=message):
            qwen_claude.messages.create(model="default", max_tokens=2048, messages=ASK,
                                        tools=tools, tool_choice=choice, **extra)


RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]


def response_calls(oai, stream=False, **options):
    """(function calls as (name, arguments), output text) of a greedy /v1/responses request."""
    _, _, output = respond(oai, stream, input=ASK, tools=RESPONSES_TOOLS, max_output_tokens=120,
                           **options)
    calls = [(i.name, json.loads(i.arguments)) for i in output if i.type == "function_call"]
    text = "".join(c.text for i in output if i.type == "message" for c in i.content)
    return calls, text


def test_responses_without_tool_choice_call_nothing(qwen_oai):
    calls, text = response_calls(qwen_oai)
    assert not calls and text


@pytest.mark.parametrize("stream", [False, True])
def test_responses_required_tool_choice_calls_a_tool(qwen_oai, stream):
    calls, text = response_calls(qwen_oai, stream, tool_choice="required",
                                 parallel_tool_calls=False)
    assert len(calls) == 1 and not text
    name, arguments = calls[0]
    assert (name, list(arguments)) in (("get_weather", ["city"]), ("get_time", ["zone"]))
    assert arguments.get("city", CITIES[0]) in CITIES


def test_responses_named_tool_choice_calls_that_tool(qwen_oai):
    calls, _ = response_calls(qwen_oai, tool_choice={"type": "function", "name": "get_time"},
                              parallel_tool_calls=False)
    assert len(calls) == 1 and calls[0][0] == "get_time"
    assert calls[0][1]["zone"] in ("UTC", "CET")


@pytest.mark.parametrize("choice, extra, message", [
    ({"type": "function", "name": "nope"}, {}, "not among the tools"),
    ({"type": "allowed_tools"}, {}, "tool_choice must be"),
    ("required", {"text": {"format": {"type": "json_object"}}}, "not both")])
def test_responses_tool_choice_refusals(qwen_oai, choice, extra, message):
    with pytest.raises(openai.BadRequestError, match=message) as e:
        response_calls(qwen_oai, tool_choice=choice, **extra)
    assert e.value.body["param"] == "tool_choice"
