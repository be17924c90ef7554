"""Internal endpoints of a cluster worker (``/internal/*``, cluster secret required):
resume a failed-over stream, drain, accept a primary's direct push, the KV snapshot, the
tokenizer's files (for a router's prefix placement)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid

import redis
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvserve.engine.async_llm import RequestStream
from kvserve.engine.messages import AcceptPush, ReadCheckpoint
from kvserve.errors import EngineError
from kvserve.ha import resume
from kvserve.ha.coordination import Coordinator, Ownership
from kvserve.ha.record import SessionRecord
from kvserve.ha.wire import decode_resume
from kvserve.sampling import SamplingParams
from kvserve.server.auth import authenticate
from kvserve.server.errors import APIError, bad_request, unavailable
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.server.responses.protocol import ResponsesRequest
from kvserve.server.responses.record import session_of
from kvserve.server.responses.routes import prepare
from kvserve.server.responses.routes import respond as respond_response
from kvserve.server.responses.run import ResponseRun
from kvserve.server.state import ServerState
from kvserve.server.streaming import ReplyPlan, respond

# how long a resume reads the coordinator again before it answers 503 (a Sentinel
# failover of the coordinator's Redis names no master for a moment)
_COORD_RETRY_S = 3.0


def cluster_routes(state: ServerState) -> APIRouter:
    router = APIRouter()
    engine = state.engine

    # ---- internal (cluster) -------------------------------------------------------------
    def _cluster_auth(request: Request) -> None:
        secret = state.config.cluster_secret
        if secret is None:
            raise APIError(403, "internal endpoints need --cluster-secret", "PermissionDeniedError")
        given = request.headers.get("x-kvserve-cluster-secret", "")
        if not hmac.compare_digest(given.encode(), secret.encode()):
            raise APIError(401, "invalid cluster secret", "AuthenticationError")

    @router.post("/internal/resume")
    async def internal_resume(request: Request) -> Response:
        """Continue a session's stream after a failover. Body: ``ha.wire.ResumeBody`` (what
        the client has, and its original request). The response continues exactly where
        the client is."""
        _cluster_auth(request)
        if state.coord is None:
            raise APIError(404, "this worker is not in a cluster (--cluster)", "NotFoundError")
        try:
            body = decode_resume(await request.body())
            if body.kind == "responses":
                responses = ResponsesRequest.model_validate(body.request)
            else:
                model = ChatCompletionRequest if body.kind == "chat" else CompletionRequest
                original = model.model_validate(body.request)
        except ValueError as e:  # pydantic's ValidationError is one too
            raise bad_request(f"bad resume request: {e}") from None
        principal = authenticate(request, state.config)  # the client's key, forwarded
        session_id, delivered = body.session_id, body.delivered_token_ids
        if body.kind == "responses":
            if session_of(body.response_id) != session_id:
                raise bad_request("bad resume request: response_id is not of the session")
            turn = await prepare(state, state.responses, responses, principal.tenant)
            record = resume.from_request(
                session_id, principal.tenant, responses.cache_salt, turn.prompt, turn.params,
                body.ephemeral,
            )  # fmt: skip
            stream, _ = await _continue(record, delivered, body.seen_epoch)
            run = ResponseRun(
                state,
                state.responses,
                turn,
                body.response_id,
                stream,
                True,
                delivered,
                body.created_at,
            )
            return await respond_response(run, request)
        chat = body.kind == "chat"
        if original.logprobs:
            raise bad_request("streams with logprobs cannot be resumed")
        try:
            if isinstance(original, ChatCompletionRequest):
                params, tools = state.chat_params(original)
            else:
                params, tools = original.sampling_params(), None
            record = _record_from_request(
                original, params, principal.tenant, session_id, chat, body.ephemeral
            )
        except ValueError as e:
            raise bad_request(str(e)) from None
        stream, record = await _continue(record, delivered, body.seen_epoch)
        kind = "chat.completion" if chat else "text_completion"
        resp_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        plan = ReplyPlan.of(
            original,
            kind,
            resp_id,
            record.params,
            resume=(delivered, body.delivered_text_chars),
            echo=[_echo_text(original)],
            tools=tools,
        )
        return await respond(state, plan, [stream], request)

    async def _continue(
        record: SessionRecord, delivered: list[int], seen: int | None
    ) -> tuple[RequestStream, SessionRecord]:
        """Resume ``record`` after ``delivered``; the stream and the record it runs: the
        state its primary replicated (its seed, when the client gave none) when that is
        this very request, else ``record``. 503 when the coordinator is away, 409 when
        the epoch moved."""
        coord = state.coord
        assert coord is not None
        session_id = record.session_id
        owner = await _owner(coord, session_id)
        replicated = None
        if owner is not None and owner.state:
            with contextlib.suppress(ValueError):  # a foreign value: resume from the request
                replicated = SessionRecord.from_json(owner.state)
        if replicated is None and engine.info.has_checkpointer:  # another site's state
            replicated = await engine.call(ReadCheckpoint(session_id), SessionRecord | None)
        record = resume.choose_record(record, replicated)
        epoch = resume.seen_epoch(seen, owner.epoch if owner is not None else None)
        rid = f"resume-{uuid.uuid4().hex[:24]}"
        try:
            return await engine.resume(rid, record, delivered, epoch), record
        except EngineError as e:
            raise APIError(409, str(e), "ConflictError") from None

    async def _owner(coord: Coordinator, session_id: str) -> Ownership | None:
        """The session's owner; read again for up to ``_COORD_RETRY_S`` while the
        coordinator cannot be reached (a Sentinel failover names no master for a moment),
        then 503; any other error of the coordinator is a 503 at once."""
        deadline = time.monotonic() + _COORD_RETRY_S
        while True:
            try:
                return await asyncio.to_thread(coord.owner, session_id)
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if time.monotonic() >= deadline:
                    raise unavailable(f"the cluster coordinator is unreachable: {e}") from None
            except Exception as e:
                raise unavailable(f"the cluster coordinator is unreachable: {e}") from None
            await asyncio.sleep(0.25)

    def _echo_text(original: CompletionRequest | ChatCompletionRequest) -> str:
        """What the client got before the output (``echo``): counted in its characters."""
        if not isinstance(original, CompletionRequest) or not original.echo:
            return ""
        return state.prompt_text(original.prompts()[0])

    def _record_from_request(
        original: CompletionRequest | ChatCompletionRequest,
        params: SamplingParams,
        tenant: str,
        session_id: str,
        chat: bool,
        request_ephemeral: bool,
    ) -> SessionRecord:
        """The session record of ``original`` as its primary started it (nothing
        generated): a stream resumes from it when its primary replicated nothing yet.
        Exact for greedy and seeded requests. Raises ValueError."""
        if params.n != 1:
            raise ValueError("only single-choice (n = 1) streams can be resumed")
        if chat:
            prompt_ids = state.chat_prompt_ids(original)
        else:
            prompts = original.prompts()
            if len(prompts) != 1:
                raise ValueError("only single-prompt streams can be resumed")
            p = prompts[0]
            prompt_ids = engine.tokenize(p) if isinstance(p, str) else list(p)
        return resume.from_request(
            session_id, tenant, original.cache_salt, prompt_ids, params, request_ephemeral
        )

    @router.post("/internal/drain")
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

    @router.get("/internal/kv/snapshot")
    async def internal_kv_snapshot(request: Request) -> Response:
        """Every block hash this worker holds, by tier, with the sequence number of the
        last KV event batch included (msgpack ``KVSnapshot``): what a router reads to
        (re)build its index of this worker (``server.kv_events``)."""
        _cluster_auth(request)
        pub = state.kv_events
        if pub is None:
            raise APIError(404, "this worker publishes no KV events", "NotFoundError")
        from kvserve.server.kv_events import SNAPSHOT_MEDIA_TYPE

        return Response(pub.encoded_snapshot(), media_type=SNAPSHOT_MEDIA_TYPE)

    @router.get("/internal/tokenizer")
    async def internal_tokenizer(request: Request) -> Response:
        """The files this worker's tokenizer was loaded from, with its fingerprint (msgpack
        ``TokenizerExport``): a router rebuilds the same tokenizer from them for
        prefix-aware placement (``server.tokenizer_export``)."""
        _cluster_auth(request)
        tok = state.tokenizer
        if tok is None:
            raise APIError(404, "this worker's model has no tokenizer", "NotFoundError")
        from kvserve.server.tokenizer_export import TOKENIZER_MEDIA_TYPE, export_tokenizer

        try:  # megabytes read from disk: not on the event loop
            data = await asyncio.to_thread(export_tokenizer, tok)
        except (OSError, ValueError) as e:
            raise unavailable(f"cannot read the tokenizer's files: {e}") from None
        return Response(data, media_type=TOKENIZER_MEDIA_TYPE)

    @router.post("/internal/replica")
    async def internal_replica(request: Request) -> JSONResponse:
        """A primary's direct push (``--replicate-to standby``): verified blocks go into
        this worker's host tier (``ha.push``)."""
        _cluster_auth(request)
        if not engine.info.has_kv_store:
            raise APIError(404, "this worker has no KV store", "NotFoundError")
        body = await request.body()
        try:
            accepted, refused, placed = await engine.call(AcceptPush(body), list[int])
        except ValueError as e:
            raise bad_request(str(e)) from None
        state.metrics.pushed_blocks.labels(state.model_name, "accepted").inc(accepted)
        state.metrics.pushed_blocks.labels(state.model_name, "refused").inc(refused)
        state.metrics.prewarmed_blocks.labels(state.model_name).inc(placed)
        return JSONResponse({"accepted": accepted, "refused": refused, "device": placed})

    return router
