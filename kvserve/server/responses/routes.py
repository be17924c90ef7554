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
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.engine.async_llm import RequestStream
from kvserve.engine.errors import EngineDeadError
from kvserve.server.admission import Placement, admit, check_structured, start
from kvserve.server.auth import Principal, authenticate
from kvserve.server.disconnect import ClientGone, unless_disconnected
from kvserve.server.errors import APIError, bad_request, field_error, unavailable
from kvserve.server.observe import Observer
from kvserve.server.protocol import ChatMessage
from kvserve.server.render import ChoiceState
from kvserve.server.responses.history import prompt_ids
from kvserve.server.responses.protocol import (
    FunctionCallItem,
    InputItem,
    MessageItem,
    ResponsesRequest,
    input_messages,
)
from kvserve.server.responses.record import StoredResponse, new_response_id, session_of
from kvserve.server.responses.render import ResponseEvents, item_id, usage
from kvserve.server.responses.store import ResponseStore
from kvserve.server.state import ServerState
from kvserve.server.tools.stream import ToolCallStream


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404,
        f"Response with id '{response_id}' not found.",
        "NotFoundError",
        param,
        "response_not_found",
    )


def responses_routes(state: ServerState, store: ResponseStore) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/responses")
    async def create(request: Request, body: ResponsesRequest) -> Response:
        principal = authenticate(request, state.config)
        admit(state, body.model)
        if state.tokenizer is None:
            raise bad_request("the model has no tokenizer, so responses are unavailable")
        previous = None
        if body.previous_response_id is not None:
            previous = await store.load(principal.tenant, body.previous_response_id)
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
        rid = new_response_id(previous.id if previous else None)
        where = Placement(session_of(rid) if body.store else None, body.cache_salt, body.priority)
        streams = await start(state, [prompt], params, principal, where, request)
        parser = tools.parser
        choice = ChoiceState(
            0,
            state.tokenizer,
            params,
            chat=True,
            tools=ToolCallStream(parser, tools.parallel) if parser is not None else None,
        )
        run = _Run(state, store, body, principal, rid, streams[0], choice, prompt, history)
        if body.stream:
            return StreamingResponse(
                run.events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        try:
            final = await unless_disconnected(request, run.whole())
        except ClientGone as gone:
            return gone.response()
        return JSONResponse(final)

    @router.get("/v1/responses/{response_id}")
    async def retrieve(request: Request, response_id: str) -> JSONResponse:
        principal = authenticate(request, state.config)
        record = await store.load(principal.tenant, response_id)
        if record is None:
            raise _not_found(response_id)
        return JSONResponse(record.response)

    @router.delete("/v1/responses/{response_id}")
    async def delete(request: Request, response_id: str) -> JSONResponse:
        principal = authenticate(request, state.config)
        if not await store.delete(principal.tenant, response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @router.get("/v1/responses/{response_id}/input_items")
    async def input_items(
        request: Request, response_id: str, order: str = "desc", limit: int = 20
    ) -> JSONResponse:
        principal = authenticate(request, state.config)
        if order not in ("asc", "desc"):
            raise bad_request("order: must be asc or desc", "order")
        if not 1 <= limit <= 100:
            raise bad_request("limit: must be in 1..100", "limit")
        record = await store.load(principal.tenant, response_id)
        if record is None:
            raise _not_found(response_id)
        items = record.input_items if order == "asc" else record.input_items[::-1]
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


class _Run:
    """One response being generated: its engine stream, events and, once done, its record."""

    def __init__(
        self,
        state: ServerState,
        store: ResponseStore,
        body: ResponsesRequest,
        principal: Principal,
        rid: str,
        stream: RequestStream,
        choice: ChoiceState,
        prompt: list[int],
        history: list[ChatMessage],
    ):
        self.state, self.store, self.body = state, store, body
        self.principal = principal
        self.stream = stream
        self.choice = choice
        self.prompt = prompt
        self.history = history
        self.out = ResponseEvents(rid, state.model_name, body)
        self.observer = Observer(state.metrics, state.model_name)
        state.metrics.prompt_tokens.labels(state.model_name).inc(stream.num_prompt_tokens)

    async def _generate(self) -> AsyncIterator[dict[str, Any]]:
        """The events up to the last output item's; then ``finish`` ends the response."""
        try:
            async for out in self.stream:
                self.observer.observe(self.choice, out)
                delta = self.choice.update(out)
                if delta is not None:
                    for event in self.out.feed(delta):
                        yield event
        except BaseException:
            self.stream.abort()
            self.observer.aborted([self.choice])
            raise

    async def _finish(self, error: str | None = None) -> list[dict[str, Any]]:
        c = self.choice
        reason = c.final_reason if error is None else None
        use = usage(self.stream.num_prompt_tokens, c.num_cached_tokens, c.num_tokens)
        events = self.out.finish(reason, use, error)
        if self.body.store and self.out.status != "failed":
            await self.store.save(self._record())
        return events

    def _record(self) -> StoredResponse:
        now = time.time()
        items = [_input_item(item) for item in self.body.items()]
        turn = [*self.history, *input_messages(self.body.items())]
        turn.append(ChatMessage(role="assistant", content=self.choice.text))
        return StoredResponse(
            id=self.out.id,
            tenant=self.principal.tenant,
            created_at=self.out.created_at,
            expires_at=now + self.store.ttl,
            response=self.out.final or self.out.response(),
            input_items=items,
            history=[m.model_dump(exclude_none=True) for m in turn],
            token_ids=[*self.prompt, *self.choice.token_ids],
        )

    async def whole(self) -> dict[str, Any]:
        """Run to the end; the response object (503 when the engine died)."""
        try:
            async for _ in self._generate():
                pass
        except EngineDeadError as e:
            raise unavailable(str(e)) from None
        events = await self._finish()
        return events[-1]["response"]

    async def events(self) -> AsyncIterator[str]:
        """The SSE stream: every event as ``event: <type>`` and ``data: <json>``."""
        try:
            for event in self.out.start():
                yield _sse(event)
            try:
                async for event in self._generate():
                    yield _sse(event)
                finished = await self._finish()
            except EngineDeadError as e:
                finished = await self._finish(str(e))
            for event in finished:
                yield _sse(event)
        finally:  # a disconnect closes this generator: the engine stops the request
            self.stream.abort()


def _input_item(item: InputItem) -> dict[str, Any]:
    """An input item as ``input_items`` lists it: with an id and a status, a message's
    content as parts."""
    out = item.model_dump(exclude_none=True)
    out.setdefault("status", "completed")
    if isinstance(item, MessageItem):
        kind = "output_text" if item.role == "assistant" else "input_text"
        if isinstance(item.content, str):
            out["content"] = [{"type": kind, "text": item.content}]
        out.setdefault("id", item_id("msg"))
    else:
        out.setdefault("id", item_id("fc" if isinstance(item, FunctionCallItem) else "fco"))
    return out


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
