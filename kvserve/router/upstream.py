"""The router's side of one worker connection: send a request, watch it, read the
session's owner, with the failures named.

``Upstream.watched`` turns a worker that goes quiet for ``stall_timeout`` and then fails a
liveness check, or a broken connection, into ``WorkerFailed`` (counted in
``kvserve_router_failovers_detected_total``); ``Unroutable`` carries the OpenAI-shaped
error body a client gets when no worker can take or continue its request. ``Relay``
(routing, relaying) and ``Failover`` (continuing a stream elsewhere) share one Upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

import anyio
import httpx

from kvserve.ha.coordination import Coordinator
from kvserve.router.config import RouterConfig
from kvserve.router.workers import Worker, WorkerPool
from kvserve.server.errors import error_body

logger = logging.getLogger("kvserve.router")
T = TypeVar("T")
_STREAM_TIMEOUT = httpx.Timeout(connect=2.0, read=None, write=10.0, pool=10.0)


class WorkerFailed(Exception):
    """The worker serving a request stopped serving it."""


class Unroutable(Exception):
    """No worker could take (or continue) the request; ``body`` is the error to send."""

    def __init__(self, status: int, message: str, type_: str = "ServiceUnavailableError"):
        super().__init__(message)
        self.status = status
        self.body = error_body(message, type_)


async def closed(resp: httpx.Response) -> None:
    """Close ``resp`` (its connection, when unfinished: the worker aborts the request),
    also from a cancelled task: a client's disconnect cancels the ASGI server's task group,
    whose cancellation would otherwise cut this very close short and leave the worker
    generating for nobody."""
    with anyio.CancelScope(shield=True):
        await resp.aclose()


class Upstream:
    """Requests to the workers of ``pool``, watched; the coordinator's owner reads."""

    def __init__(self, pool: WorkerPool, coord: Coordinator, config: RouterConfig, metrics: Any):
        self.pool = pool
        self.coord = coord
        self.config = config
        self.metrics = metrics

    async def watched(self, aw: Awaitable[T], w: Worker) -> T:
        """``aw``'s result, unless ``w`` goes quiet for ``stall_timeout`` and then fails a
        liveness check (→ WorkerFailed). Transport errors become WorkerFailed."""
        task = asyncio.ensure_future(aw)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.config.stall_timeout)
                if done:
                    try:
                        return task.result()
                    except (httpx.HTTPError, httpx.StreamError) as e:
                        self.metrics.failovers_detected.labels("connection").inc()
                        raise WorkerFailed(f"{w.node_id}: {e!r}") from None
                if not await self.pool.alive(w):
                    self.metrics.failovers_detected.labels("stall").inc()
                    raise WorkerFailed(f"{w.node_id} stopped answering")
        finally:
            if not task.done():  # waited for even when this task is being cancelled, so
                task.cancel()  # the read has stopped before the response is closed
                with anyio.CancelScope(shield=True), contextlib.suppress(BaseException):
                    await task

    async def owner(self, session: str):
        """The session's owner from the coordinator, or None: none, or the coordinator is
        unreachable — then requests route without affinity, and ask again only once the
        registry refresh (every ``--health-interval``) has read it again, so a stalled
        Redis costs one request its timeout, not every request."""
        if not self.pool.registry_ok:
            return None
        try:
            return await asyncio.to_thread(self.coord.owner, session)
        except Exception as e:  # Redis away: route without affinity
            logger.warning("coordinator unreachable: %s", e)
            self.pool.registry_ok = False
            return None

    def epoch(self, owner) -> int | None:
        """The session's epoch the router saw, for the worker's conditional claim: its
        owner's, 0 when it has none, None when the registry is unreadable (the worker then
        reads the epoch itself)."""
        if owner is not None:
            return owner.epoch
        return 0 if self.pool.registry_ok else None

    async def send(self, w: Worker, path: str, body: dict, headers: dict) -> httpx.Response:
        http = self.pool.client(w)
        req = http.build_request(
            "POST", w.url + path, json=body, headers=headers, timeout=_STREAM_TIMEOUT
        )
        return await self.watched(http.send(req, stream=True), w)
