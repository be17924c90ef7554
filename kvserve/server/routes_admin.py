"""Health, readiness, metrics, admin and session endpoints."""

from __future__ import annotations

import contextlib

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvserve.engine.messages import (
    CheckIntegrity,
    DeleteSession,
    GetKVStats,
    GetSession,
    ResetPrefixCache,
    SessionInfo,
)
from kvserve.engine.stats import KVStats
from kvserve.server.auth import Principal, authenticate
from kvserve.server.errors import APIError, bad_request, unavailable
from kvserve.server.state import ServerState


def admin_routes(state: ServerState) -> APIRouter:
    router = APIRouter()
    engine = state.engine

    # ---- plain endpoints ------------------------------------------------------------------
    @router.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            raise unavailable("the engine is not running")
        return Response(status_code=200)

    @router.get("/ready")
    async def ready() -> JSONResponse:
        """200 while serving; ``degraded`` names the dependencies failing now (a KV store
        tier whose circuit breaker is open: ``kv_store:redis``), which cost cache hits,
        not requests. 503 while draining or without an engine."""
        if not engine.is_running or state.draining:
            reason = "draining" if state.draining else "engine not running"
            raise unavailable(f"not ready: {reason}")
        degraded = [f"kv_store:{name}" for name in engine.stats().store_down]
        return JSONResponse(
            {
                "status": "degraded" if degraded else "ready",
                "model": state.model_name,
                "degraded": degraded,
            }
        )

    @router.get("/metrics")
    async def metrics() -> Response:
        snap = None
        if engine.is_running:
            with contextlib.suppress(Exception):  # a busy or failed engine: basic metrics only
                snap = await engine.call(GetKVStats(), KVStats, timeout=10)
        state.metrics.set_snapshot(snap)
        await state.responses.sweep()  # expired responses leave the gauges (and their KV)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- admin ----------------------------------------------------------------------------
    @router.post("/admin/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> JSONResponse:
        authenticate(request, state.config, admin=True)
        n = await engine.call(ResetPrefixCache(), int)
        return JSONResponse({"evicted_blocks": n})

    @router.post("/admin/check_integrity")
    async def check_integrity(request: Request) -> JSONResponse:
        """The engine's KV bookkeeping checked between steps (blocks, ref counts, tenants'
        ledgers, swap space): 200 when consistent, 500 naming the inconsistency."""
        authenticate(request, state.config, admin=True)
        try:
            await engine.call(CheckIntegrity(), timeout=30)
        except ValueError as e:
            raise APIError(500, str(e), "InternalServerError") from None
        return JSONResponse({"ok": True})

    # ---- sessions ------------------------------------------------------------------------
    def _session_principal(request: Request) -> Principal:
        principal = authenticate(request, state.config)
        if not engine.info.has_kv_store:
            raise APIError(
                404, "sessions need a KV store (--kv-store)", "NotFoundError", code="no_kv_store"
            )
        return principal

    @router.get("/v1/sessions/{session_id}")
    async def get_session(request: Request, session_id: str) -> JSONResponse:
        principal = _session_principal(request)
        info = await engine.call(GetSession(principal.tenant, session_id), SessionInfo | None)
        if info is None:
            raise APIError(404, f"no session {session_id!r}", "NotFoundError", "session_id")
        return JSONResponse(
            {
                "id": session_id,
                "object": "session",
                "num_tokens": info.num_tokens,
                "num_blocks": info.num_blocks,
                "updated_at": info.updated_at,
                "expires_at": info.expires_at,
            }
        )

    @router.delete("/v1/sessions/{session_id}")
    async def delete_session(request: Request, session_id: str) -> JSONResponse:
        principal = _session_principal(request)
        deleted = await engine.call(DeleteSession(principal.tenant, session_id), bool)
        if not deleted:
            raise APIError(404, f"no session {session_id!r}", "NotFoundError", "session_id")
        return JSONResponse({"id": session_id, "object": "session.deleted", "deleted": True})

    @router.post("/admin/tenants/reload")
    async def reload_tenants(request: Request) -> JSONResponse:
        authenticate(request, state.config, admin=True)
        try:
            new = await state.reload_tenants()
        except ValueError as e:
            raise bad_request(str(e)) from None
        return JSONResponse({"tenants": [t.name for t in new.tenants], "source": new.source})

    return router
