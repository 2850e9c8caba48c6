"""Anthropic routes: POST /v1/messages (whole, or streamed as message_start, ping, then per
content block content_block_start / _delta / _stop, message_delta, message_stop) and
POST /v1/messages/count_tokens. Only translation lives here."""
import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from .anthropic_schemas import CountRequest, MessagesRequest, tool_input
from .chat import ChatError
from .errors import APIError
from .generation import budget, collect, constraint, finish_error, new_id, read_body, sampling, \
    sse, stream, submit
from .parsers import Reasoning, Text, ToolCall
from .worker import Finish, Piece

router = APIRouter()


async def _render(s, req):
    req.refuse_unsupported()
    try:
        return await asyncio.to_thread(s.chat.render, req.template_messages(),
                                       req.template_tools(), **req.template_variables())
    except ChatError as e:
        raise APIError(400, str(e)) from None


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    s = request.app.state.server
    req = await read_body(request, CountRequest)
    prompt = await _render(s, req)
    return {"input_tokens": len(prompt.ids)}


def stop_reason(finish: Finish, has_calls: bool) -> tuple:
    """(stop_reason, stop_sequence) in the API's words."""
    if has_calls:
        return "tool_use", None
    if finish.reason == "length":
        return "max_tokens", None
    if finish.stop_string is not None:
        return "stop_sequence", finish.stop_string
    return "end_turn", None


def usage(finish: Finish, output_tokens: int) -> dict:
    """input_tokens counts the prompt tokens computed; cache_read_input_tokens the reused ones."""
    return {"input_tokens": finish.num_prompt_tokens - finish.num_cached_tokens,
            "cache_read_input_tokens": finish.num_cached_tokens,
            "cache_creation_input_tokens": 0, "output_tokens": output_tokens}


def block(part) -> dict:
    if isinstance(part, Text):
        return {"type": "text", "text": part.text}
    if isinstance(part, Reasoning):
        return {"type": "thinking", "thinking": part.text, "signature": ""}
    return {"type": "tool_use", "id": new_id("toolu_"), "name": part.name,
            "input": tool_input(part.arguments)}


@router.post("/v1/messages")
async def messages(request: Request):
    s = request.app.state.server
    req = await read_body(request, MessagesRequest)
    prompt = await _render(s, req)
    params = sampling(**req.sampling_options(budget(s.worker, len(prompt.ids), req.max_tokens)))
    grammar = await constraint(s.grammars, tools=req.forced_tools(),
                               parallel=req.parallel_tool_calls)
    job = submit(s.worker, prompt.ids, params, grammar)
    parser = s.chat.parser(prompt, req.use_tools)
    head = {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": s.model_name}
    if req.stream:
        return StreamingResponse(_events(job, parser, head, len(prompt.ids)),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    text, finish = await collect(request, job)
    finish_error(finish)
    parts = parser.feed(text) + parser.finish()
    reason, sequence = stop_reason(finish, any(isinstance(p, ToolCall) for p in parts))
    return {**head, "content": [block(p) for p in parts], "stop_reason": reason,
            "stop_sequence": sequence, "usage": usage(finish, finish.num_generated)}


class _Blocks:
    """The open content block of a stream: a part of another kind (or any tool call) closes it
    and opens the next index."""

    def __init__(self):
        self.index, self.kind, self.num_calls = -1, None, 0

    def events(self, part) -> list:
        out = []
        kind = type(part)
        if kind is not self.kind or kind is ToolCall:
            out += self.close()
            self.index, self.kind = self.index + 1, kind
            start = block(part)
            if kind is ToolCall:
                start["input"] = {}
                self.num_calls += 1
            else:
                start[{Text: "text", Reasoning: "thinking"}[kind]] = ""
            out.append(("content_block_start", {"index": self.index, "content_block": start}))
        if kind is Text:
            delta = {"type": "text_delta", "text": part.text}
        elif kind is Reasoning:
            delta = {"type": "thinking_delta", "thinking": part.text}
        else:
            delta = {"type": "input_json_delta", "partial_json": part.arguments}
        out.append(("content_block_delta", {"index": self.index, "delta": delta}))
        return out

    def close(self) -> list:
        if self.kind is None:
            return []
        self.kind = None
        return [("content_block_stop", {"index": self.index})]


async def _events(job, parser, head: dict, num_prompt: int):
    def event(kind: str, body: dict) -> str:
        return sse({"type": kind, **body}, event=kind)

    start = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": num_prompt, "output_tokens": 0}}
    yield event("message_start", {"message": start})
    yield event("ping", {})
    blocks = _Blocks()
    async for ev in stream(job):
        parts = parser.feed(ev.text) if isinstance(ev, Piece) else parser.finish()
        for part in parts:
            for kind, body in blocks.events(part):
                yield event(kind, body)
        if isinstance(ev, Finish):
            if ev.reason == "error":
                yield event("error", {"error": {"type": "api_error",
                                                "message": f"generation failed: {ev.error}"}})
                return
            for kind, body in blocks.close():
                yield event(kind, body)
            reason, sequence = stop_reason(ev, blocks.num_calls > 0)
            yield event("message_delta", {"delta": {"stop_reason": reason,
                                                    "stop_sequence": sequence},
                                          "usage": usage(ev, ev.num_generated)})
            yield event("message_stop", {})
