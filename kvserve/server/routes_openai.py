"""The OpenAI surface: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvserve.server.admission import Placement, admit, check_structured, start
from kvserve.server.auth import authenticate
from kvserve.server.errors import bad_request, field_error
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.server.state import ServerState
from kvserve.server.streaming import ReplyPlan, respond


def openai_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

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
    def _placement(body: CompletionRequest | ChatCompletionRequest, request: Request) -> Placement:
        """The session id comes from the body or the ``X-Session-Id`` header."""
        session_id = body.session_id or request.headers.get("x-session-id")
        return Placement(session_id, body.cache_salt, body.priority)

    @router.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        principal = authenticate(request, state.config)
        admit(state, body.model, principal.tenant)
        try:
            prompts = body.prompts()
            params = body.sampling_params()
            await check_structured(params, body.structured_field())
        except ValueError as e:
            raise field_error(e) from None
        if body.echo and body.logprobs is not None:
            raise bad_request("echo together with logprobs is not supported", "echo")
        where = _placement(body, request)
        streams = await start(state, prompts, params, principal, where, request)
        kind = "text_completion"
        rid = f"cmpl-{uuid.uuid4().hex}"
        echo = None
        if body.echo:
            echo = [state.prompt_text(p) for p in prompts for _ in range(params.n)]
        plan = ReplyPlan.of(body, kind, rid, params, echo=echo)
        return await respond(state, plan, streams, request)

    @router.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatCompletionRequest) -> Response:
        principal = authenticate(request, state.config)
        admit(state, body.model, principal.tenant)
        try:
            params, tools = state.chat_params(body)
            field = "tools" if tools.structured is not None else body.structured_field()
            await check_structured(params, field)
        except ValueError as e:
            raise field_error(e) from None
        try:
            prompt = await asyncio.to_thread(state.chat_prompt_ids, body)  # off the event loop
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        streams = await start(
            state, [prompt], params, principal, _placement(body, request), request
        )
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        plan = ReplyPlan.of(body, "chat.completion", rid, params, tools=tools)
        return await respond(state, plan, streams, request)

    return router
