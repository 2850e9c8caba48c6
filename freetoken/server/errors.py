"""APIError and each API's error JSON: OpenAI's {"error": {message, type, param, code}} and
Anthropic's {"type": "error", "error": {type, message}}, chosen by the request's path."""
from typing import Optional

from fastapi.responses import JSONResponse

OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 413: "invalid_request_error", 500: "server_error",
                503: "server_overloaded"}
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   404: "not_found_error", 413: "request_too_large", 500: "api_error",
                   503: "overloaded_error"}


class APIError(Exception):
    """A request that gets `status` and `message` (which says what to change) in its API's shape."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(path: str, status: int, message: str, param: Optional[str] = None) -> dict:
    if is_anthropic(path):
        return {"type": "error",
                "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    return {"error": {"message": message, "type": OPENAI_TYPES.get(status, "server_error"),
                      "param": param, "code": None}}


def error_response(path: str, status: int, message: str, param: Optional[str] = None,
                   headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(error_body(path, status, message, param), status_code=status,
                        headers=headers)


def validation_message(err) -> str:
    """One line from a pydantic ValidationError: where, and what is wrong."""
    parts = []
    for e in err.errors()[:3]:
        where = ".".join(str(p) for p in e["loc"]) or "body"
        msg = "unknown field (not accepted by this API)" if e["type"] == "extra_forbidden" \
            else e["msg"]
        parts.append(f"{where}: {msg}")
    return "; ".join(parts)
