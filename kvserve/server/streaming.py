"""Engine streams → an OpenAI response: one JSON body, or SSE chunks as tokens arrive."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.engine.async_llm import RequestStream
from kvserve.errors import EngineDeadError, QueueTimeout
from kvserve.request import RequestOutput
from kvserve.sampling import SamplingParams
from kvserve.server.admission import queue_timeout_error
from kvserve.server.disconnect import ClientGone, unless_disconnected
from kvserve.server.errors import unavailable
from kvserve.server.observe import Observer
from kvserve.server.render import ChoiceState, usage
from kvserve.server.state import ServerState
from kvserve.server.tools.spec import ToolPlan
from kvserve.server.tools.stream import ToolCallStream


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


@dataclass(frozen=True)
class ReplyPlan:
    """How a generation's streams become one OpenAI response. ``kind``: ``chat.completion``
    or ``text_completion``; ``rid``: the response id; ``stream``: SSE chunks (else one
    JSON body), with a final usage chunk when ``include_usage``; ``token_ids``: the
    prompt's and each choice's token ids go out too (``return_token_ids``). ``resume``:
    (output token ids, text characters) the client already has — the response continues
    after them (a failover); ``echo``: per stream, text sent before its output
    (completions ``echo``); ``tools``: a chat request's tool plan (its calls are read out
    of the text when it has a parser)."""

    kind: str
    rid: str
    params: SamplingParams
    stream: bool
    include_usage: bool = False
    token_ids: bool = False
    resume: tuple[list[int], int] | None = None
    echo: list[str] | None = None
    tools: ToolPlan | None = None

    @classmethod
    def of(cls, body: Any, kind: str, rid: str, params: SamplingParams, **rest: Any) -> ReplyPlan:
        """The plan for a completions or chat ``body`` (its ``stream``, ``stream_options``
        and ``return_token_ids``), with ``rest`` (resume, echo, tools) as given."""
        options = getattr(body, "stream_options", None)
        return cls(
            kind,
            rid,
            params,
            bool(body.stream),
            bool(options and options.include_usage),
            bool(getattr(body, "return_token_ids", False)),
            **rest,
        )

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"


async def respond(
    state: ServerState, plan: ReplyPlan, streams: list[RequestStream], request: Request
) -> Response:
    """The response to ``streams`` as ``plan`` says; a client that goes away aborts them
    (their KV freed at once). An engine that died is a 503, a queue timeout its 429/503,
    in the body or (once streaming) as the last SSE event."""
    reply = _Reply(state, plan, streams)
    if plan.stream:
        return StreamingResponse(
            reply.events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    return await reply.body(request)


class _Reply:
    """One response's choices, metrics and framing (``respond``)."""

    def __init__(self, state: ServerState, plan: ReplyPlan, streams: list[RequestStream]):
        self.state, self.plan, self.streams = state, plan, streams
        echo = plan.echo or [""] * len(streams)
        self.choices = [
            ChoiceState(
                i, state.tokenizer, plan.params, plan.chat, plan.token_ids, echo[i], self._tools()
            )
            for i in range(len(streams))
        ]
        if plan.resume is not None:
            self.choices[0].resume_after(*plan.resume)
        self.created = int(time.time())
        self._head = {
            "id": plan.rid,
            "object": "chat.completion.chunk" if plan.chat else "text_completion",
            "created": self.created,
            "model": state.model_name,
        }
        self._tail = {"usage": None} if plan.include_usage else {}
        self.observer = Observer(state.metrics, state.model_name)
        num_prompt = sum(s.num_prompt_tokens for s in streams)
        self.prompt_tokens = num_prompt // max(plan.params.n, 1)
        state.metrics.prompt_tokens.labels(state.model_name).inc(num_prompt)

    def _tools(self) -> ToolCallStream | None:
        tools = self.plan.tools
        if tools is None or tools.parser is None:
            return None
        return ToolCallStream(tools.parser, tools.parallel)

    def _abort_unfinished(self) -> None:
        """Free the KV of every stream now (a client gone, a generator closed) and count
        the choices that had not finished as aborted."""
        for s in self.streams:
            s.abort()
        self.observer.aborted(self.choices)

    def _usage(self) -> dict[str, Any]:
        completion_tokens = sum(c.num_tokens for c in self.choices)
        cached = sum(c.num_cached_tokens for c in self.choices) // max(self.plan.params.n, 1)
        return usage(self.prompt_tokens, completion_tokens, cached)

    async def body(self, request: Request) -> Response:
        """One JSON body once every stream finished (or the error's response)."""

        async def collect() -> None:
            try:
                async for i, out in _merge(self.streams):
                    self.observer.observe(self.choices[i], out)
                    self.choices[i].update(out)
            except asyncio.CancelledError:  # the client went away
                self._abort_unfinished()
                raise

        try:
            await unless_disconnected(request, collect())
        except EngineDeadError as e:
            raise unavailable(str(e)) from None
        except QueueTimeout as e:
            raise queue_timeout_error(e, self.state) from None
        except ClientGone as gone:
            return gone.response()
        response = {
            "id": self.plan.rid,
            "object": self.plan.kind,
            "created": self.created,
            "model": self.state.model_name,
            "choices": [c.final_choice() for c in self.choices],
            "usage": self._usage(),
        }
        if self.plan.token_ids:
            response["prompt_token_ids"] = list(self.choices[0].prompt_token_ids)
        return JSONResponse(response)

    def _chunk(self, choice_list: list[dict[str, Any]]) -> dict[str, Any]:
        """An SSE chunk's body: the response's fixed fields (``_head``), then these."""
        return {**self._head, "choices": choice_list, **self._tail}

    async def events(self) -> AsyncIterator[str]:
        """SSE events as tokens arrive: the role deltas (chat), one chunk per choice
        delta (the first with the prompt's token ids when asked), the usage chunk when
        asked, ``[DONE]``; an error ends the stream as its last event."""
        plan = self.plan
        try:
            if plan.chat and plan.resume is None:
                for c in self.choices:
                    yield _sse(self._chunk([c.role_delta()]))
            prompt_ids_sent = not plan.token_ids or plan.resume is not None
            async for i, out in _merge(self.streams):
                c = self.choices[i]
                self.observer.observe(c, out)
                delta = c.update(out)
                if delta is not None:
                    payload = self._chunk([delta])
                    if not prompt_ids_sent:  # with return_token_ids: once, first chunk
                        payload["prompt_token_ids"] = list(out.prompt_token_ids)
                        prompt_ids_sent = True
                    yield _sse(payload)
            if plan.include_usage:
                final = self._chunk([])
                final["usage"] = self._usage()
                yield _sse(final)
            yield "data: [DONE]\n\n"
        except EngineDeadError as e:
            yield _sse(unavailable(str(e)).body())
        except QueueTimeout as e:
            yield _sse(queue_timeout_error(e, self.state).body())
        finally:  # a disconnect cancels this generator
            self._abort_unfinished()


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
