"""server/parsers.py on recorded Qwen outputs: the same parts whatever the pieces' boundaries,
malformed or unclosed tool calls kept as text, reasoning split from the answer, and text passing
through unchanged when no tag is parsed."""
import pytest
from hypothesis import given, settings, strategies as st

from freetoken.server.parsers import OutputParser, Reasoning, Text, ToolCall, parse_tool_call

# Recorded in the format Qwen3 models write (thinking, then calls each in its own block).
THINK_AND_CALLS = (
    "<think>\nThe user wants the weather in two cities; I will call the tool twice.\n</think>\n\n"
    "Let me check both.\n"
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"c\"}}\n"
    "</tool_call>\n"
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}\n</tool_call>"
)
EXPECTED = [Reasoning("The user wants the weather in two cities; I will call the tool twice."),
            Text("Let me check both."),
            ToolCall("get_weather", '{"city": "Paris", "unit": "c"}'),
            ToolCall("get_weather", '{"city": "Zürich"}')]
MALFORMED = "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>"


def parse(text, pieces=None, **options):
    parser = OutputParser(**options)
    parts = []
    for piece in pieces or [text]:
        parts += parser.feed(piece)
    return merge(parts + parser.finish())


def merge(parts):
    """Adjacent Text or Reasoning parts joined (a stream may split them anywhere)."""
    out = []
    for p in parts:
        if out and type(p) is type(out[-1]) and not isinstance(p, ToolCall):
            out[-1] = type(p)(out[-1].text + p.text)
        else:
            out.append(p)
    return out


def test_recorded_qwen_output():
    assert parse(THINK_AND_CALLS, reasoning=True, tools=True) == EXPECTED


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, len(THINK_AND_CALLS)), max_size=12))
def test_any_split_gives_the_same_parts(cuts):
    bounds = [0] + sorted(cuts) + [len(THINK_AND_CALLS)]
    pieces = [THINK_AND_CALLS[a:b] for a, b in zip(bounds, bounds[1:])]
    assert parse(None, pieces, reasoning=True, tools=True) == EXPECTED


def test_char_by_char():
    assert parse(None, list(THINK_AND_CALLS), reasoning=True, tools=True) == EXPECTED


def test_malformed_tool_json_is_text_as_written():
    parts = parse(None, list(MALFORMED), tools=True)
    assert all(isinstance(p, Text) for p in parts)
    assert "".join(p.text for p in parts) == MALFORMED


@pytest.mark.parametrize("body", ['{"arguments": {}}', '[1, 2]', '{"name": "f", "arguments": 3}',
                                  '{"name": "", "arguments": {}}', '{"name": "f"'])
def test_not_a_call(body):
    assert parse_tool_call(body) is None


def test_arguments_as_json_string_or_absent():
    assert parse_tool_call('{"name": "f", "arguments": "{\\"a\\": 1}"}') == ToolCall("f", '{"a": 1}')
    assert parse_tool_call('{"name": "f"}') == ToolCall("f", "{}")


def test_unclosed_call_at_the_end():
    whole = 'x <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'
    assert parse(whole, tools=True) == [Text("x"), ToolCall("f", '{"a": 1}')]
    cut = 'x <tool_call>\n{"name": "f", "argu'
    assert parse(cut, tools=True) == [Text(cut)]


def test_tags_off_pass_text_through():
    for text in (THINK_AND_CALLS, "  spaced \n\n", "a <tool_call"):
        assert parse(None, list(text)) == [Text(text)]


def test_tools_off_keep_calls_as_text_but_split_reasoning():
    parts = parse(THINK_AND_CALLS, reasoning=True)
    assert parts[0] == EXPECTED[0] and isinstance(parts[1], Text)
    assert parts[1].text.startswith("Let me check both.\n<tool_call>")


def test_output_starting_inside_reasoning():
    text = "step one\nstep two\n</think>\n\nThe answer is 4."
    assert parse(None, list(text), reasoning=True, in_reasoning=True) == \
        [Reasoning("step one\nstep two"), Text("The answer is 4.")]


def test_held_prefix_released_when_it_is_no_tag():
    parser = OutputParser(tools=True)
    assert parser.feed("a <tool") == [Text("a")]
    assert parser.feed("box> b") == [Text(" <toolbox> b")]
    assert parser.finish() == []


def test_whitespace_inside_text_is_kept():
    text = "line one\n\n  line two  \n"
    assert parse(None, list(text), tools=True, reasoning=True) == [Text(text)]
