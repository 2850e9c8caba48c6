"""Incremental parsers of generated text: reasoning in `<think>...</think>` and Qwen's tool calls,
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, split from the answer text.

OutputParser.feed(piece) -> parts and finish() -> parts never raise on model output and never
lose text: a tool call whose JSON is malformed comes back as Text, tags included, as written.
Knows nothing of HTTP or of either API's shapes.
"""
import json
from dataclasses import dataclass
from typing import Optional

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text


def parse_tool_call(body: str) -> Optional[ToolCall]:
    """The call in a `<tool_call>` body, or None when it is not {"name": str, "arguments": obj}
    (arguments may also be an object encoded as a JSON string, or absent = {})."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    args = call.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(call["name"], json.dumps(args, ensure_ascii=False))


def _held_prefix(text: str, tags) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of tags."""
    for n in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        if any(t.startswith(text[-n:]) for t in tags):
            return n
    return 0


class OutputParser:
    """Splits generated text into Text, Reasoning and ToolCall parts as it streams.

    reasoning: `<think>` opens reasoning; in_reasoning: the prompt already opened it (the output
    starts inside). tools: `<tool_call>` blocks become ToolCall. With neither, text passes through
    unchanged. Whitespace next to a tag (Qwen writes "</think>\\n\\n", "\\n<tool_call>") is
    dropped; a tail that could still become a tag is held until the next piece or finish().

    Worked example, tools on: pieces 'Hi\\n<tool', '_call>\\n{"name": "f", "arguments": {}}',
    '\\n</tool_call>' -> [Text('Hi')], [], [ToolCall('f', '{}')].
    """

    def __init__(self, reasoning: bool = False, tools: bool = False, in_reasoning: bool = False):
        self._open = tuple(t for t, on in ((THINK_OPEN, reasoning), (CALL_OPEN, tools)) if on)
        self._mode = "think" if in_reasoning else "text"
        self._buf = ""
        self._space = ""  # whitespace held at the end of text or reasoning
        self._call_space = ""  # whitespace dropped before the open <tool_call> (kept if malformed)
        self._skip_space = in_reasoning  # drop whitespace right after a tag
        self._out = []
        self.num_tool_calls = 0

    def feed(self, piece: str) -> list:
        if not self._open and self._mode == "text":
            return [Text(piece)] if piece else []
        self._buf += piece
        while self._step():
            pass
        return self._take()

    def finish(self) -> list:
        """The parts still held when generation ends (an unclosed tool call as text or, if its
        JSON is whole, as a call)."""
        buf, self._buf = self._buf, ""
        if self._mode == "tool":
            call = parse_tool_call(buf.strip())
            if call is not None:
                self._call(call)
            else:
                self._emit(Text, self._call_space + CALL_OPEN + buf, final=True)
        else:
            self._emit(Reasoning if self._mode == "think" else Text, buf, final=True)
        return self._take()

    def _step(self) -> bool:
        """Consume what the buffer settles; True when a tag was crossed (look again)."""
        if self._mode == "tool":
            end = self._buf.find(CALL_CLOSE)
            if end < 0:
                return False
            body, self._buf = self._buf[:end], self._buf[end + len(CALL_CLOSE):]
            call = parse_tool_call(body.strip())
            if call is None:
                self._emit(Text, self._call_space + CALL_OPEN + body + CALL_CLOSE, final=False)
            else:
                self._call(call)
            self._mode = "text"
            return True
        kind, tags = (Reasoning, (THINK_CLOSE,)) if self._mode == "think" else (Text, self._open)
        hits = [(i, t) for t in tags for i in [self._buf.find(t)] if i >= 0]
        if not hits:
            keep = _held_prefix(self._buf, tags)
            cut = len(self._buf) - keep
            self._emit(kind, self._buf[:cut], final=False)
            self._buf = self._buf[cut:]
            return False
        i, tag = min(hits)
        self._emit(kind, self._buf[:i], final=False)
        self._call_space, self._space = self._space, ""  # whitespace next to a tag is layout
        self._skip_space = self._skip_space or tag != CALL_OPEN  # (a call's body is stripped)
        self._buf = self._buf[i + len(tag):]
        self._mode = {THINK_OPEN: "think", THINK_CLOSE: "text", CALL_OPEN: "tool"}[tag]
        return True

    def _emit(self, kind, text: str, final: bool) -> None:
        text = self._space + text
        self._space = ""
        if self._skip_space:
            text = text.lstrip()
            self._skip_space = not text
        if not final:
            core = text.rstrip()
            text, self._space = core, text[len(core):]
        if text:
            if self._out and isinstance(self._out[-1], kind):
                self._out[-1] = kind(self._out[-1].text + text)
            else:
                self._out.append(kind(text))

    def _call(self, call: ToolCall) -> None:
        self._out.append(call)
        self.num_tool_calls += 1
        self._skip_space = True

    def _take(self) -> list:
        out, self._out = self._out, []
        return out
