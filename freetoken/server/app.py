"""The FastAPI app: the guard in front of every route (API key, body limit, request counts), the
error handlers that give each API its own error shape, and the small routes (/health, /metrics,
/tokenize, /detokenize, the admin route /admin/expert-cache). The generating routes live in
openai_routes.py and anthropic_routes.py.
"""
import hmac
import time
from dataclasses import asdict, dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from ..errors import ConfigError
from .chat import ChatFormat
from .errors import APIError, error_response
from .generation import read_body

OPEN_PATHS = ("/health",)  # answered without a key
ROUTES = ("/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
          "/v1/messages/count_tokens", "/health", "/metrics", "/tokenize", "/detokenize",
          "/admin/expert-cache")


class BodyTooLarge(Exception):
    """The request body grew past ServeConfig.max_body_mb while it was read."""


@dataclass
class ServerState:
    """What routes read (request.app.state.server); nothing here changes per request."""
    worker: object  # worker.EngineWorker
    chat: ChatFormat
    model_name: str
    metrics: object  # metrics.Metrics
    grammars: object  # grammar.Grammars (response_format, forced tool_choice)
    created: int = field(default_factory=lambda: int(time.time()))


class Guard:
    """ASGI middleware: counts every response by endpoint and status, checks the API key
    (`Authorization: Bearer KEY` or `x-api-key: KEY`), and refuses bodies over the limit (413)."""

    def __init__(self, app, api_key, max_body_bytes: int, metrics):
        self.app, self.api_key, self.max_body, self.metrics = app, api_key, max_body_bytes, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, status = scope["path"], [500]

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                if refusal[0] == 413:
                    await self._drain(receive, 0)
                await error_response(path, *refusal)(scope, receive, counted_send)
            else:
                await self.app(scope, self._limited(receive), counted_send)
        finally:
            endpoint = path if path in ROUTES else "other"
            self.metrics.requests.labels(endpoint=endpoint, status=str(status[0])).inc()

    def _refusal(self, scope):
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            auth = headers.get("authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else headers.get("x-api-key", "")
            if not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
                return 401, ("missing or wrong API key: send it as `Authorization: Bearer KEY` "
                             "or `x-api-key: KEY`")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body:
            return 413, self._too_large(int(length))
        return None

    def _too_large(self, size) -> str:
        return (f"the request body ({size} bytes) is over the server's limit of {self.max_body} "
                "bytes (--max-body-mb)")

    def _limited(self, receive):
        seen = [0]

        async def limited():
            message = await receive()
            seen[0] += len(message.get("body", b""))
            if seen[0] > self.max_body:
                if message.get("more_body"):
                    await self._drain(receive, seen[0])
                raise BodyTooLarge(self._too_large(f"more than {self.max_body}"))
            return message
        return limited

    async def _drain(self, receive, seen: int) -> None:
        """Read and drop the rest of a refused body, up to twice the limit in all, so that a
        client still sending it reads the 413 instead of a broken connection; past that the
        connection is closed on it."""
        while seen <= 2 * self.max_body:
            message = await receive()
            if message["type"] != "http.request":
                return
            seen += len(message.get("body", b""))
            if not message.get("more_body"):
                return


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = ""
    prompt: str = ""
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = ""
    tokens: list[int] = Field(default_factory=list)


class ExpertCacheRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gb: float = Field(ge=0, allow_inf_nan=False)


def create_app(state: ServerState, api_key=None, max_body_bytes: int = 32 << 20) -> FastAPI:
    """The app over `state` (routes read it from app.state.server)."""
    from . import anthropic_routes, openai_routes, responses_routes

    app = FastAPI(title="freetoken", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.include_router(openai_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(responses_routes.router)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes,
                       metrics=state.metrics)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return error_response(request.url.path, e.status, e.message, e.param, e.headers)

    @app.exception_handler(BodyTooLarge)
    async def too_large(request: Request, e: BodyTooLarge):
        return error_response(request.url.path, 413, str(e))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        message = f"{request.method} {request.url.path}: {e.detail}"
        return error_response(request.url.path, e.status_code, message)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):
        return error_response(request.url.path, 500, f"internal error: {type(e).__name__}: {e}")

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": state.model_name}

    @app.get("/metrics")
    async def metrics():
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await read_body(request, TokenizeRequest)
        ids = state.worker.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.worker.ctx_size}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await read_body(request, DetokenizeRequest)
        vocab = state.worker.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in 0..{vocab - 1}", param="tokens")
        return {"prompt": state.worker.tokenizer.decode(req.tokens)}

    @app.post("/admin/expert-cache")
    async def resize_expert_cache(request: Request):
        """The expert cache becomes `gb` GB at the engine's next safe point between steps;
        answers the memory plan after it and the resize (400: the engine's refusal)."""
        req = await read_body(request, ExpertCacheRequest)

        def resize(engine):
            done = engine.resize_expert_cache(req.gb, trigger="admin")
            return asdict(engine.memory_plan), done.as_dict()
        try:
            plan, done = await state.worker.call(resize)
        except ConfigError as e:
            raise APIError(400, str(e), param="gb") from None
        return {"plan": plan, "resize": done}

    return app
