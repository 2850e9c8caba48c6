"""OpenAI routes: GET /v1/models, POST /v1/chat/completions and /v1/completions, whole or as
server-sent events (`data: {chunk}` ... `data: [DONE]`). Only translation lives here."""
import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from .chat import ChatError
from .errors import APIError
from .generation import (budget, collect, constraint, finish_error, new_id, now, read_body,
                         sampling, sse, stream, submit)
from .openai_schemas import ChatRequest, CompletionRequest
from .parsers import Reasoning, Text, ToolCall
from .worker import Finish, Piece

router = APIRouter()
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@router.get("/v1/models")
async def models(request: Request):
    s = request.app.state.server
    return {"object": "list", "data": [model_card(s)]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    s = request.app.state.server
    if model_id != s.model_name:
        raise APIError(404, f"model {model_id!r} is not served here; this server has "
                            f"{s.model_name!r}", param="model")
    return model_card(s)


def model_card(s) -> dict:
    return {"id": s.model_name, "object": "model", "created": s.created, "owned_by": "freetoken",
            "max_model_len": s.worker.ctx_size}


def usage(finish: Finish) -> dict:
    return {"prompt_tokens": finish.num_prompt_tokens, "completion_tokens": finish.num_generated,
            "total_tokens": finish.num_prompt_tokens + finish.num_generated,
            "prompt_tokens_details": {"cached_tokens": finish.num_cached_tokens}}


def chat_logprobs(entries) -> dict:
    """TokenLogprobs in chat completions' shape (`choices[].logprobs`)."""
    def one(token, logprob) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(*t) for t in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries, offset: int = 0) -> dict:
    """TokenLogprobs in completions' (legacy) shape; text_offset counts from offset."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(e.top) for e in entries], "text_offset": offsets}


def tool_call(call: ToolCall, index: int = None) -> dict:
    out = {"id": new_id("call_"), "type": "function",
           "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    s = request.app.state.server
    req = await read_body(request, ChatRequest)
    req.refuse_unsupported()
    try:
        prompt = await asyncio.to_thread(s.chat.render, req.template_messages(),
                                         req.template_tools())
    except ChatError as e:
        raise APIError(400, str(e), param="messages") from None
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    params = sampling(**req.sampling_options(budget(s.worker, len(prompt.ids), req.limit, param)))
    grammar = await constraint(s.grammars, req.response_schema(), req.forced_tools(),
                               req.parallel_tool_calls is not False)
    job = submit(s.worker, prompt.ids, params, grammar)
    parser = s.chat.parser(prompt, req.use_tools)
    head = {"id": new_id("chatcmpl-"), "created": now(), "model": s.model_name}
    if req.stream:
        return StreamingResponse(_chat_chunks(job, parser, head, req.include_usage),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    logprobs = [] if req.logprobs else None
    text, finish = await collect(request, job, logprobs)
    finish_error(finish)
    parts = parser.feed(text) + parser.finish()
    calls = [tool_call(p) for p in parts if isinstance(p, ToolCall)]
    content = "".join(p.text for p in parts if isinstance(p, Text))
    reasoning = "".join(p.text for p in parts if isinstance(p, Reasoning))
    message = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return {**head, "object": "chat.completion",
            "choices": [{"index": 0, "message": message,
                         "logprobs": chat_logprobs(logprobs) if req.logprobs else None,
                         "finish_reason": "tool_calls" if calls else finish.reason}],
            "usage": usage(finish)}


async def _chat_chunks(job, parser, head: dict, include_usage: bool):
    """Chunks of the parser's parts; token logprobs ride on the next chunk sent (the parser may
    hold text back), the rest on the finishing one."""
    held = []

    def chunk(delta: dict, finish_reason=None) -> str:
        logprobs = chat_logprobs(held) if job.params.logprobs is not None else None
        held.clear()
        body = {**head, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                             "finish_reason": finish_reason}]}
        return sse({**body, "usage": None} if include_usage else body)

    yield chunk({"role": "assistant", "content": ""})
    num_calls = 0
    async for event in stream(job):
        if isinstance(event, Piece):
            held.extend(event.logprobs)
        parts = parser.feed(event.text) if isinstance(event, Piece) else parser.finish()
        for part in parts:
            if isinstance(part, Text):
                yield chunk({"content": part.text})
            elif isinstance(part, Reasoning):
                yield chunk({"reasoning_content": part.text})
            else:
                yield chunk({"tool_calls": [tool_call(part, num_calls)]})
                num_calls += 1
        if isinstance(event, Finish):
            if event.reason == "error":
                yield sse({"error": {"message": f"generation failed: {event.error}",
                                     "type": "server_error", "param": None, "code": None}})
                return
            yield chunk({}, "tool_calls" if num_calls else event.reason)
            if include_usage:
                yield sse({**head, "object": "chat.completion.chunk", "choices": [],
                           "usage": usage(event)})
    yield "data: [DONE]\n\n"


@router.post("/v1/completions")
async def completions(request: Request):
    s = request.app.state.server
    req = await read_body(request, CompletionRequest)
    req.refuse_unsupported()
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "give one prompt per request", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = await asyncio.to_thread(s.worker.tokenizer.encode, prompt)
    else:
        ids, vocab = prompt, s.worker.tokenizer.vocab_size
        if any(not 0 <= i < vocab for i in ids):
            raise APIError(400, f"prompt token ids must be in 0..{vocab - 1}", param="prompt")
    params = sampling(**req.sampling_options(budget(s.worker, len(ids), req.max_tokens)))
    job = submit(s.worker, ids, params)
    head = {"id": new_id("cmpl-"), "object": "text_completion", "created": now(),
            "model": s.model_name}
    if req.stream:
        return StreamingResponse(_completion_chunks(job, head, req.include_usage),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    logprobs = [] if req.logprobs is not None else None
    text, finish = await collect(request, job, logprobs)
    finish_error(finish)
    return {**head, "choices": [{"index": 0, "text": text, "finish_reason": finish.reason,
                                 "logprobs": None if logprobs is None
                                 else completion_logprobs(logprobs)}], "usage": usage(finish)}


async def _completion_chunks(job, head: dict, include_usage: bool):
    offset = [0]

    def chunk(text: str, finish_reason=None, entries=()) -> str:
        logprobs = None
        if job.params.logprobs is not None and entries:
            logprobs = completion_logprobs(entries, offset[0])
            offset[0] = logprobs["text_offset"][-1] + len(entries[-1].token)
        body = {**head, "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                                     "finish_reason": finish_reason}]}
        return sse({**body, "usage": None} if include_usage else body)

    async for event in stream(job):
        if isinstance(event, Piece):
            yield chunk(event.text, entries=event.logprobs)
        elif event.reason == "error":
            yield sse({"error": {"message": f"generation failed: {event.error}",
                                 "type": "server_error", "param": None, "code": None}})
            return
        else:
            yield chunk("", event.reason)
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(event)})
    yield "data: [DONE]\n\n"
