"""Pydantic request models of the OpenAI API (chat completions, completions) and their
translation to template messages, tools and SamplingParams. Top-level fields the API does not
have are refused (400), as OpenAI does; fields the API has but we cannot honour yet are refused
with a message that names them, never silently ignored."""
import json
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from .chat import assistant_message, tool_message
from .errors import APIError


def pick_forced_tools(choice, named, tools, has_schema, schema_field: str, named_shape: str):
    """The forced tools of a request (both APIs): None unless tool_choice forces a call;
    "required": every tool in tools [(name, parameters)]; a named choice (named: its name, None
    when the choice is malformed): that tool. 400 when there are no tools, when the request also
    asks for a schema (has_schema(), the field schema_field) or when the choice names no tool."""
    if choice in (None, "auto", "none"):
        return None
    if not tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if has_schema():
        raise APIError(400, f"give {schema_field} or a forced tool_choice, not both",
                       param="tool_choice")
    if choice == "required":
        return list(tools)
    if named is None:
        raise APIError(400, f"tool_choice must be auto, none, required or {named_shape}",
                       param="tool_choice")
    picked = [t for t in tools if t[0] == named]
    if not picked:
        raise APIError(400, f"tool_choice names {named!r}, which is not among the tools",
                       param="tool_choice")
    return picked


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class Function(Loose):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class Tool(Loose):
    type: Literal["function"]
    function: Function


class CalledFunction(Loose):
    name: str
    arguments: str = "{}"


class ToolCallIn(Loose):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(Loose):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list, None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallIn]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None


class StreamOptions(Loose):
    include_usage: bool = False


class SamplingFields(Strict):
    """The fields chat completions and completions share. top_k, min_p, repetition_penalty and
    ignore_eos (an EOS is generated like any token: exactly max_tokens come, for benchmarks) are
    extensions (as vLLM and llama.cpp accept them); unset fields take `freetoken run`'s defaults."""
    model: str = ""
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    ignore_eos: bool = False
    seed: Optional[int] = Field(None, ge=0, lt=2 ** 63)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict] = None
    user: Optional[str] = None

    def stop_strings(self) -> tuple:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop")
        return tuple(stops)

    @property
    def num_logprobs(self) -> Optional[int]:
        """SamplingParams.logprobs: None, or how many alternatives each token reports."""
        return None

    def refuse_unsupported(self) -> None:
        if self.n != 1:
            raise APIError(400, "n must be 1 (one choice per request)", param="n")
        if self.presence_penalty or self.frequency_penalty:
            raise APIError(400, "presence_penalty and frequency_penalty are not supported; use "
                                "repetition_penalty", param="presence_penalty")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")

    def sampling_options(self, max_tokens: int) -> dict:
        return dict(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, min_p=self.min_p, seed=self.seed,
                    repetition_penalty=self.repetition_penalty, stop=self.stop_strings(),
                    logprobs=self.num_logprobs, ignore_eos=self.ignore_eos or None)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[dict] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    reasoning_effort: Optional[str] = None
    store: Optional[bool] = None
    metadata: Optional[dict] = None
    service_tier: Optional[str] = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        self.forced_tools()  # (its 400s)

    @property
    def num_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def response_schema(self) -> Optional[dict]:
        """The JSON schema the output must follow: None for text, any object for json_object;
        a malformed response_format is a 400."""
        fmt = self.response_format or {"type": "text"}
        kind = fmt.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "object"}
        if kind != "json_schema":
            raise APIError(400, f"response_format type must be text, json_object or json_schema, "
                                f"not {kind!r}", param="response_format")
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise APIError(400, "response_format json_schema needs json_schema.schema, a JSON "
                                "schema object", param="response_format")
        return schema

    def forced_tools(self) -> Optional[list]:
        """[(name, parameters)] the output must call (tool_choice "required": any of the tools;
        named: that one), or None; a tool_choice that cannot be met is a 400."""
        choice = self.tool_choice
        named = ((choice.get("function") or {}).get("name")
                 if isinstance(choice, dict) and choice.get("type") == "function" else None)
        return pick_forced_tools(
            choice, named, self.tools and [(t.function.name, t.function.parameters) for t in self.tools],
            lambda: self.response_schema() is not None, "response_format",
            '{"type": "function", "function": {"name": ...}}')

    @property
    def limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def use_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def template_tools(self) -> Optional[list]:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.use_tools else None

    def template_messages(self) -> list:
        """The messages in the shape HF chat templates read (tool arguments as objects)."""
        out = []
        for m in self.messages:
            text = content_text(m.content)
            if m.role == "tool":
                out.append(tool_message(text, m.tool_call_id))
            elif m.role == "assistant":
                calls = [(c.id, c.function.name, tool_arguments(c.function.arguments))
                         for c in m.tool_calls or []]
                out.append(assistant_message(text, calls, m.reasoning_content or ""))
            else:
                role = "system" if m.role == "developer" else m.role
                out.append({"role": role, "content": text})
        return out


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int]]
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    logprobs: Optional[int] = Field(None, ge=0, le=5)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo or self.suffix or (self.best_of or 1) != 1:
            raise APIError(400, "echo, suffix and best_of are not supported")

    @property
    def num_logprobs(self) -> Optional[int]:
        return self.logprobs


def content_text(content) -> str:
    """A message's text: a string, or the text parts of a list (other parts are a 400)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "input_text", "output_text"):
            raise APIError(400, f"content parts of type {kind!r} are not supported (text only)",
                           param="messages")
        texts.append(part.get("text", ""))
    return "".join(texts)


def tool_arguments(text: str):
    """Tool-call arguments for the template: the object, or the text when it is not JSON."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text
