"""The OpenAI surface: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvserve.engine.async_llm import RequestStream
from kvserve.engine.errors import EngineDeadError, EngineError
from kvserve.sampling import SamplingParams, child_seed
from kvserve.sampling.guided import check_spec
from kvserve.server.auth import Principal, authenticate
from kvserve.server.errors import APIError, bad_request, field_error, unavailable
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.server.state import ServerState
from kvserve.server.streaming import respond


def openai_routes(state: ServerState) -> APIRouter:
    router = APIRouter()
    engine = state.engine

    @router.get("/v1/models")
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
        if engine.stats().waiting >= state.config.max_waiting_requests:
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

    async def _check_structured(params: SamplingParams, field: str) -> None:
        """A 400 naming ``field`` before any token when the structured output cannot be
        enforced (checked off the event loop: a large schema takes milliseconds)."""
        if params.structured is None:
            return
        try:
            await asyncio.to_thread(check_spec, params.structured)
        except ValueError as e:
            message = str(e)
            raise ValueError(message if message.startswith(field) else f"{field}: {e}") from None

    @router.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        principal = authenticate(request, state.config)
        _admit(body)
        try:
            prompts = body.prompts()
            params = body.sampling_params()
            await _check_structured(params, body.structured_field())
        except ValueError as e:
            raise field_error(e) from None
        if body.echo and body.logprobs is not None:
            raise bad_request("echo together with logprobs is not supported", "echo")
        streams = await _start(prompts, params, principal, body, request)
        kind = "text_completion"
        rid = f"cmpl-{uuid.uuid4().hex}"
        echo = None
        if body.echo:
            echo = [state.prompt_text(p) for p in prompts for _ in range(params.n)]
        return await respond(state, body, streams, params, kind, rid, request, echo=echo)

    @router.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatCompletionRequest) -> Response:
        principal = authenticate(request, state.config)
        _admit(body)
        try:
            params, tools = state.chat_params(body)
            field = "tools" if tools.structured is not None else body.structured_field()
            await _check_structured(params, field)
        except ValueError as e:
            raise field_error(e) from None
        try:
            prompt = await asyncio.to_thread(state.chat_prompt_ids, body)  # off the event loop
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        streams = await _start([prompt], params, principal, body, request)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        return await respond(
            state, body, streams, params, "chat.completion", rid, request, tools=tools
        )

    return router
