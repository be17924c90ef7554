"""Error responses in OpenAI's format."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error response: ``{"error": {"message", "type", "param", "code"}}`` + status."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type_
        self.param, self.code, self.headers = param, code, headers

    def response(self) -> JSONResponse:
        body = {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "BadRequestError", param)


def unavailable(message: str) -> APIError:
    return APIError(503, message, "ServiceUnavailableError")
