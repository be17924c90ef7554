"""One response being generated: a prepared turn (``Turn``), its engine stream, its events
and, once done, its stored record.

A router that may continue the stream elsewhere asks for the token ids
(``X-Kvserve-Token-Ids: 1``): the last event of each engine update then carries the
update's new output token ids as ``kvserve_token_ids`` (a ``kvserve.token_ids`` event of
its own when the update shows no text yet) — in the same SSE message as the text it
acknowledges, so what the router counts as delivered is exactly what its client got. The
router strips them. A worker continuing a failed-over response (``resume``) rebuilds the
items the client has from those tokens, silently, and streams only what follows.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvserve.engine.async_llm import RequestStream
from kvserve.errors import EngineDeadError, QueueTimeout
from kvserve.sampling import SamplingParams
from kvserve.server.admission import queue_timeout_error
from kvserve.server.errors import unavailable
from kvserve.server.observe import Observer
from kvserve.server.protocol import ChatMessage
from kvserve.server.render import ChoiceState
from kvserve.server.responses.protocol import (
    FunctionCallItem,
    InputItem,
    MessageItem,
    ResponsesRequest,
    input_messages,
)
from kvserve.server.responses.record import StoredResponse
from kvserve.server.responses.render import ResponseEvents, item_id, usage
from kvserve.server.responses.store import ResponseStore
from kvserve.server.state import ServerState
from kvserve.server.tools.spec import ToolPlan
from kvserve.server.tools.stream import ToolCallStream


@dataclass(frozen=True)
class Turn:
    """A request ready to run: its tenant, the conversation so far (``history``: the
    previous response's), sampling parameters, tool plan and prompt token ids."""

    body: ResponsesRequest
    tenant: str
    history: list[ChatMessage]
    params: SamplingParams
    tools: ToolPlan
    prompt: list[int]


class ResponseRun:
    """``delivered``: output tokens a client already has (a failover's continuation);
    ``created_at``: the first worker's, when its client got ``response.created`` (then
    not sent again); ``token_ids``: report them to a router."""

    def __init__(
        self,
        state: ServerState,
        store: ResponseStore,
        turn: Turn,
        response_id: str,
        stream: RequestStream,
        token_ids: bool = False,
        delivered: list[int] | None = None,
        created_at: int | None = None,
    ):
        self.state, self.store, self.turn = state, store, turn
        self.stream = stream
        self.out = ResponseEvents(response_id, state.model_name, turn.body, created_at)
        plan = turn.tools
        self.choice = ChoiceState(
            0,
            state.tokenizer,
            turn.params,
            chat=True,
            return_token_ids=token_ids,
            tools=self._tool_stream(plan),
        )
        # a continuation whose client saw response.created: no second one
        self.started = created_at is not None
        if delivered is not None:
            self._catch_up(delivered)
        self.observer = Observer(state.metrics, state.model_name)
        state.metrics.prompt_tokens.labels(state.model_name).inc(stream.num_prompt_tokens)

    def _tool_stream(self, plan: ToolPlan) -> ToolCallStream | None:
        if plan.parser is None:
            return None
        return ToolCallStream(plan.parser, plan.parallel, self.out.call_id)

    def _catch_up(self, delivered: list[int]) -> None:
        """Rebuild, without sending, the items the client got for ``delivered`` — token
        by token when tool calls are read, so text and calls open items in the order
        the first worker opened them (their ids follow that order)."""
        text = self.choice.delivered_text(delivered)
        self.choice.resume_after(delivered, len(text))
        tools = self._tool_stream(self.turn.tools)
        if tools is None:
            self.out.feed({"delta": {"content": text}})
            return
        tok, skip = self.state.tokenizer, self.turn.params.skip_special_tokens
        assert tok is not None  # (responses need one)
        end = 0
        for k in range(1, len(delivered) + 1):
            upto = min(len(tok.decode(delivered[:k], skip_special_tokens=skip)), len(text))
            if upto > end or k == len(delivered):
                content, calls = tools.step(text[:upto], False)
                self.out.feed({"delta": {"content": content, "tool_calls": calls}})
                end = upto

    async def _generate(self) -> AsyncIterator[dict[str, Any]]:
        """The events up to the last output item's; then ``_finish`` ends the response."""
        try:
            async for out in self.stream:
                self.observer.observe(self.choice, out)
                delta = self.choice.update(out)
                if delta is None:
                    continue
                events = self.out.feed(delta)
                ids = delta.get("token_ids")
                if ids:
                    if not events:
                        events = [{"type": "kvserve.token_ids"}]
                    events[-1]["kvserve_token_ids"] = ids
                for event in events:
                    yield event
        except BaseException:
            self.stream.abort()
            self.observer.aborted([self.choice])
            raise

    async def _finish(
        self, error: str | None = None, code: str = "server_error"
    ) -> list[dict[str, Any]]:
        c = self.choice
        reason = c.final_reason if error is None else None
        use = usage(self.stream.num_prompt_tokens, c.num_cached_tokens, c.num_tokens)
        events = self.out.finish(reason, use, error, code)
        if self.turn.body.store and self.out.status != "failed":
            await self.store.save(self._record())
        return events

    def _record(self) -> StoredResponse:
        body = self.turn.body
        items = [_input_item(item) for item in body.items()]
        history = [*self.turn.history, *input_messages(body.items())]
        history.append(ChatMessage(role="assistant", content=self.choice.text))
        return StoredResponse(
            id=self.out.id,
            tenant=self.turn.tenant,
            created_at=self.out.created_at,
            expires_at=time.time() + self.store.ttl,
            response=self.out.final or self.out.response(),
            input_items=items,
            history=[m.model_dump(exclude_none=True) for m in history],
            token_ids=[*self.turn.prompt, *self.choice.token_ids],
        )

    async def whole(self) -> dict[str, Any]:
        """Run to the end; the response object (503 when the engine died)."""
        try:
            async for _ in self._generate():
                pass
        except EngineDeadError as e:
            raise unavailable(str(e)) from None
        except QueueTimeout as e:
            raise queue_timeout_error(e, self.state) from None
        events = await self._finish()
        return events[-1]["response"]

    async def events(self) -> AsyncIterator[str]:
        """The SSE stream: every event as ``event: <type>`` and ``data: <json>`` (a
        continuation starts after what its client has)."""
        try:
            if not self.started:
                for event in self.out.start():
                    yield _sse(event)
            try:
                async for event in self._generate():
                    yield _sse(event)
                finished = await self._finish()
            except EngineDeadError as e:
                finished = await self._finish(str(e))
            except QueueTimeout as e:
                finished = await self._finish(str(e), "queue_timeout")
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
