"""Keeps the router's ``PrefixIndex`` in step with the workers' KV event streams.

One ZeroMQ SUB socket connected to every routable-or-not registered worker that
advertises a ``kv_events`` endpoint (connections follow the registry: ``follow``). Batches
apply as they arrive; a worker that needs a snapshot (new, restarted, a lost batch) gets
one ``GET /internal/kv/snapshot`` at a time, bounded by ``probe_timeout`` × 4, retried on
the next registry refresh when it fails. A router restarted mid-run therefore rebuilds
its index from snapshots within one refresh, then follows the events.

Everything runs on the router's event loop; decoding a batch is the only work per event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import httpx
import msgspec
import zmq
import zmq.asyncio

from kvserve.router.index import PrefixIndex
from kvserve.server.kv_events import SNAPSHOT_PATH, TOPIC, KVEventBatch, KVSnapshot

logger = logging.getLogger("kvserve.router")


class KVSync:
    def __init__(
        self,
        index: PrefixIndex,
        http: httpx.AsyncClient,
        secret: str | None,
        timeout: float,
        metrics: Any = None,
    ):
        self.index = index
        self.http = http
        self.secret = secret
        self.timeout = timeout
        self.metrics = metrics
        self._ctx = zmq.asyncio.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self._endpoints: dict[str, str] = {}  # node → endpoint connected
        self._urls: dict[str, str] = {}  # node → HTTP base URL (for snapshots)
        self._fetching: dict[str, asyncio.Task] = {}
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
                self.index.forget(node)
        for node, ep in wanted.items():
            if not ep:
                continue
            self._urls[node] = workers[node].url
            if node not in self._endpoints:
                self._sub.connect(ep)
                self._endpoints[node] = ep
                self.index.mark_unsynced(node)
            if not self.index.is_synced(node):
                self._resync(node)

    def _resync(self, node: str) -> None:
        if node in self._fetching or node not in self._urls:
            return
        self._fetching[node] = asyncio.get_running_loop().create_task(self._snapshot(node))

    async def _snapshot(self, node: str) -> None:
        try:
            headers = {"X-Kvserve-Cluster-Secret": self.secret} if self.secret else {}
            r = await self.http.get(
                self._urls[node] + SNAPSHOT_PATH, headers=headers, timeout=self.timeout
            )
            if r.status_code != 200:
                logger.warning("KV snapshot of %s: HTTP %d", node, r.status_code)
                return
            snap = self._snap_dec.decode(r.content)
            if snap.node != node:
                logger.error("KV snapshot from %s names node %s: ignored", node, snap.node)
                return
            ok = self.index.load_snapshot(snap)
            if self.metrics is not None:
                self.metrics.kv_snapshots.inc()
            logger.info(
                "KV index of %s: %s blocks (seq %d)", node, self.index.sizes(node), snap.seq
            )
        except (httpx.HTTPError, msgspec.DecodeError) as e:
            logger.warning("KV snapshot of %s failed: %r", node, e)
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
            if batch.node not in self._endpoints:
                continue  # a publisher we no longer follow (or one naming another node)
            if self.metrics is not None and batch.events:
                self.metrics.kv_batches.inc()
            if self.index.on_batch(batch):
                self._resync(batch.node)

    async def stop(self) -> None:
        tasks = [t for t in [self._task, *self._fetching.values()] if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._sub.close(linger=0)
