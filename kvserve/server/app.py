"""The OpenAI-compatible HTTP app over an ``AsyncLLM`` (the engine core in its own
process): it mounts the routes of each surface — OpenAI (``routes_openai``, Responses
in ``responses.routes``), health,
metrics, admin and sessions (``routes_admin``), cluster internals (``routes_cluster``).

Every error is a JSON body ``{"error": {"message", "type", "param", "code"}}`` with the
status OpenAI uses: 400 bad body / too long, 401 bad key, 404 unknown model, 429 queue
full (with ``Retry-After``), 503 draining or engine gone, 500 for a bug (the server stays up).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.engine.async_llm import AsyncLLM
from kvserve.server.config import ServerConfig
from kvserve.server.errors import NOT_UTF8, APIError, bad_request, json_error_message
from kvserve.server.responses.routes import responses_routes
from kvserve.server.routes_admin import admin_routes
from kvserve.server.routes_cluster import cluster_routes
from kvserve.server.routes_openai import openai_routes
from kvserve.server.state import ServerState

__all__ = ["ServerConfig", "ServerState", "build_app"]


def validation_error(errors: Sequence[Any]) -> APIError:
    """The 400 for FastAPI's first validation error, worded as the router words its own."""
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    kind, ctx = first.get("type"), first.get("ctx") or {}
    if kind == "json_invalid":
        pos = first.get("loc", (None, None))[-1]
        return bad_request(json_error_message(str(ctx.get("error", "")), pos))
    if "path" in ctx:  # a custom error naming the offending field (protocol.py, responses)
        return bad_request(first.get("msg", "invalid request"), ctx["path"])
    if kind == "model_attributes_type" and not loc:
        return bad_request("the body must be a JSON object")
    if kind == "extra_forbidden":  # a field kvserve does not implement: refused, not ignored
        name = ".".join(loc)
        return bad_request(
            f"{name}: this field is not supported by kvserve (docs/agents.md lists the "
            "fields it accepts)",
            name,
            "unsupported_field",
        )
    msg = first.get("msg", "invalid request")
    return bad_request(f"{'.'.join(loc) or 'body'}: {msg}", ".".join(loc) or None)


def build_app(engine: AsyncLLM, config: ServerConfig, lifespan=None) -> FastAPI:
    """The app; ``lifespan`` (``kvserve serve``'s) attaches and shuts down ``engine``."""
    app = FastAPI(title="kvserve", version="0.1.0", lifespan=lifespan)
    state = ServerState(engine, config)
    app.state.kv = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> Response:
        state.metrics.http_errors.labels(state.model_name, str(e.status)).inc()
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> Response:
        return await _api_error(_, validation_error(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> Response:
        message = str(e.detail)
        if e.status_code == 400 and message == "There was an error parsing the body":
            message = NOT_UTF8  # the only body FastAPI fails to read before JSON parsing
        return await _api_error(_, APIError(e.status_code, message))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> Response:
        return await _api_error(_, APIError(500, f"internal error: {e!r}", "InternalServerError"))

    app.include_router(admin_routes(state))
    app.include_router(openai_routes(state))
    app.include_router(responses_routes(state, state.responses))
    app.include_router(cluster_routes(state))
    return app
