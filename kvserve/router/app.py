"""The router's HTTP app: OpenAI-compatible endpoints relayed to the cluster's workers.

``POST /v1/completions``, ``/v1/chat/completions`` and ``/v1/responses`` go through
``relay.Relay`` (session affinity, failover; a response's session is its conversation, so
``previous_response_id`` goes to the worker holding it); a stored response's ``GET``,
``DELETE`` and input items go to that worker first, then to any other;
``GET /v1/models`` is answered by any routable worker; ``/health``
(the router process is up), ``/ready`` (at least one routable worker), ``/metrics``
(Prometheus, the router's own ``kvserve_router_*`` series) and ``GET /router/workers``
(the router's view, JSON: workers, the routing policy, the tokenizers held and wanted)
are local. Prefix placement tokenizes with ``--tokenizer``'s tokenizer or the ones it
takes from the workers (``tokenizers``); until it has one for a request's candidates,
the request is placed least-loaded. Errors use OpenAI's format. Responses name the worker
that took the request in ``X-Kvserve-Worker`` (the first one, for a stream that later
failed over).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.ha.coordination import Coordinator
from kvserve.kv.events import events_key
from kvserve.router.config import RouterConfig
from kvserve.router.flow import Flow
from kvserve.router.index import PrefixIndex
from kvserve.router.kv_sync import KVSync
from kvserve.router.metrics import RouterMetrics
from kvserve.router.prompts import PromptReader
from kvserve.router.relay import Relay, Unroutable
from kvserve.router.scoring import Placement
from kvserve.router.tokenizers import Tokenizers, load_override
from kvserve.router.workers import WorkerPool
from kvserve.server.disconnect import ClientGone, unless_disconnected
from kvserve.server.errors import (
    INVALID_TEXT,
    NOT_UTF8,
    error_response,
    invalid_text_path,
    json_error_message,
)


def _error(
    status: int,
    message: str,
    type_: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
):
    """The same OpenAI-shaped (and ASCII-safe) error body the workers answer with."""
    return error_response(status, message, type_, param, headers=headers)


def build_router_app(config: RouterConfig, coord: Coordinator | None = None) -> FastAPI:
    # short round trips: while Redis is away requests are routed without affinity
    coord = coord or Coordinator.from_url(config.cluster, timeout=config.probe_timeout * 2)
    holder: dict[str, Any] = {}
    metrics = RouterMetrics(lambda: holder["pool"], lambda: holder.get("tokenizers"))
    policy = config.routing_policy
    prefix = policy == "prefix"
    override = load_override(config.tokenizer) if prefix else None  # a bad path: at start
    index = PrefixIndex() if prefix else None
    placement = Placement(
        policy,
        index,
        config.routing_load_weight,
        config.routing_host_weight,
        events_key(config.cluster_secret),
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        pool = WorkerPool(coord, config)
        sync = tokenizers = None
        if index is not None:
            timeout = config.probe_timeout * 4
            sync = KVSync(index, pool.client, config.cluster_secret, timeout, metrics)
            tokenizers = Tokenizers(
                override, pool.client, config.cluster_secret, timeout, pool.secret_matches, metrics
            )
            pool.on_refresh += [sync.follow, tokenizers.follow]
            holder["tokenizers"] = tokenizers
            holder["prompts"] = PromptReader(tokenizers)
            sync.start()
        holder["pool"] = pool
        holder["relay"] = Relay(pool, coord, config, metrics, placement)
        await pool.refresh()
        pool.start()
        try:
            yield
        finally:
            if tokenizers is not None:
                await tokenizers.stop()
            if sync is not None:
                await sync.stop()
            await pool.stop()

    app = FastAPI(title="kvserve router", lifespan=lifespan)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> Response:
        return _error(e.status_code, str(e.detail))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        n = len(holder["pool"].routable())
        return JSONResponse({"routable_workers": n}, status_code=200 if n else 503)

    @app.get("/metrics")
    async def prom() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/router/workers")
    async def workers() -> JSONResponse:
        pool: WorkerPool = holder["pool"]
        tokenizers: Tokenizers | None = holder.get("tokenizers")
        routable = {w.node_id for w in pool.routable()}
        return JSONResponse(
            {
                "registry_ok": pool.registry_ok,
                "workers": [
                    {
                        "id": w.node_id,
                        "url": w.url,
                        "healthy": w.healthy,
                        "routable": w.node_id in routable,
                        "secret_ok": pool.secret_matches(w),
                        "inflight": w.inflight,
                        "running": w.info.get("running"),
                        "waiting": w.info.get("waiting"),
                        "role": w.role,
                        "kv_index": None
                        if index is None or "kv_events" not in w.info
                        else {"synced": index.is_synced(w.node_id), **index.sizes(w.node_id)},
                        "tokenizer_fp": w.info.get("tokenizer_fp"),
                    }
                    for w in pool.workers.values()
                ],
                "routing": policy,
                "tokenizers": None if tokenizers is None else tokenizers.view(),
            }
        )

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        pool: WorkerPool = holder["pool"]
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        for w in sorted(pool.routable(), key=lambda w: w.load):
            try:
                r = await pool.client(w).get(w.url + "/v1/models", headers=headers, timeout=5)
            except httpx.HTTPError:
                continue
            return Response(r.content, r.status_code, media_type="application/json")
        return _error(503, "no worker is available", "ServiceUnavailableError")

    async def generate(request: Request, kind: str) -> Response:
        arrived = time.perf_counter()
        metrics.requests.labels(kind).inc()
        try:
            body = json.loads(await request.body())
        except UnicodeDecodeError:
            return _error(400, NOT_UTF8)
        except json.JSONDecodeError as e:
            return _error(400, json_error_message(e.msg, e.pos))
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        bad_text = invalid_text_path(body)
        if bad_text is not None:  # worded as a worker words it (server/protocol.py)
            return _error(400, f"{bad_text}: {INVALID_TEXT}", param=bad_text)
        if kind == "responses":
            flow = Flow.for_response(body, request.headers)
        else:
            flow = Flow.from_client(kind, body, request.headers)
        flow.arrived = arrived
        retry = holder["pool"].overload()
        if retry is not None:  # every worker's queue is full: shed here, before forwarding
            metrics.shed.inc()
            return _error(429, "every worker's queue is full; retry later", "RateLimitError",
                          headers={"Retry-After": str(retry)})  # fmt: skip
        if prefix:  # in the tokens of each model the candidates serve
            fps = {w.info.get("tokenizer_fp") for w in holder["pool"].routable()}
            flow.prompt = await holder["prompts"].read(kind, body, fps)
        relay: Relay = holder["relay"]
        if body.get("stream"):  # a stream notices a disconnect when it writes
            return await _answer(relay, flow, body)
        try:  # a client that leaves closes the worker's connection: it aborts there
            return await unless_disconnected(request, _answer(relay, flow, body))
        except ClientGone as gone:
            return gone.response()

    async def _answer(relay: Relay, flow: Flow, body: dict[str, Any]) -> Response:
        """Open the request on a worker and relay its answer: an SSE stream, or the whole
        JSON (continued elsewhere on failures)."""
        try:
            w, resp = await relay.open(flow)
        except Unroutable as u:
            return JSONResponse(u.body, status_code=u.status)
        served = {"X-Kvserve-Worker": w.node_id, "X-Session-Id": flow.session}
        if (
            flow.kind == "responses"
            or flow.ephemeral
            or not (flow.session.isascii() and flow.session.isprintable())
        ):
            served.pop("X-Session-Id")  # (a header carries printable ASCII only)
        if resp.status_code != 200:  # the worker's own answer (a 4xx): relay it as is
            content = await resp.aread()
            await resp.aclose()
            w.inflight -= 1
            return Response(content, resp.status_code, served, media_type="application/json")
        if body.get("stream"):
            return StreamingResponse(
                relay.events(flow, w, resp),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", **served},
            )
        try:
            return JSONResponse(await relay.whole(flow, w, resp), headers=served)
        except Unroutable as u:
            return JSONResponse(u.body, status_code=u.status)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate(request, "chat")

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await generate(request, "responses")

    async def stored(request: Request, response_id: str) -> Response:
        """A stored response's GET / DELETE / input items: asked of the worker holding
        its conversation first, then of the others (each reads the shared tier)."""
        relay: Relay = holder["relay"]
        w, status, content = await relay.forward(
            request.method, request.url.path, request.url.query, response_id,
            request.headers.get("authorization"),
        )  # fmt: skip
        headers = {"X-Kvserve-Worker": w.node_id} if w is not None else {}
        return Response(content, status, headers, media_type="application/json")

    for path in ("/v1/responses/{response_id}", "/v1/responses/{response_id}/input_items"):
        app.add_api_route(path, stored, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", stored, methods=["DELETE"])

    return app
