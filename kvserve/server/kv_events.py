"""The worker's KV event publisher: the engine's block events, numbered, on ZeroMQ PUB.

Why ZeroMQ and not a Redis stream: events follow the engine's block churn (hundreds of
hashes a second on a busy worker); a PUB socket costs Redis nothing, never blocks the
worker (a slow subscriber's messages are dropped at the high-water mark) and every router
subscribes directly. What a PUB socket does not give — delivery — the sequence numbers
and the snapshot make up for:

- Each ``KVEventBatch`` names the node, the publisher's ``instance`` (new at every start:
  a restarted worker's numbers start over) and ``seq`` (1, 2, …, one per batch with
  events). A quiet publisher repeats its last ``seq`` with no events every
  ``keepalive_s``, so a reader that lost the last batch notices within that time.
- ``snapshot()`` (served at ``GET /internal/kv/snapshot``) is everything held now, with
  the ``seq`` of the last batch it includes. A reader that sees a gap, a new instance or a
  lossy ``TierCleared`` reads a snapshot and applies the batches after its ``seq``.

The publisher keeps the mirror (tier → hashes) that snapshots are made from, applying
each batch as it sends it, in the API server's event loop; the engine core only logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from urllib.parse import urlsplit

import msgspec
import zmq

from kvserve.kv.events import TIERS, KVEvent, apply, sealed

logger = logging.getLogger("kvserve")

TOPIC = b"kv"
SNAPSHOT_PATH = "/internal/kv/snapshot"
SNAPSHOT_MEDIA_TYPE = "application/x-msgpack"


class KVEventBatch(msgspec.Struct, array_like=True):
    node: str
    instance: str
    seq: int
    events: list[KVEvent]


class KVSnapshot(msgspec.Struct):
    node: str
    instance: str
    seq: int  # the last batch included
    tiers: dict[str, list[bytes]]


def bind_host(host: str, advertise_url: str | None) -> str:
    """Where the events port listens: the advertised URL's host when the server listens
    on every interface (the port is open only where routers reach this worker), else the
    server's own host."""
    advertised = urlsplit(advertise_url).hostname if advertise_url else None
    if host in ("0.0.0.0", "::", "") and advertised:
        return advertised
    return host


def advertised_endpoint(bind_host: str, port: int, advertise_url: str | None) -> str:
    """The ``tcp://`` address routers connect to: the advertised URL's host (what other
    machines reach this worker by) or the bind address."""
    host = urlsplit(advertise_url).hostname if advertise_url else None
    host = host or bind_host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


class KVEventPublisher:
    """Numbers, mirrors and publishes the engine's KV events. Not thread-safe: use it from
    the server's event loop only."""

    def __init__(
        self,
        node: str,
        bind_host: str,
        port: int,
        key: bytes | None = None,
        keepalive_s: float = 1.0,
    ):
        """``key``: seals the published hashes (``kv.events.events_key`` of the cluster
        secret); the mirror and snapshots hold them sealed too."""
        self.node = node
        self.key = key
        self.instance = secrets.token_hex(8)
        self.seq = 0
        self.keepalive_s = keepalive_s
        self.held: dict[str, set[bytes]] = {t: set() for t in TIERS}
        self._enc = msgspec.msgpack.Encoder()
        self._sock = zmq.Context.instance().socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 10_000)
        host = "*" if bind_host in ("0.0.0.0", "::") else bind_host
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        self._quiet = True  # nothing sent since the last keepalive tick
        self._task: asyncio.Task | None = None

    def publish(self, events: list[KVEvent]) -> None:
        """Mirror ``events`` and send them as the next batch (dropped by ZeroMQ for a
        subscriber that is too slow: it resynchronises)."""
        if not events:
            return
        events = sealed(self.key, events)
        apply(self.held, events)
        self.seq += 1
        self._send(events)
        self._quiet = False

    def _send(self, events: list[KVEvent]) -> None:
        batch = KVEventBatch(self.node, self.instance, self.seq, events)
        with contextlib.suppress(zmq.Again):
            self._sock.send_multipart([TOPIC, self._enc.encode(batch)], zmq.NOBLOCK)

    def snapshot(self) -> KVSnapshot:
        return KVSnapshot(
            self.node, self.instance, self.seq, {t: list(h) for t, h in self.held.items()}
        )

    def encoded_snapshot(self) -> bytes:
        return self._enc.encode(self.snapshot())

    def start(self) -> None:
        """Send keepalives from the running loop until ``close``."""
        self._task = asyncio.get_running_loop().create_task(self._keepalive())

    async def _keepalive(self) -> None:
        while True:
            await asyncio.sleep(self.keepalive_s)
            if self._quiet:
                self._send([])
            self._quiet = True

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._sock.close(linger=0)
