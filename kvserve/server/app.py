"""The OpenAI-compatible HTTP app: /v1/completions, /v1/chat/completions, /v1/models,
/health, /ready, /metrics and admin endpoints, over an ``AsyncLLM`` (the engine core in its
own process).

Every error is a JSON body ``{"error": {"message", "type", "param", "code"}}`` with the
status OpenAI uses: 400 bad body / too long, 401 bad key, 404 unknown model, 429 queue
full (with ``Retry-After``), 503 draining, 500 for a bug (the server stays up).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.engine.async_llm import AsyncLLM, RequestStream
from kvserve.engine.errors import EngineDeadError, EngineError
from kvserve.engine.messages import (
    AcceptPush,
    DeleteSession,
    GetKVStats,
    GetSession,
    ReadCheckpoint,
    ResetPrefixCache,
    SessionInfo,
    SetTenantBudgets,
)
from kvserve.engine.stats import KVStats
from kvserve.request import RequestOutput
from kvserve.sampling import SamplingParams, child_seed
from kvserve.server.auth import Principal, authenticate
from kvserve.server.errors import APIError, bad_request, unavailable
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.server.render import ChoiceState, usage
from kvserve.tenants import TenantsConfig


@dataclass(frozen=True)
class ServerConfig:
    """``kvserve serve`` options beyond the engine's (CLI flags map one-to-one)."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_keys: tuple[str, ...] = ()
    admin_key: str | None = None
    max_waiting_requests: int = 1024
    graceful_timeout: float = 30.0
    tenants: TenantsConfig | None = None  # API key → tenant; overrides api_keys
    cluster_secret: str | None = None  # authenticates /internal/* (header X-Kvserve-Cluster-Secret)
    advertise_url: str | None = None  # how other cluster members reach this worker

    def __post_init__(self) -> None:
        if self.max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be at least 1")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")


class ServerState:
    def __init__(self, engine: AsyncLLM, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.model_name = config.served_model_name or engine.info.model
        self.model_aliases = {self.model_name, engine.info.model}
        self.metrics = ServerMetrics(engine, self.model_name)
        self.draining = False
        self.created = int(time.time())
        self.max_model_len = engine.info.max_model_len
        self.tokenizer = engine.tokenizer
        self.coord = None  # the cluster coordinator, for session owner look-ups
        if engine.info.cluster is not None:
            from kvserve.ha.coordination import Coordinator

            self.coord = Coordinator.from_url(engine.info.cluster)

    def budgets(self, tenants: TenantsConfig) -> dict:
        info = self.engine.info
        return tenants.budgets(info.num_blocks, info.block_size, info.bytes_per_block)

    async def reload_tenants(self) -> TenantsConfig:
        """Re-read the tenants file and apply it: API keys at once, budgets on the engine
        thread between steps (running requests keep their blocks). Raises ValueError, changing
        nothing, when the file is invalid or there is none."""
        current = self.config.tenants
        if current is None:
            raise ValueError("the server runs without a tenants file (--tenants)")
        new = TenantsConfig.load(current.source)
        await self.engine.call(SetTenantBudgets(self.budgets(new)))
        self.config = dataclasses.replace(self.config, tenants=new)
        return new


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

    # ---- plain endpoints ------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            raise unavailable("the engine is not running")
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if not engine.is_running or state.draining:
            reason = "draining" if state.draining else "engine not running"
            raise unavailable(f"not ready: {reason}")
        return JSONResponse({"status": "ready", "model": state.model_name})

    @app.get("/metrics")
    async def metrics() -> Response:
        snap = None
        if engine.is_running:
            with contextlib.suppress(Exception):  # a busy or failed engine: basic metrics only
                snap = await engine.call(GetKVStats(), KVStats, timeout=10)
        state.metrics.set_snapshot(snap)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authenticate(request, state.config)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": state.model_name,
                        "object": "model",
                        "created": state.created,
                        "owned_by": "kvserve",
                        "max_model_len": state.max_model_len,
                    }
                ],
            }
        )

    # ---- admin ----------------------------------------------------------------------------
    @app.post("/admin/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> JSONResponse:
        authenticate(request, state.config, admin=True)
        n = await engine.call(ResetPrefixCache(), int)
        return JSONResponse({"evicted_blocks": n})

    # ---- sessions ------------------------------------------------------------------------
    def _session_principal(request: Request) -> Principal:
        principal = authenticate(request, state.config)
        if not engine.info.has_kv_store:
            raise APIError(
                404, "sessions need a KV store (--kv-store)", "NotFoundError", code="no_kv_store"
            )
        return principal

    @app.get("/v1/sessions/{session_id}")
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

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(request: Request, session_id: str) -> JSONResponse:
        principal = _session_principal(request)
        deleted = await engine.call(DeleteSession(principal.tenant, session_id), bool)
        if not deleted:
            raise APIError(404, f"no session {session_id!r}", "NotFoundError", "session_id")
        return JSONResponse({"id": session_id, "object": "session.deleted", "deleted": True})

    # ---- internal (cluster) -------------------------------------------------------------
    def _cluster_auth(request: Request) -> None:
        secret = state.config.cluster_secret
        if secret is None:
            raise APIError(403, "internal endpoints need --cluster-secret", "PermissionDeniedError")
        given = request.headers.get("x-kvserve-cluster-secret", "")
        if not hmac.compare_digest(given.encode(), secret.encode()):
            raise APIError(401, "invalid cluster secret", "AuthenticationError")

    @app.post("/internal/resume")
    async def internal_resume(request: Request) -> Response:
        """Continue a session's stream after a failover. Body: ``session_id``,
        ``delivered_token_ids`` and ``delivered_text_chars`` (what the client has),
        optional ``seen_epoch`` and ``ephemeral``, and the client's original ``request`` (``kind``
        ``completion`` or ``chat``). The response continues exactly where the client is."""
        _cluster_auth(request)
        coord = state.coord
        if coord is None:
            raise APIError(404, "this worker is not in a cluster (--cluster)", "NotFoundError")
        try:
            body = await request.json()
            session_id = str(body["session_id"])
            delivered = [int(t) for t in body.get("delivered_token_ids", [])]
            chars = int(body.get("delivered_text_chars", 0))
            seen = body.get("seen_epoch")
            chat = body.get("kind", "completion") == "chat"
            model = ChatCompletionRequest if chat else CompletionRequest
            original = model.model_validate(body.get("request") or {})
        except (ValueError, KeyError, TypeError) as e:
            raise bad_request(f"bad resume request: {e}") from None
        if original.logprobs:
            raise bad_request("streams with logprobs cannot be resumed")
        principal = authenticate(request, state.config)  # the client's key, forwarded
        try:
            record = _record_from_request(
                original, principal.tenant, session_id, chat, bool(body.get("ephemeral"))
            )
        except ValueError as e:
            raise bad_request(str(e)) from None
        try:
            owner = await asyncio.to_thread(coord.owner, session_id)
        except Exception as e:
            raise unavailable(f"the cluster coordinator is unreachable: {e}") from None
        replicated = json.loads(owner.state) if owner is not None and owner.state else None
        if replicated is None and engine.info.has_checkpointer:  # another site's state
            raw = await engine.call(ReadCheckpoint(session_id), bytes | None)
            replicated = json.loads(raw) if raw is not None else None
        if replicated is not None and all(
            replicated.get(k) == record[k] for k in ("prompt_token_ids", "params", "tenant")
        ):
            record = replicated  # this very request (its seed, when the client gave none)
        if seen is None:
            seen = owner.epoch if owner is not None else 0
        rid = f"resume-{uuid.uuid4().hex[:24]}"
        try:
            stream = await engine.resume(rid, record, delivered, int(seen))
        except EngineError as e:
            raise APIError(409, str(e), "ConflictError") from None
        params = SamplingParams(**record["params"])
        kind = "chat.completion" if chat else "text_completion"
        resp_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        return await _respond(
            state,
            original,
            [stream],
            params,
            kind,
            resp_id,
            request,
            resume=(len(delivered), chars),
        )

    def _chat_prompt_ids(body: ChatCompletionRequest) -> list[int]:
        """The prompt token ids of a chat request (the same for its first run and for a
        resume elsewhere: a failover must see exactly the primary's prompt)."""
        tok = state.tokenizer
        text = tok.apply_chat_template(body.conversation(), body.add_generation_prompt)
        return tok.encode(text, add_special_tokens=False)

    def _record_from_request(
        original: CompletionRequest | ChatCompletionRequest,
        tenant: str,
        session_id: str,
        chat: bool,
        request_ephemeral: bool,
    ) -> dict[str, Any]:
        """The session record of ``original`` as its primary started it (nothing
        generated): a stream resumes from it when its primary replicated nothing yet.
        Exact for greedy and seeded requests. Raises ValueError."""
        params = original.sampling_params()
        if params.n != 1:
            raise ValueError("only single-choice (n = 1) streams can be resumed")
        if chat:
            if state.tokenizer is None:
                raise ValueError("the model has no tokenizer, so chat is unavailable")
            prompt_ids = _chat_prompt_ids(original)
        else:
            prompts = original.prompts()
            if len(prompts) != 1:
                raise ValueError("only single-prompt streams can be resumed")
            p = prompts[0]
            prompt_ids = engine.tokenize(p) if isinstance(p, str) else list(p)
        return {
            "session_id": session_id,
            "tenant": tenant,
            "cache_salt": original.cache_salt,
            "prompt_token_ids": prompt_ids,
            "params": params.to_dict(),
            # no seed: exact only when greedy (the router always sends one)
            "seed": params.seed if params.seed is not None else secrets.randbits(63),
            "ephemeral": request_ephemeral,
        }

    @app.post("/internal/drain")
    async def internal_drain(request: Request) -> JSONResponse:
        """Take this worker out of rotation (body ``{"drain": true}``, the default) or back
        in (``false``): while draining ``/ready`` answers 503, so routers send it no new
        requests, and running streams finish here. Answers the running request count."""
        _cluster_auth(request)
        try:
            raw = await request.body()
            drain = bool(json.loads(raw).get("drain", True)) if raw else True
        except (ValueError, AttributeError) as e:
            raise bad_request(f"bad drain request: {e}") from None
        state.draining = drain
        return JSONResponse({"draining": drain, "running": engine.stats().running})

    @app.post("/internal/replica")
    async def internal_replica(request: Request) -> JSONResponse:
        """A primary's direct push (``--replicate-to standby``): verified blocks go into
        this worker's host tier (``ha.push``)."""
        _cluster_auth(request)
        if not engine.info.has_kv_store:
            raise APIError(404, "this worker has no KV store", "NotFoundError")
        body = await request.body()
        try:
            accepted, refused = await engine.call(AcceptPush(body), list[int])
        except ValueError as e:
            raise bad_request(str(e)) from None
        state.metrics.pushed_blocks.labels(state.model_name, "accepted").inc(accepted)
        state.metrics.pushed_blocks.labels(state.model_name, "refused").inc(refused)
        return JSONResponse({"accepted": accepted, "refused": refused})

    @app.post("/admin/tenants/reload")
    async def reload_tenants(request: Request) -> JSONResponse:
        authenticate(request, state.config, admin=True)
        try:
            new = await state.reload_tenants()
        except ValueError as e:
            raise bad_request(str(e)) from None
        return JSONResponse({"tenants": [t.name for t in new.tenants], "source": new.source})

    # ---- generation -------------------------------------------------------------------------
    def _admit(body: CompletionRequest | ChatCompletionRequest) -> None:
        if state.draining:
            raise unavailable("the server is shutting down")
        if not engine.is_running:
            raise unavailable("the engine is not running")
        if body.model is not None and body.model not in state.model_aliases:
            raise APIError(
                404,
                f"The model `{body.model}` does not exist.",
                "NotFoundError",
                "model",
                "model_not_found",
            )
        if engine.stats().waiting >= config.max_waiting_requests:
            raise APIError(
                429,
                "too many requests are waiting; retry later",
                "RateLimitError",
                headers={"Retry-After": "1"},
            )

    async def _start(
        prompts: list[str | list[int]],
        params: SamplingParams,
        principal: Principal,
        body: Any,
        request: Request,
    ) -> list[RequestStream]:
        """Add every (prompt, n) sequence; on any rejection abort the rest → 400.
        The session id comes from the body or the ``X-Session-Id`` header; a router adds
        ``X-Kvserve-Session-Epoch`` (and ``X-Kvserve-Ephemeral-Session: 1`` for an id it
        made up for a request that had none; ``X-Kvserve-Standby``: the node to pre-warm)."""
        session_id = body.session_id or request.headers.get("x-session-id")
        try:  # the session's epoch when the router routed it (the claim's condition)
            epoch = int(request.headers["x-kvserve-session-epoch"])
        except (KeyError, ValueError):
            epoch = None
        ephemeral = request.headers.get("x-kvserve-ephemeral-session") == "1"
        base = f"{uuid.uuid4().hex[:24]}"
        streams: list[RequestStream] = []
        try:
            for p_idx, prompt in enumerate(prompts):
                for i in range(params.n):
                    streams.append(
                        await engine.add_request(
                            f"{base}-{p_idx}-{i}",
                            prompt,
                            params,
                            child_seed(params.seed, i),
                            tenant=principal.tenant,
                            cache_salt=body.cache_salt,
                            priority=body.priority,
                            session_id=session_id,
                            session_epoch=epoch,
                            ephemeral_session=ephemeral,
                            standby=request.headers.get("x-kvserve-standby"),
                        )
                    )
        except EngineError as e:
            for s in streams:
                s.abort()
            raise bad_request(str(e), "prompt") from None
        except EngineDeadError as e:
            for s in streams:
                s.abort()
            raise unavailable(str(e)) from None
        return streams

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        principal = authenticate(request, state.config)
        _admit(body)
        try:
            prompts = body.prompts()
            params = body.sampling_params()
        except ValueError as e:
            raise bad_request(str(e)) from None
        streams = await _start(prompts, params, principal, body, request)
        kind = "text_completion"
        rid = f"cmpl-{uuid.uuid4().hex}"
        return await _respond(state, body, streams, params, kind, rid, request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatCompletionRequest) -> Response:
        principal = authenticate(request, state.config)
        _admit(body)
        tok = state.tokenizer
        if tok is None:
            raise bad_request("the model has no tokenizer, so chat is unavailable")
        try:
            params = body.sampling_params()
            prompt = await asyncio.to_thread(_chat_prompt_ids, body)  # off the event loop
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        streams = await _start([prompt], params, principal, body, request)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        return await _respond(state, body, streams, params, "chat.completion", rid, request)

    return app


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
        except BaseException as e:
            await queue.put((i, e))
            return
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


async def _respond(
    state: ServerState,
    body: Any,
    streams: list[RequestStream],
    params: SamplingParams,
    kind: str,
    rid: str,
    request: Request,
    resume: tuple[int, int] | None = None,
) -> Response:
    """``resume``: (token ids, text characters) the client already has — the response
    continues after them (a failover)."""
    chat = kind == "chat.completion"
    ids = bool(getattr(body, "return_token_ids", False))
    choices = [ChoiceState(i, state.tokenizer, params, chat, ids) for i in range(len(streams))]
    if resume is not None:
        choices[0].resume_after(*resume)
    created = int(time.time())
    metrics = state.metrics
    name = state.model_name
    start = time.monotonic()
    prompt_tokens = sum(s.num_prompt_tokens for s in streams) // max(params.n, 1)

    def observe(c: ChoiceState, out: RequestOutput) -> None:
        now = time.monotonic()
        n_new = len(out.outputs[0].token_ids) - c.num_tokens
        if n_new > 0:
            if c.num_tokens == 0:
                metrics.ttft.labels(name).observe(now - start)
            elif c.last_token_time is not None:
                metrics.itl.labels(name).observe(now - c.last_token_time)
            c.last_token_time = now
            metrics.generation_tokens.labels(name).inc(n_new)
        if out.finished:
            metrics.e2e.labels(name).observe(now - start)
            reason = out.outputs[0].finish_reason or "abort"
            metrics.request_success.labels(name, reason).inc()

    metrics.prompt_tokens.labels(name).inc(sum(s.num_prompt_tokens for s in streams))
    if not body.stream:
        try:
            async for i, out in _merge(streams):
                observe(choices[i], out)
                choices[i].update(out)
        except EngineDeadError as e:
            raise unavailable(str(e)) from None
        completion_tokens = sum(c.num_tokens for c in choices)
        cached = sum(c.num_cached_tokens for c in choices) // max(params.n, 1)
        response = {
            "id": rid,
            "object": kind,
            "created": created,
            "model": name,
            "choices": [c.final_choice() for c in choices],
            "usage": usage(prompt_tokens, completion_tokens, cached),
        }
        if ids:
            response["prompt_token_ids"] = list(choices[0].prompt_token_ids)
        return JSONResponse(response)

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunk_kind = "chat.completion.chunk" if chat else "text_completion"

    def sse(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def chunk(choice_list: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": rid,
            "object": chunk_kind,
            "created": created,
            "model": name,
            "choices": choice_list,
        }
        if include_usage:
            out["usage"] = None
        return out

    async def events() -> AsyncIterator[str]:
        try:
            if chat and resume is None:
                for c in choices:
                    yield sse(chunk([c.role_delta()]))
            prompt_ids_sent = not ids or resume is not None
            async for i, out in _merge(streams):
                c = choices[i]
                observe(c, out)
                delta = c.update(out)
                if delta is not None:
                    payload = chunk([delta])
                    if not prompt_ids_sent:  # with return_token_ids: once, first chunk
                        payload["prompt_token_ids"] = list(out.prompt_token_ids)
                        prompt_ids_sent = True
                    yield sse(payload)
            if include_usage:
                completion_tokens = sum(c.num_tokens for c in choices)
                cached = sum(c.num_cached_tokens for c in choices) // max(params.n, 1)
                final = chunk([])
                final["usage"] = usage(prompt_tokens, completion_tokens, cached)
                yield sse(final)
            yield "data: [DONE]\n\n"
        except EngineDeadError as e:
            err = {
                "error": {
                    "message": str(e),
                    "type": "ServiceUnavailableError",
                    "param": None,
                    "code": None,
                }
            }
            yield sse(err)
        finally:
            for s in streams:  # a disconnect cancels this generator: free the KV now
                s.abort()

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
