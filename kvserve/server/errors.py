"""Error responses in OpenAI's format, shared by the server and the router.

Both answer a bad request the same way: ``{"error": {"message", "type", "param", "code"}}``
with the status OpenAI uses and ``type`` the name of the exception the official ``openai``
client raises for that status (``BadRequestError`` for 400 …). Bodies are rendered as ASCII
JSON, so no message can fail to encode (a lone surrogate in a client's string is escaped,
never a 500).
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi.responses import Response

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
NOT_UTF8 = "the body is not valid JSON: it is not UTF-8 text"
INVALID_TEXT = "is not valid Unicode text (it contains a lone UTF-16 surrogate)"


def retry_after(excess: int, rate: float) -> int:
    """A 429's ``Retry-After``: the seconds ``excess`` queued requests take to finish at
    ``rate`` requests per second (at least 1, at most 60; 5 when none finished lately)."""
    if rate <= 0:
        return 5
    return max(1, min(60, math.ceil(excess / rate)))


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "APIError")


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``: the body
    of every error response and SSE error event, on workers and routers alike."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    type_: str | None = None,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """The JSON error response (ASCII-escaped; ``type_`` defaults from the status)."""
    body = error_body(message, type_ or error_type(status), param, code)
    return Response(
        json.dumps(body, ensure_ascii=True),
        status_code=status,
        headers=headers,
        media_type="application/json",
    )


def json_error_message(msg: str, pos: int | None) -> str:
    """How both the server and the router word a body that does not parse as JSON."""
    where = "" if pos is None else f" at position {pos}"
    return f"the body is not valid JSON: {msg}{where}"


def invalid_text_path(obj: Any, path: str = "") -> str | None:
    """The dotted path (``messages.0.content``) of the first string in a parsed JSON value
    that cannot be encoded as UTF-8 (a lone surrogate such as ``"\\ud800"``), or None."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(obj, dict):
        items: Any = obj.items()
    elif isinstance(obj, list):
        items = enumerate(obj)
    else:
        return None
    for key, value in items:
        sub = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and invalid_text_path(key) is not None:
            return sub
        found = invalid_text_path(value, sub)
        if found is not None:
            return found
    return None


class APIError(Exception):
    """An error response: ``{"error": {"message", "type", "param", "code"}}`` + status."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type_ or error_type(status)
        self.param, self.code, self.headers = param, code, headers

    def response(self) -> Response:
        return error_response(
            self.status, self.message, self.type, self.param, self.code, self.headers
        )

    def body(self) -> dict[str, Any]:
        """Its error object, as an SSE error event carries it once a stream has begun."""
        return error_body(self.message, self.type, self.param, self.code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "BadRequestError", param, code)


def field_error(e: ValueError) -> APIError:
    """The 400 for a ValueError whose message starts with the field it is about
    (``"logit_bias: keys must be token ids"`` → param ``logit_bias``)."""
    message = str(e)
    head = message.split(":", 1)[0]
    param = head if ":" in message and head.replace(".", "_").isidentifier() else None
    return bad_request(message, param)


def unavailable(message: str) -> APIError:
    return APIError(503, message, "ServiceUnavailableError")
