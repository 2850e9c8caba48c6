"""Pydantic request models of the Anthropic Messages API (/v1/messages, /count_tokens) and their
translation to template messages and tools. Top-level fields the API does not have are refused
(400), as Anthropic does; content blocks keep unknown keys (cache_control and the like)."""
import json
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from .chat import assistant_message, tool_message
from .errors import APIError


class Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class Tool(Loose):
    name: str
    description: Optional[str] = None
    input_schema: dict = Field(default_factory=lambda: {"type": "object"})
    type: Optional[str] = None


class Message(Loose):
    role: Literal["user", "assistant"]
    content: Union[str, list[dict]]


class CountRequest(BaseModel):
    """The fields /v1/messages/count_tokens takes (and /v1/messages shares)."""
    model_config = ConfigDict(extra="forbid")
    model: str = ""
    messages: list[Message] = Field(min_length=1)
    system: Union[str, list[dict], None] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[dict] = None
    thinking: Optional[dict] = None
    cache_control: Optional[dict] = None
    output_config: Optional[dict] = None
    speed: Optional[str] = None
    context_management: Optional[dict] = None
    mcp_servers: Optional[list] = None

    def refuse_unsupported(self) -> None:
        self.forced_tools()  # (its 400s)
        for tool in self.tools or []:
            if tool.type not in (None, "custom"):
                raise APIError(400, f"tool {tool.name!r} is a server tool ({tool.type}); only "
                                    "client tools with an input_schema are supported")
        if self.mcp_servers:
            raise APIError(400, "mcp_servers are not supported")

    def forced_tools(self) -> Optional[list]:
        """[(name, input_schema)] the output must call (tool_choice any: any of the tools; tool:
        the one named), or None; a tool_choice that cannot be met is a 400."""
        kind = (self.tool_choice or {}).get("type")
        if kind in (None, "auto", "none"):
            return None
        if kind not in ("any", "tool"):
            raise APIError(400, f"tool_choice type must be auto, any, tool or none, not {kind!r}")
        if not self.tools:
            raise APIError(400, "tool_choice needs tools")
        if (self.thinking or {}).get("type") == "enabled":
            raise APIError(400, "tool_choice any or tool cannot be used with thinking; use auto")
        tools = [(t.name, t.input_schema) for t in self.tools]
        if kind == "any":
            return tools
        named = [t for t in tools if t[0] == self.tool_choice.get("name")]
        if not named:
            raise APIError(400, f"tool_choice names {self.tool_choice.get('name')!r}, which is "
                                "not among the tools")
        return named

    @property
    def parallel_tool_calls(self) -> bool:
        return not (self.tool_choice or {}).get("disable_parallel_tool_use", False)

    @property
    def use_tools(self) -> bool:
        return bool(self.tools) and (self.tool_choice or {}).get("type") != "none"

    def template_tools(self) -> Optional[list]:
        if not self.use_tools:
            return None
        return [{"type": "function", "function": {
            "name": t.name, "description": t.description or "", "parameters": t.input_schema}}
            for t in self.tools]

    def template_variables(self) -> dict:
        """enable_thinking from `thinking` (Qwen's templates read it); nothing when not given."""
        kind = (self.thinking or {}).get("type")
        return {} if kind is None else {"enable_thinking": kind != "disabled"}

    def template_messages(self) -> list:
        out = []
        if self.system:
            out.append({"role": "system", "content": _text(self.system, "system")})
        for m in self.messages:
            blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) \
                else m.content
            out += _assistant(blocks) if m.role == "assistant" else _user(blocks)
        return out


class MessagesRequest(CountRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    metadata: Optional[dict] = None
    service_tier: Optional[str] = None
    container: Union[str, dict, None] = None
    inference_geo: Optional[str] = None
    diagnostics: Optional[dict] = None

    def sampling_options(self, max_tokens: int) -> dict:
        stops = tuple(self.stop_sequences or ())
        if any(not s for s in stops):
            raise APIError(400, "stop_sequences must not be empty strings")
        return dict(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, stop=stops)


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if block.get("type") != "text":
            raise APIError(400, f"{where}: blocks of type {block.get('type')!r} are not "
                                "supported here (text only)")
        parts.append(block.get("text", ""))
    return "".join(parts)


def _user(blocks: list) -> list:
    """tool_result blocks become tool messages (first, as the API orders them), text a user turn."""
    out, texts = [], []
    for block in blocks:
        kind = block.get("type")
        if kind == "tool_result":
            content = block.get("content", "")
            text = _text(content, "tool_result") if content is not None else ""
            if block.get("is_error"):
                text = f"Error: {text}"
            out.append(tool_message(text, block.get("tool_use_id")))
        elif kind == "text":
            texts.append(block.get("text", ""))
        else:
            raise APIError(400, f"user content blocks of type {kind!r} are not supported "
                                "(text and tool_result only)")
    if texts:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant(blocks: list) -> list:
    texts, calls, reasoning = [], [], []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            texts.append(block.get("text", ""))
        elif kind == "tool_use":
            calls.append((block.get("id"), block.get("name", ""), block.get("input") or {}))
        elif kind == "thinking":
            reasoning.append(block.get("thinking", ""))
        elif kind != "redacted_thinking":
            raise APIError(400, f"assistant content blocks of type {kind!r} are not supported")
    return [assistant_message("".join(texts), calls, "".join(reasoning))]


def tool_input(arguments: str) -> dict:
    """A parsed call's arguments (a JSON object's text, checked by the parser) as the input dict."""
    return json.loads(arguments)
