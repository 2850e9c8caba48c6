"""POST /v1/responses (OpenAI Responses API, stateless): whole, or streamed as response.created,
response.in_progress, per output item output_item.added ... output_item.done (text deltas,
reasoning text deltas, function-call argument deltas), then response.completed or
response.incomplete. Only translation lives here."""
import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from .chat import ChatError
from .errors import APIError
from .generation import budget, collect, constraint, finish_error, new_id, now, read_body, \
    sampling, sse, stream, submit
from .parsers import Reasoning, Text, ToolCall
from .responses_schemas import ResponsesRequest
from .worker import Finish, Piece

router = APIRouter()


def item(part, done: bool = True) -> dict:
    """The output item of a parser part (done=False: as it opens, with no content yet)."""
    status = "completed" if done else "in_progress"
    if isinstance(part, Text):
        content = [{"type": "output_text", "text": part.text, "annotations": []}] if done else []
        return {"type": "message", "id": new_id("msg_"), "status": status, "role": "assistant",
                "content": content}
    if isinstance(part, Reasoning):
        content = [{"type": "reasoning_text", "text": part.text}] if done else []
        return {"type": "reasoning", "id": new_id("rs_"), "summary": [], "content": content}
    return {"type": "function_call", "id": new_id("fc_"), "call_id": new_id("call_"),
            "name": part.name, "arguments": part.arguments if done else "", "status": status}


def response(head: dict, output: list, finish=None) -> dict:
    """The response object: in progress (finish None), completed or incomplete."""
    body = {**head, "output": output, "status": "in_progress", "incomplete_details": None,
            "usage": None, "error": None}
    if finish is not None:
        body["status"] = "incomplete" if finish.reason == "length" else "completed"
        if finish.reason == "length":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        body["usage"] = {
            "input_tokens": finish.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": finish.num_cached_tokens},
            "output_tokens": finish.num_generated,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": finish.num_prompt_tokens + finish.num_generated}
    return body


@router.post("/v1/responses")
async def responses(request: Request):
    s = request.app.state.server
    req = await read_body(request, ResponsesRequest)
    req.refuse_unsupported()
    try:
        prompt = await asyncio.to_thread(s.chat.render, req.template_messages(),
                                         req.template_tools())
    except ChatError as e:
        raise APIError(400, str(e), param="input") from None
    max_tokens = budget(s.worker, len(prompt.ids), req.max_output_tokens, "max_output_tokens")
    params = sampling(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p)
    grammar = await constraint(s.grammars, req.response_schema(), req.forced_tools(),
                               req.parallel_tool_calls is not False, schema_param="text")
    job = submit(s.worker, prompt.ids, params, grammar)
    parser = s.chat.parser(prompt, req.use_tools)
    head = {"id": new_id("resp_"), "object": "response", "created_at": now(),
            "model": s.model_name, "instructions": req.instructions,
            "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": bool(req.parallel_tool_calls), "temperature": req.temperature,
            "top_p": req.top_p, "text": req.text or {"format": {"type": "text"}},
            "max_output_tokens": req.max_output_tokens, "store": False,
            "metadata": req.metadata or {}}
    if req.stream:
        return StreamingResponse(_events(job, parser, head), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    text, finish = await collect(request, job)
    finish_error(finish)
    return response(head, [item(p) for p in parser.feed(text) + parser.finish()], finish)


class _Items:
    """The stream's open output item; a part of another kind (or any call) closes it."""

    def __init__(self):
        self.output, self.open, self.kind, self.text = [], None, None, ""

    def events(self, part) -> list:
        out = []
        if self.open is None or type(part) is not self.kind or isinstance(part, ToolCall):
            out += self.close()
            self.open, self.kind, self.text = item(part, done=False), type(part), ""
            out.append(("response.output_item.added", {"output_index": self.index,
                                                       "item": self.open}))
            if isinstance(part, Text):
                out.append(("response.content_part.added", {**self._at(), "part": {
                    "type": "output_text", "text": "", "annotations": []}}))
        if isinstance(part, ToolCall):
            self.open["arguments"] = part.arguments
            out.append(("response.function_call_arguments.delta",
                        {"item_id": self.open["id"], "output_index": self.index,
                         "delta": part.arguments}))
            return out
        self.text += part.text
        kind = "output_text" if isinstance(part, Text) else "reasoning_text"
        delta = {**self._at(), "delta": part.text}
        out.append((f"response.{kind}.delta", {**delta, "logprobs": []} if kind == "output_text"
                    else delta))
        return out

    @property
    def index(self) -> int:
        return len(self.output)

    def _at(self) -> dict:
        return {"item_id": self.open["id"], "output_index": self.index, "content_index": 0}

    def close(self) -> list:
        if self.open is None:
            return []
        done, out = dict(self.open), []
        if self.kind is ToolCall:
            out.append(("response.function_call_arguments.done",
                        {"item_id": done["id"], "output_index": self.index,
                         "name": done["name"], "arguments": done["arguments"]}))
            done["status"] = "completed"
        elif self.kind is Text:
            part = {"type": "output_text", "text": self.text, "annotations": []}
            out += [("response.output_text.done", {**self._at(), "text": self.text,
                                                   "logprobs": []}),
                    ("response.content_part.done", {**self._at(), "part": part})]
            done.update(status="completed", content=[part])
        else:
            out.append(("response.reasoning_text.done", {**self._at(), "text": self.text}))
            done["content"] = [{"type": "reasoning_text", "text": self.text}]
        out.append(("response.output_item.done", {"output_index": self.index, "item": done}))
        self.output.append(done)
        self.open = None
        return out


async def _events(job, parser, head: dict):
    number = iter(range(1 << 62))

    def event(kind: str, body: dict) -> str:
        return sse({"type": kind, "sequence_number": next(number), **body}, event=kind)

    yield event("response.created", {"response": response(head, [])})
    yield event("response.in_progress", {"response": response(head, [])})
    items = _Items()
    async for ev in stream(job):
        parts = parser.feed(ev.text) if isinstance(ev, Piece) else parser.finish()
        for part in parts:
            for kind, body in items.events(part):
                yield event(kind, body)
        if isinstance(ev, Finish):
            if ev.reason == "error":
                yield event("error", {"code": "server_error", "param": None,
                                      "message": f"generation failed: {ev.error}"})
                return
            for kind, body in items.close():
                yield event(kind, body)
            final = response(head, items.output, ev)
            yield event(f"response.{final['status']}", {"response": final})
