"""Keeps the router's ``PrefixIndex`` in step with the workers' KV event streams.

One ZeroMQ SUB socket connected to every routable-or-not registered worker that
advertises a ``kv_events`` endpoint (connections follow the registry: ``follow``). Batches
apply as they arrive; a worker that needs a snapshot (new, restarted, a lost batch) gets
one ``GET /internal/kv/snapshot`` at a time, bounded by ``probe_timeout`` × 4, retried no
sooner than ``RETRY_S`` after a failure. A router restarted mid-run therefore rebuilds
its index from snapshots within one refresh, then follows the events.

A worker whose stream goes silent — not even a keepalive for ``STALE_S`` (its port is not
reachable from here, or it hangs) — is marked unsynced and matches nothing until its
events flow again (then it is resynchronised): the router never routes on a frozen view.

Everything runs on the router's event loop; decoding a batch is the only work per event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import zmq
import zmq.asyncio

from kvserve.router.index import PrefixIndex
from kvserve.server.kv_events import SNAPSHOT_PATH, TOPIC, KVEventBatch, KVSnapshot

logger = logging.getLogger("kvserve.router")

STALE_S = 5.0  # five publisher keepalives
RETRY_S = 2.0


class KVSync:
    def __init__(
        self,
        index: PrefixIndex,
        client: Callable[[Any], httpx.AsyncClient],
        secret: str | None,
        timeout: float,
        metrics: Any = None,
    ):
        self.index = index
        self.client = client  # a worker's connection pool (WorkerPool.client)
        self.secret = secret
        self.timeout = timeout
        self.metrics = metrics
        self._ctx = zmq.asyncio.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self._endpoints: dict[str, str] = {}  # node → endpoint connected
        self._workers: dict[str, Any] = {}  # node → its Worker (for snapshots)
        self._fetching: dict[str, asyncio.Task] = {}
        self._last_seen: dict[str, float] = {}  # node → monotonic time of its last batch
        self._retry_at: dict[str, float] = {}  # node → no snapshot before this time
        self._silent: set[str] = set()  # stale nodes waiting for their events to resume
        self._dec = msgspec.msgpack.Decoder(KVEventBatch)
        self._snap_dec = msgspec.msgpack.Decoder(KVSnapshot)
        self._task: asyncio.Task | None = None

    # ---- connections ------------------------------------------------------------------
    def follow(self, workers: dict[str, Any]) -> None:
        """Connect to the endpoints of ``workers`` (node → ``Worker``), drop the others;
        start a snapshot for every worker not yet synced."""
        wanted = {n: w.info.get("kv_events") for n, w in workers.items()}
        for node, ep in list(self._endpoints.items()):
            if wanted.get(node) != ep:
                with contextlib.suppress(zmq.ZMQError):
                    self._sub.disconnect(ep)
                del self._endpoints[node]
                self._workers.pop(node, None)
                self.index.forget(node)
                self._silent.discard(node)
        now = time.monotonic()
        for node, ep in wanted.items():
            if not ep:
                continue
            self._workers[node] = workers[node]
            if node not in self._endpoints:
                try:
                    self._sub.connect(ep)
                except zmq.ZMQError as e:  # a malformed endpoint: this worker only
                    logger.warning("KV events of %s at %r: %s", node, ep, e)
                    continue
                self._endpoints[node] = ep
                self._last_seen[node] = now
                self.index.mark_unsynced(node)
            if self.index.is_synced(node) and now - self._last_seen.get(node, now) > STALE_S:
                logger.warning("KV events of %s silent for %.0f s: not matched", node, STALE_S)
                self.index.mark_unsynced(node)
                self._silent.add(node)
            if not self.index.is_synced(node) and node not in self._silent:
                self._resync(node)

    def _resync(self, node: str) -> None:
        if node in self._fetching or node not in self._workers:
            return
        if time.monotonic() < self._retry_at.get(node, 0.0):
            return
        self._fetching[node] = asyncio.get_running_loop().create_task(self._snapshot(node))

    async def _snapshot(self, node: str) -> None:
        try:
            headers = {"X-Kvserve-Cluster-Secret": self.secret} if self.secret else {}
            w = self._workers[node]
            r = await self.client(w).get(
                w.url + SNAPSHOT_PATH, headers=headers, timeout=self.timeout
            )
            if r.status_code != 200:
                logger.warning("KV snapshot of %s: HTTP %d", node, r.status_code)
                self._retry_at[node] = time.monotonic() + RETRY_S
                return
            snap = self._snap_dec.decode(r.content)
            if snap.node != node:
                logger.error("KV snapshot from %s names node %s: ignored", node, snap.node)
                self._retry_at[node] = time.monotonic() + RETRY_S
                return
            if node not in self._endpoints:  # forgotten while the snapshot was on its way
                return
            ok = self.index.load_snapshot(snap)
            self._last_seen[node] = time.monotonic()
            if self.metrics is not None:
                self.metrics.kv_snapshots.inc()
            logger.info(
                "KV index of %s: %s blocks (seq %d)", node, self.index.sizes(node), snap.seq
            )
        except (httpx.HTTPError, msgspec.DecodeError) as e:
            logger.warning("KV snapshot of %s failed: %r", node, e)
            self._retry_at[node] = time.monotonic() + RETRY_S
            return
        finally:
            self._fetching.pop(node, None)
        if not ok:  # batches kept meanwhile had a gap: once more
            self._resync(node)

    # ---- events -------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                _, data = await self._sub.recv_multipart()
                batch = self._dec.decode(data)
            except (msgspec.DecodeError, ValueError) as e:
                logger.warning("unreadable KV event batch: %r", e)
                continue
            node = batch.node
            if node not in self._endpoints:
                continue  # a publisher we no longer follow (or one naming another node)
            self._last_seen[node] = time.monotonic()
            self._silent.discard(node)
            if self.metrics is not None and batch.events:
                self.metrics.kv_batches.inc()
            if self.index.on_batch(batch):
                self._resync(node)

    async def stop(self) -> None:
        tasks = [t for t in [self._task, *self._fetching.values()] if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._sub.close(linger=0)
