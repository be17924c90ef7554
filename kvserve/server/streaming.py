"""Engine streams → an OpenAI response: one JSON body, or SSE chunks as tokens arrive."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
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


async def respond(
    state: ServerState,
    body: Any,
    streams: list[RequestStream],
    params: SamplingParams,
    kind: str,
    rid: str,
    request: Request,
    resume: tuple[list[int], int] | None = None,
    echo: list[str] | None = None,
    tools: ToolPlan | None = None,
) -> Response:
    """``resume``: (output token ids, text characters) the client already has — the response
    continues after them (a failover). ``echo``: per stream, text sent before its output
    (completions ``echo``). ``tools``: a chat request's tool plan (its calls are read out of
    the text when it has a parser)."""
    chat = kind == "chat.completion"
    ids = bool(getattr(body, "return_token_ids", False))
    echo = echo or [""] * len(streams)

    def tool_stream() -> ToolCallStream | None:
        if tools is None or tools.parser is None:
            return None
        return ToolCallStream(tools.parser, tools.parallel)

    choices = [
        ChoiceState(i, state.tokenizer, params, chat, ids, echo[i], tool_stream())
        for i in range(len(streams))
    ]
    if resume is not None:
        choices[0].resume_after(*resume)
    created = int(time.time())
    metrics = state.metrics
    name = state.model_name
    observer = Observer(metrics, name)
    observe = observer.observe
    prompt_tokens = sum(s.num_prompt_tokens for s in streams) // max(params.n, 1)

    def abort_unfinished() -> None:
        """Free the KV of every stream now (a client gone, a generator closed) and count
        the choices that had not finished as aborted."""
        for s in streams:
            s.abort()
        observer.aborted(choices)

    metrics.prompt_tokens.labels(name).inc(sum(s.num_prompt_tokens for s in streams))
    if not body.stream:

        async def collect() -> None:
            try:
                async for i, out in _merge(streams):
                    observe(choices[i], out)
                    choices[i].update(out)
            except asyncio.CancelledError:  # the client went away
                abort_unfinished()
                raise

        try:
            await unless_disconnected(request, collect())
        except EngineDeadError as e:
            raise unavailable(str(e)) from None
        except QueueTimeout as e:
            raise queue_timeout_error(e, state) from None
        except ClientGone as gone:
            return gone.response()
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
            yield sse(unavailable(str(e)).body())
        except QueueTimeout as e:
            yield sse(queue_timeout_error(e, state).body())
        finally:  # a disconnect cancels this generator
            abort_unfinished()

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
