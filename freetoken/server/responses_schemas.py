"""Pydantic request model of the OpenAI Responses API (POST /v1/responses), stateless: the whole
conversation comes in `input` (messages, function_call and function_call_output items); nothing
is stored, so previous_response_id is refused. Function tools only; text.format (json_object,
json_schema) and a forced tool_choice become grammars (grammar.py) as in chat completions."""
from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from .chat import assistant_message, tool_message
from .errors import APIError
from .openai_schemas import content_text, pick_forced_tools, tool_arguments


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = ""
    input: Union[str, list[dict]]
    instructions: Optional[str] = None
    tools: Optional[list[dict]] = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    stream: bool = False
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    reasoning: Optional[dict] = None
    text: Optional[dict] = None
    include: Optional[list] = None
    metadata: Optional[dict] = None
    user: Optional[str] = None
    truncation: Optional[str] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None

    def refuse_unsupported(self) -> None:
        if self.previous_response_id:
            raise APIError(400, "previous_response_id is not supported: this server stores no "
                                "responses; send the whole conversation in input",
                           param="previous_response_id")
        for tool in self.tools or []:
            if tool.get("type") != "function" or not tool.get("name"):
                raise APIError(400, f"only function tools are supported, not {tool.get('type')!r}",
                               param="tools")
        self.forced_tools()  # (its 400s)

    def response_schema(self) -> Optional[dict]:
        """The JSON schema the output must follow (text.format): None for text, any object for
        json_object, its `schema` for json_schema; a malformed format is a 400."""
        fmt = (self.text or {}).get("format") or {"type": "text"}
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "object"}
        if kind != "json_schema":
            raise APIError(400, f"text.format type must be text, json_object or json_schema, not "
                                f"{kind!r}", param="text")
        if not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "text.format json_schema needs schema, a JSON schema object",
                           param="text")
        return fmt["schema"]

    def forced_tools(self) -> Optional[list]:
        """[(name, parameters)] the output must call (tool_choice "required": any of the tools;
        {"type": "function", "name": N}: that one), or None; one that cannot be met is a 400."""
        choice = self.tool_choice
        named = (choice.get("name") if isinstance(choice, dict) and choice.get("type") == "function"
                 else None)
        return pick_forced_tools(
            choice, named, self.tools and [(t["name"], t.get("parameters")) for t in self.tools],
            lambda: self.response_schema() is not None, "text.format",
            '{"type": "function", "name": ...}')

    @property
    def use_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def template_tools(self) -> Optional[list]:
        if not self.use_tools:
            return None
        return [{"type": "function", "function": {
            "name": t["name"], "description": t.get("description") or "",
            "parameters": t.get("parameters") or {"type": "object"}}} for t in self.tools]

    def template_messages(self) -> list:
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) \
            else self.input
        for item in items:
            kind = item.get("type", "message")
            if kind == "message":
                role = {"developer": "system"}.get(item.get("role"), item.get("role"))
                if role not in ("system", "user", "assistant"):
                    raise APIError(400, f"input message role {item.get('role')!r} is unknown",
                                   param="input")
                out.append({"role": role, "content": content_text(item.get("content"))})
            elif kind == "function_call":
                call = (item.get("call_id"), item.get("name", ""),
                        tool_arguments(item.get("arguments", "{}")))
                if out and out[-1]["role"] == "assistant":
                    out[-1].setdefault("tool_calls", []).append(assistant_message(
                        "", [call])["tool_calls"][0])
                else:
                    out.append(assistant_message("", [call]))
            elif kind == "function_call_output":
                output = item.get("output", "")
                text = output if isinstance(output, str) else content_text(output)
                out.append(tool_message(text, item.get("call_id")))
            elif kind != "reasoning":  # our reasoning is not fed back (as Qwen's templates drop it)
                raise APIError(400, f"input items of type {kind!r} are not supported",
                               param="input")
        return out
