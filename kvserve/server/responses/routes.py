"""``/v1/responses``: create (whole or streamed), retrieve, delete, list input items.

A response is one chat-rendered turn (``protocol``) run by the engine as a request of the
conversation's session (``record``): with ``previous_response_id`` the prompt is the
previous turn's token ids followed by the new turn's rendered text (``history``), so the
engine finds the previous turn's blocks — in its prefix cache, in the KV store tiers, or
on another worker's shared tier — instead of recomputing them. With ``store`` (the
default) the response is kept (``store.ResponseStore``) for its TTL, readable only with
the creating tenant's key.
"""

from __future__ import annotations

import asyncio
import hmac

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.server.admission import Placement, admit, check_structured, start
from kvserve.server.auth import authenticate
from kvserve.server.disconnect import ClientGone, unless_disconnected
from kvserve.server.errors import APIError, bad_request, field_error
from kvserve.server.protocol import ChatMessage
from kvserve.server.responses.history import prompt_ids
from kvserve.server.responses.protocol import ResponsesRequest
from kvserve.server.responses.record import (
    RESPONSE_ID_HEADER,
    TOKEN_IDS_HEADER,
    new_response_id,
    session_of,
)
from kvserve.server.responses.run import ResponseRun, Turn
from kvserve.server.responses.store import ResponseStore
from kvserve.server.state import ServerState


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404,
        f"Response with id '{response_id}' not found.",
        "NotFoundError",
        param,
        "response_not_found",
    )


async def prepare(
    state: ServerState, store: ResponseStore, body: ResponsesRequest, tenant: str
) -> Turn:
    """The turn ``body`` asks for, over its previous response; raises the APIError that
    refuses it (404 for a previous response the tenant does not have, 400 naming a
    field). The same for a first run and a failover's continuation elsewhere."""
    if state.tokenizer is None:
        raise bad_request("the model has no tokenizer, so responses are unavailable")
    previous = None
    if body.previous_response_id is not None:
        previous = await store.load(tenant, body.previous_response_id)
        if previous is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
    history = [ChatMessage.model_validate(m) for m in previous.history] if previous else []
    try:
        chat = body.chat(history)
        params, tools = state.chat_params(chat)
        field = "tools" if tools.structured is not None else "text.format"
        await check_structured(params, field)
    except ValueError as e:
        raise field_error(_renamed(e)) from None
    try:  # off the event loop: a long history renders and tokenizes in milliseconds
        prompt = await asyncio.to_thread(
            prompt_ids, state.tokenizer, chat, previous.token_ids if previous else None
        )
    except ValueError as e:
        raise bad_request(str(e), "input") from None
    return Turn(body, tenant, history, params, tools, prompt)


def _response_id(state: ServerState, request: Request, body: ResponsesRequest) -> str:
    """A fresh id in the previous response's conversation — or the one a router chose
    (``X-Kvserve-Response-Id``, with the cluster secret: it routes by the conversation
    before a worker answers)."""
    chosen = request.headers.get(RESPONSE_ID_HEADER)
    secret = state.config.cluster_secret
    given = request.headers.get("x-kvserve-cluster-secret", "")
    if (
        chosen is not None
        and session_of(chosen) is not None
        and secret
        and hmac.compare_digest(given.encode(), secret.encode())
    ):
        return chosen
    return new_response_id(body.previous_response_id)


async def respond(run: ResponseRun, request: Request) -> Response:
    """``run``'s answer: an SSE stream, or the whole response object."""
    if run.turn.body.stream:
        return StreamingResponse(
            run.events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    try:
        return JSONResponse(await unless_disconnected(request, run.whole()))
    except ClientGone as gone:
        return gone.response()


def responses_routes(state: ServerState, store: ResponseStore) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/responses")
    async def create(request: Request, body: ResponsesRequest) -> Response:
        principal = authenticate(request, state.config)
        admit(state, body.model, principal.tenant)
        turn = await prepare(state, store, body, principal.tenant)
        rid = _response_id(state, request, body)
        # the conversation's session; a response not stored has one only while a router
        # may continue it elsewhere (ephemeral: released when it ends)
        routed = request.headers.get("x-kvserve-ephemeral-session") == "1"
        session = session_of(rid) if body.store or routed else None
        where = Placement(session, body.cache_salt, body.priority)
        streams = await start(state, [turn.prompt], turn.params, principal, where, request)
        token_ids = request.headers.get(TOKEN_IDS_HEADER) == "1"
        run = ResponseRun(state, store, turn, rid, streams[0], token_ids)
        return await respond(run, request)

    @router.get("/v1/responses/{response_id}")
    async def retrieve(request: Request, response_id: str) -> JSONResponse:
        _known_query(request, ())  # (``stream``, ``include``: not supported)
        principal = authenticate(request, state.config)
        record = await store.load(principal.tenant, response_id)
        if record is None:
            raise _not_found(response_id)
        return JSONResponse(record.response)

    @router.delete("/v1/responses/{response_id}")
    async def delete(request: Request, response_id: str) -> JSONResponse:
        _known_query(request, ())
        principal = authenticate(request, state.config)
        if not await store.delete(principal.tenant, response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @router.get("/v1/responses/{response_id}/input_items")
    async def input_items(
        request: Request,
        response_id: str,
        order: str = "desc",
        limit: int = 20,
        after: str | None = None,
        before: str | None = None,
    ) -> JSONResponse:
        """A page of the response's input items: ``limit`` of them in ``order``, those
        after the item ``after`` and before the item ``before`` (ids of this list)."""
        _known_query(request, ("order", "limit", "after", "before"))
        principal = authenticate(request, state.config)
        if order not in ("asc", "desc"):
            raise bad_request("order: must be asc or desc", "order")
        if not 1 <= limit <= 100:
            raise bad_request("limit: must be in 1..100", "limit")
        record = await store.load(principal.tenant, response_id)
        if record is None:
            raise _not_found(response_id)
        items = record.input_items if order == "asc" else record.input_items[::-1]
        ids = [item["id"] for item in items]
        for name, cursor in (("after", after), ("before", before)):
            if cursor is not None and cursor not in ids:
                raise bad_request(f"{name}: no input item {cursor!r} in this response", name)
        if before is not None:
            items = items[: ids.index(before)]
        if after is not None:
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit,
            }
        )

    return router


def _known_query(request: Request, known: tuple[str, ...]) -> None:
    """A query parameter this server does not implement is a 400 naming it."""
    for name in request.query_params:
        if name not in known:
            raise bad_request(
                f"{name}: this query parameter is not supported by kvserve", name,
                "unsupported_field",
            )  # fmt: skip


def _renamed(e: ValueError) -> ValueError:
    """A chat-field error worded with the Responses field it came from."""
    message = str(e)
    for chat_name, name in (
        ("response_format.json_schema.schema", "text.format.schema"),
        ("response_format", "text.format"),
        ("max_completion_tokens", "max_output_tokens"),
    ):
        if message.startswith(chat_name):
            return ValueError(name + message[len(chat_name) :])
    return e
