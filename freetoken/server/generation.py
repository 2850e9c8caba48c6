"""What every generating route shares: parse the body into its pydantic model, check the budget,
submit to the worker, and read the job back (whole, or as a stream that a disconnect cancels).
Turns every failure into an APIError (400, 503) before any response starts."""
import asyncio
import json
import time
import uuid
from dataclasses import fields
from typing import AsyncIterator

from fastapi import Request
from pydantic import ValidationError

from ..errors import ConfigError
from ..sampling import SamplingParams
from .errors import APIError, validation_message
from .grammar import GrammarError
from .worker import Finish, Job, QueueFull

SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}


async def read_body(request: Request, model_cls):
    """The JSON body as `model_cls`; a body that is not JSON or not valid is a 400."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError:
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        raise APIError(400, validation_message(e)) from None


def sampling(**options) -> SamplingParams:
    """SamplingParams from the options given (None = `freetoken run`'s default); a value out of
    range is a 400 that names it."""
    given = {k: v for k, v in options.items() if v is not None}
    assert set(given) <= SAMPLING_FIELDS, set(given) - SAMPLING_FIELDS
    try:
        return SamplingParams(**given)
    except ConfigError as e:
        raise APIError(400, str(e)) from None


def budget(worker, num_prompt: int, max_tokens, param: str = "max_tokens") -> int:
    """The generation budget: max_tokens, or (None) what the context has left. 400 when the
    prompt leaves no room or max_tokens asks for more than there is."""
    ctx = worker.ctx_size
    left = ctx - num_prompt
    if num_prompt == 0:
        raise APIError(400, "the prompt is empty")
    if left < 1:
        raise APIError(400, f"the prompt has {num_prompt} tokens but the context is {ctx} "
                            "(--ctx-size); shorten the prompt or restart the server with a "
                            "larger --ctx-size", param="messages")
    if max_tokens is None:
        return left
    if max_tokens > left:
        raise APIError(400, f"{param} is {max_tokens} but the prompt ({num_prompt} tokens) leaves "
                            f"{left} of the {ctx}-token context (--ctx-size); lower {param} or "
                            "raise --ctx-size", param=param)
    return max_tokens


async def constraint(grammars, schema=None, tools=None, parallel: bool = True,
                     schema_param: str = "response_format"):
    """A fresh grammar constraint: of JSON schema, or of calls of tools ([(name, parameters)]);
    None when neither. What the grammar library refuses is a 400 (param: "tools", or
    schema_param, the request field the schema came from). Compiles off the event loop."""
    if schema is None and tools is None:
        return None
    try:
        if tools is not None:
            grammar = await asyncio.to_thread(grammars.tool_calls, tools, parallel)
        else:
            grammar = await asyncio.to_thread(grammars.json_schema, schema)
    except GrammarError as e:
        raise APIError(400, str(e), param="tools" if tools else schema_param) from None
    return grammars.constraint(grammar)


def submit(worker, prompt_ids: list, params: SamplingParams, constraint=None) -> Job:
    try:
        return worker.submit(prompt_ids, params, constraint)
    except QueueFull as e:
        raise APIError(503, f"the server is busy ({e}); retry shortly",
                       headers={"Retry-After": "1"}) from None


async def _watch_disconnect(request: Request, job: Job) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()


async def collect(request: Request, job: Job, logprobs: list = None) -> tuple:
    """(all text pieces joined, Finish), cancelling the job if the client goes away first.
    logprobs (a list): gets the pieces' TokenLogprobs."""
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    pieces = []
    try:
        while True:
            event = await job.next_event()
            if isinstance(event, Finish):
                return "".join(pieces), event
            pieces.append(event.text)
            if logprobs is not None:
                logprobs.extend(event.logprobs)
    finally:
        watcher.cancel()
        job.cancel()  # no-op once finished; cancels when this task itself is cancelled


async def stream(job: Job) -> AsyncIterator:
    """The job's events (Piece..., Finish); leaving early (a disconnect cancels the response's
    task) cancels the job."""
    try:
        while True:
            event = await job.next_event()
            yield event
            if isinstance(event, Finish):
                return
    finally:
        job.cancel()


def finish_error(finish: Finish) -> None:
    """A job that failed in the engine becomes a 500 with its message."""
    if finish.reason == "error":
        raise APIError(500, f"generation failed: {finish.error}")


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def sse(data: dict, event: str = None) -> str:
    """One server-sent event (`event:` line only where the API names its events)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"
