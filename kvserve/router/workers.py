"""The router's view of the workers: the registry in Redis (heartbeats) plus its own
HTTP ``/health`` probes, and the choice of a standby per session (where a new request
goes is ``scoring.Placement``'s).

A worker is *routable* while its last ``/ready`` probe succeeded and it is registered — or, when the
registry itself cannot be read (Redis away), it was registered less than
``registry_grace`` seconds ago: serving goes on while the coordinator is briefly down.
Choices are deterministic given the same view (rendezvous hashing breaks ties), so several
routers agree on a session's standby without talking to each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvserve.ha.coordination import Coordinator, secret_fingerprint
from kvserve.router.config import RouterConfig
from kvserve.server.errors import retry_after

logger = logging.getLogger("kvserve.router")


@dataclass
class Worker:
    node_id: str
    url: str
    info: dict[str, Any] = field(default_factory=dict)
    healthy: bool = False  # the last /health probe answered 200
    registered_at: float = 0.0  # monotonic time it was last seen in the registry
    inflight: int = 0  # requests this router has open on it

    @property
    def load(self) -> float:
        return (
            self.inflight + float(self.info.get("running", 0)) + float(self.info.get("waiting", 0))
        )

    @property
    def role(self) -> str:
        """``both``, ``prefill`` or ``decode`` (``kvserve serve --role``)."""
        return str(self.info.get("role") or "both")

    def can(self, leg: str) -> bool:
        """Does this worker take ``leg`` (``prefill`` or ``decode``) work?"""
        return self.role in ("both", leg)


def rendezvous(session: str, node: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{session}|{node}".encode(), digest_size=8).digest())


class WorkerPool:
    def __init__(self, coord: Coordinator, config: RouterConfig):
        self.coord = coord
        self.config = config
        self.workers: dict[str, Worker] = {}
        # one connection pool per worker: httpcore scans a pool's connections on every
        # request, so a shared pool costs O(workers) per request
        self._clients: dict[str, httpx.AsyncClient] = {}
        self.registry_ok = False
        self._task: asyncio.Task | None = None
        self._secret_fp = secret_fingerprint(config.cluster_secret)
        self._mismatch_logged: set[str] = set()
        # each told the workers after every registry read (the KV index and the
        # tokenizers follow them); one that raises is logged, the others still run
        self.on_refresh: list[Callable[[dict[str, Worker]], None]] = []

    # ---- view -----------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Read the registry and probe every known worker (concurrently)."""
        now = time.monotonic()
        try:
            nodes = await asyncio.to_thread(self.coord.nodes)
        except Exception as e:
            if self.registry_ok:
                logger.warning("registry unreadable, routing on the last view: %s", e)
            self.registry_ok = False
        else:
            self.registry_ok = True
            for node_id, info in nodes.items():
                w = self.workers.get(node_id)
                if w is None or w.url != info["url"]:
                    w = self.workers[node_id] = Worker(node_id, info["url"].rstrip("/"))
                    logger.info("worker %s joined at %s", node_id, w.url)
                w.info, w.registered_at = info, now
                if not self.secret_matches(w) and node_id not in self._mismatch_logged:
                    self._mismatch_logged.add(node_id)
                    logger.error(
                        "worker %s at %s has a different cluster secret than this router "
                        "(fingerprint %s, ours %s): not routable; give every worker and "
                        "router the same KVSERVE_CLUSTER_SECRET",
                        node_id,
                        w.url,
                        info.get("secret_fp"),
                        self._secret_fp,
                    )
            for node_id in [n for n in self.workers if n not in nodes]:
                logger.info("worker %s left the registry", node_id)
                del self.workers[node_id]
                client = self._clients.pop(node_id, None)
                if client is not None:
                    asyncio.get_running_loop().create_task(client.aclose())
            for follow in self.on_refresh:
                try:
                    follow(self.workers)
                except Exception:  # following must not stop the health probes
                    logger.exception("following the workers (%s) failed", follow)
        await asyncio.gather(*(self._probe(w) for w in list(self.workers.values())))

    async def _probe(self, w: Worker) -> None:
        w.healthy = await self.probe(w, "/ready")

    async def probe(self, w: Worker, path: str = "/health") -> bool:
        """One ``GET path`` answered 200 within ``probe_timeout``. ``/ready`` (taking new
        requests) decides routability — a draining worker takes none but finishes its
        streams; ``/health`` (the process serves) decides whether a quiet stream's
        worker is still alive."""
        try:
            r = await self.client(w).get(w.url + path, timeout=self.config.probe_timeout)
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    async def alive(self, w: Worker) -> bool:
        """Is a worker that went quiet still serving? Registered (when the registry can be
        read) and answering a probe."""
        if self.registry_ok:
            try:
                nodes = await asyncio.to_thread(self.coord.nodes)
            except Exception:
                pass
            else:
                if w.node_id not in nodes:
                    return False
        return await self.probe(w)

    def client(self, w: Worker) -> httpx.AsyncClient:
        """The HTTP client (connection pool) for requests to ``w``."""
        c = self._clients.get(w.node_id)
        if c is None:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            c = self._clients[w.node_id] = httpx.AsyncClient(limits=limits)
        return c

    def secret_matches(self, w: Worker) -> bool:
        """Does the worker publish this router's cluster-secret fingerprint? A worker with
        another secret would refuse every resume, so it is never routable."""
        return w.info.get("secret_fp") == self._secret_fp

    def is_routable(self, w: Worker, now: float | None = None) -> bool:
        """Healthy, with this router's secret, and registered (or, while the registry
        cannot be read, registered less than ``registry_grace`` seconds ago)."""
        now = time.monotonic() if now is None else now
        return (
            w.healthy
            and self.secret_matches(w)
            and (self.registry_ok or now - w.registered_at < self.config.registry_grace)
        )

    def overload(self) -> int | None:
        """When every routable worker reported a full queue at its last heartbeat (its
        ``waiting`` at its ``max_waiting``): the seconds its excess takes at the workers'
        completion rates (Retry-After, 1–60; 5 when none finished lately); else None."""
        ws = self.routable()
        if not ws or any(
            "max_waiting" not in w.info or w.info.get("waiting", 0) < w.info["max_waiting"]
            for w in ws
        ):
            return None
        excess = sum(w.info["waiting"] - w.info["max_waiting"] + 1 for w in ws)
        return retry_after(excess, sum(float(w.info.get("completion_rate") or 0) for w in ws))

    def routable(self) -> list[Worker]:
        now = time.monotonic()
        return [w for w in self.workers.values() if self.is_routable(w, now)]

    def get(self, node_id: str) -> Worker | None:
        w = self.workers.get(node_id)
        return w if w is not None and self.is_routable(w) else None

    def standby(self, session: str, exclude: set[str] | frozenset[str]) -> Worker | None:
        """The session's standby: the routable worker (not excluded) with the highest
        rendezvous score — the same one for every router with the same view. A standby
        continues streams, so decode-capable workers come first (a prefill-only worker
        only when no other is left)."""
        cands = [w for w in self.routable() if w.node_id not in exclude]
        cands = [w for w in cands if w.can("decode")] or cands
        if not cands:
            return None
        return max(cands, key=lambda w: rendezvous(session, w.node_id))

    # ---- background ------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # never let the health loop die
                logger.exception("worker refresh failed")
            await asyncio.sleep(self.config.health_interval)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for c in self._clients.values():
            await c.aclose()
        self._clients.clear()
