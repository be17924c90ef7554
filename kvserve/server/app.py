"""The OpenAI-compatible HTTP app over an ``AsyncLLM`` (the engine core in its own
process): it mounts the routes of each surface — OpenAI (``routes_openai``), health,
metrics, admin and sessions (``routes_admin``), cluster internals (``routes_cluster``).

Every error is a JSON body ``{"error": {"message", "type", "param", "code"}}`` with the
status OpenAI uses: 400 bad body / too long, 401 bad key, 404 unknown model, 429 queue
full (with ``Retry-After``), 503 draining or engine gone, 500 for a bug (the server stays up).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.engine.async_llm import AsyncLLM
from kvserve.server.config import ServerConfig
from kvserve.server.errors import APIError, bad_request
from kvserve.server.routes_admin import admin_routes
from kvserve.server.routes_cluster import cluster_routes
from kvserve.server.routes_openai import openai_routes
from kvserve.server.state import ServerState

__all__ = ["ServerConfig", "ServerState", "build_app"]


def build_app(engine: AsyncLLM, config: ServerConfig, lifespan=None) -> FastAPI:
    """The app; ``lifespan`` (``kvserve serve``'s) attaches and shuts down ``engine``."""
    app = FastAPI(title="kvserve", version="0.1.0", lifespan=lifespan)
    state = ServerState(engine, config)
    app.state.kv = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        state.metrics.http_errors.labels(state.model_name, str(e.status)).inc()
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = first.get("msg", "invalid request")
        return await _api_error(
            _, bad_request(f"{'.'.join(loc) or 'body'}: {msg}", ".".join(loc) or None)
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = {404: "NotFoundError", 405: "MethodNotAllowed"}.get(e.status_code, "Error")
        return await _api_error(_, APIError(e.status_code, str(e.detail), kind))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        return await _api_error(_, APIError(500, f"internal error: {e!r}", "InternalServerError"))

    app.include_router(admin_routes(state))
    app.include_router(openai_routes(state))
    app.include_router(cluster_routes(state))
    return app
