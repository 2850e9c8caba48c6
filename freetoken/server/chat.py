"""Chat formats: messages (in the HF template shape both APIs are translated to) -> prompt token
ids through the model's jinja2 chat template, and the output parser that matches the format.

Formats known today: Qwen's (`<tool_call>` JSON, `<think>` reasoning), recognised by the tags
in the model's template. NOTE: a family with another tool-call format adds its parser to
parsers.py and its recognition to ChatFormat.__init__. Knows nothing of HTTP.
"""
from dataclasses import dataclass
from typing import Optional

from ..errors import ModelError
from .parsers import CALL_OPEN, THINK_CLOSE, THINK_OPEN, OutputParser


class ChatError(ValueError):
    """The request's messages cannot be rendered for this model; the message says why (400)."""


@dataclass(frozen=True)
class Prompt:
    """A rendered chat: its token ids, and whether the template opened the reasoning."""
    ids: list
    in_reasoning: bool = False


class ChatFormat:
    """One model's chat format, built from its Tokenizer. has_tools / has_reasoning: the template
    renders Qwen-style tool calls / `<think>` blocks (so the output parser looks for them)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        template = tokenizer.chat_template or ""
        self.has_template = bool(template)
        self.has_tools = CALL_OPEN in template
        self.has_reasoning = THINK_OPEN in template and THINK_CLOSE in template

    def render(self, messages: list, tools: Optional[list] = None, **variables) -> Prompt:
        """Prompt ids for `messages` (and `tools`, OpenAI function-tool dicts), ready for the
        assistant's turn. variables (e.g. enable_thinking) go to the template. Without a chat
        template only one user message can be sent, as raw text (like `freetoken run` does)."""
        if tools and not self.has_tools:
            raise ChatError("this model's chat template has no tool calls; send the request "
                            "without tools")
        if not self.has_template:
            if len(messages) != 1 or messages[0]["role"] != "user":
                raise ChatError("this model has no chat template: send one user message (it is "
                                "used as raw text) or use /v1/completions")
            return Prompt(self.tokenizer.encode(messages[0]["content"]))
        if tools:
            variables["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      **variables)
        except ModelError as e:
            raise ChatError(str(e)) from None
        opened = self.has_reasoning and text.rstrip().endswith(THINK_OPEN)
        return Prompt(self.tokenizer.encode(text, add_special_tokens=False), opened)

    def parser(self, prompt: Prompt, tools: bool) -> OutputParser:
        """A fresh parser for one generation from `prompt` (tool calls parsed when `tools`)."""
        return OutputParser(reasoning=self.has_reasoning, tools=tools and self.has_tools,
                            in_reasoning=prompt.in_reasoning)


def tool_message(content: str, call_id: Optional[str] = None) -> dict:
    """A tool result as a template message (role "tool", as HF templates read it)."""
    message = {"role": "tool", "content": content}
    if call_id:
        message["tool_call_id"] = call_id
    return message


def assistant_message(text: str, calls: list, reasoning: str = "") -> dict:
    """An earlier assistant turn: calls are (id, name, arguments dict) triples."""
    message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [{"id": i, "type": "function",
                                  "function": {"name": n, "arguments": a}} for i, n, a in calls]
    if reasoning:
        message["reasoning_content"] = reasoning
    return message
