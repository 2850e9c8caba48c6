"""response_format through a live server on the bundled model (real engine, cpu, greedy): the
tiny model's own text is not JSON, but the grammar (llguidance) makes the output parse and follow
the schema, whole and streamed; json_object gives an object; a schema the library refuses, or a
malformed response_format, is a 400 in OpenAI's error shape."""
import json

import openai
import pytest

from freetoken.api import default_model_path
from freetoken.config import EngineConfig
from freetoken.engine import Engine
from serve_support import live_server

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
