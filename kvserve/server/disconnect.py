"""A client that goes away stops its work: awaiting a whole (non-streaming) response while
watching the connection, shared by the worker's server and the router.

A streaming response notices a disconnect by itself (the ASGI server cancels its
generator, whose ``finally`` aborts the engine's streams). A non-streaming handler does
not: it would wait for the whole completion, generating every token for nobody.
``unless_disconnected(request, work)`` awaits ``work`` and, if the client disconnects
first, cancels it — its own ``finally`` blocks then free what it holds (the engine
streams are aborted, an upstream connection is closed) — and raises ``ClientGone``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response

T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's "client closed request": logged, never seen by the client


class ClientGone(Exception):
    """The client disconnected before its response was ready."""

    def response(self) -> Response:
        return Response(status_code=CLIENT_CLOSED)


async def _disconnect(request: Request) -> None:
    """Return once the client has disconnected (its body has been read already: the next
    ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``await work``, unless the client disconnects first: then ``work`` is cancelled
    (and awaited, so its cleanup has run) and ``ClientGone`` is raised."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGone
    return task.result()
