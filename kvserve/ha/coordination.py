"""Cluster coordination in Redis: node registry, session ownership with epochs, fencing.

Redis is the one system of record (no home-made consensus). Keys, under ``prefix``:

- ``{prefix}:node:{id}`` — a node's registration (JSON: url, roles, load …) with a TTL of
  ``lease_s``; a node is alive while its key exists, so ``heartbeat`` just rewrites it.
- ``{prefix}:session:{id}`` — a hash: ``node`` (the owner), ``epoch`` (bumped on every
  change of owner), ``state`` (the last replicated session record), ``synced_at``.

Fencing: every write of session state names the writer's ``(node, epoch)`` and a Lua
script applies it only if both are still current — atomically, in Redis. After a failover
bumped the epoch, a primary that was paused (or partitioned) past its lease can no longer
write; it learns so from the refusal and drops the session. A takeover is conditional on
the epoch the caller saw, so two routers racing to fail the same session over cannot both
win.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

import redis

_WRITE_STATE = """
local cur = redis.call('HMGET', KEYS[1], 'node', 'epoch')
if not cur[2] or cur[1] ~= ARGV[1] or tonumber(cur[2]) ~= tonumber(ARGV[2]) then
  return 0
end
redis.call('HSET', KEYS[1], 'state', ARGV[3], 'synced_at', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""

_TAKE_OVER = """
local epoch = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0')
if tonumber(ARGV[2]) >= 0 and epoch ~= tonumber(ARGV[2]) then
  return -1
end
epoch = epoch + 1
redis.call('HSET', KEYS[1], 'node', ARGV[1], 'epoch', epoch)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return epoch
"""

_RELEASE = """
local cur = redis.call('HMGET', KEYS[1], 'node', 'epoch')
if cur[1] ~= ARGV[1] or tonumber(cur[2]) ~= tonumber(ARGV[2]) then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
"""


@dataclass(frozen=True)
class Ownership:
    node: str
    epoch: int
    state: bytes | None = None
    synced_at: float | None = None


MISSING_SECRET = (
    "kvserve {command}: --cluster needs a cluster secret, shared by every worker and router "
    "of the cluster: it authenticates their /internal endpoints, without which failover "
    "cannot work. Set KVSERVE_CLUSTER_SECRET (e.g. export KVSERVE_CLUSTER_SECRET=$(openssl "
    "rand -hex 32)) or pass --cluster-secret."
)


def secret_fingerprint(secret: str | None) -> str | None:
    """A short, one-way fingerprint of the cluster secret, published with a worker's
    registration so a router with a different secret sees the mismatch at once (instead
    of at the first failover, when the worker's /internal endpoints refuse it)."""
    if not secret:
        return None
    return hashlib.sha256(b"kvserve-cluster-secret\0" + secret.encode()).hexdigest()[:16]


class Coordinator:
    """One process's view of the cluster; every method is one round trip (or a script)."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str = "kvserve:ha",
        lease_s: float = 5.0,
        session_ttl_s: float = 86400.0,
    ):
        if lease_s <= 0 or session_ttl_s <= 0:
            raise ValueError("lease_s and session_ttl_s must be positive")
        self.r = client
        self.prefix = prefix
        self.lease_ms = int(lease_s * 1000)
        self.session_ttl_ms = int(session_ttl_s * 1000)
        self._write_state = client.register_script(_WRITE_STATE)
        self._take_over = client.register_script(_TAKE_OVER)
        self._release = client.register_script(_RELEASE)

    @classmethod
    def from_url(cls, url: str, timeout: float = 2.0, **kw: Any) -> Coordinator:
        """A coordinator on the Redis at ``url`` (``redis://``, ``rediss://``, ``unix://`` or
        ``redis+sentinel://`` — then it follows the master across Sentinel failovers);
        ``timeout`` bounds every round trip. Not Redis Cluster: the registry is read with
        SCAN over one keyspace."""
        if url.lower().startswith(("redis+sentinel://", "rediss+sentinel://")):
            from kvserve.store.redis_store import sentinel_client

            return cls(sentinel_client(url, timeout), **kw)
        if "+cluster://" in url.lower():
            raise ValueError("--cluster: use a single Redis or Redis Sentinel, not a cluster")
        client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        return cls(client, **kw)

    def _node_key(self, node_id: str) -> str:
        return f"{self.prefix}:node:{node_id}"

    def _session_key(self, session_id: str) -> str:
        return f"{self.prefix}:session:{session_id}"

    # ---- nodes ---------------------------------------------------------------------------
    def heartbeat(self, node_id: str, url: str, **info: Any) -> None:
        """Register or refresh ``node_id`` for one lease."""
        value = json.dumps({"id": node_id, "url": url, "at": time.time(), **info})
        self.r.set(self._node_key(node_id), value, px=self.lease_ms)

    register = heartbeat

    def deregister(self, node_id: str) -> None:
        self.r.delete(self._node_key(node_id))

    def nodes(self) -> dict[str, dict[str, Any]]:
        """Live nodes (their lease has not expired) by id."""
        keys = list(self.r.scan_iter(match=f"{self.prefix}:node:*", count=500))
        out = {}
        for raw in self.r.mget(keys) if keys else []:
            if raw is not None:  # expired between SCAN and MGET
                info = json.loads(raw)
                out[info["id"]] = info
        return out

    # ---- sessions ------------------------------------------------------------------------
    def take_over(self, session_id: str, node_id: str, seen_epoch: int | None = None) -> int | None:
        """Make ``node_id`` the session's owner with a new epoch, returned. With
        ``seen_epoch`` only if the epoch is still that one (else None: someone else moved
        first). A new session starts at epoch 1."""
        epoch = self._take_over(
            keys=[self._session_key(session_id)],
            args=[node_id, -1 if seen_epoch is None else seen_epoch, self.session_ttl_ms],
        )
        return None if int(epoch) < 0 else int(epoch)

    def owner(self, session_id: str) -> Ownership | None:
        h = self.r.hgetall(self._session_key(session_id))
        if not h or b"epoch" not in h:
            return None
        synced = h.get(b"synced_at")
        return Ownership(
            h[b"node"].decode(),
            int(h[b"epoch"]),
            h.get(b"state"),
            float(synced) if synced is not None else None,
        )

    def write_state(self, session_id: str, node_id: str, epoch: int, state: bytes) -> bool:
        """Store the session's replicated state if ``(node_id, epoch)`` still owns it.
        False means fenced: another node took the session over; stop serving it."""
        ok = self._write_state(
            keys=[self._session_key(session_id)],
            args=[node_id, epoch, state, repr(time.time()), self.session_ttl_ms],
        )
        return bool(ok)

    # ---- standbys -------------------------------------------------------------------------
    def _prewarm_key(self, node_id: str) -> str:
        return f"{self.prefix}:prewarm:{node_id}"

    def notify_standby(self, node_id: str, session_id: str, keep: int = 1024) -> None:
        """Tell ``node_id`` that ``session_id``'s replicated state moved on (it is the
        session's standby). The queue keeps the newest ``keep`` notifications."""
        key = self._prewarm_key(node_id)
        pipe = self.r.pipeline(transaction=False)
        pipe.rpush(key, session_id)
        pipe.ltrim(key, -keep, -1)
        pipe.pexpire(key, self.session_ttl_ms)
        pipe.execute()

    def next_standby_work(self, node_id: str, timeout: float = 1.0) -> str | None:
        """The next session ``node_id`` should pre-warm, waiting up to ``timeout`` seconds
        (None: nothing came)."""
        got = self.r.blpop([self._prewarm_key(node_id)], timeout=timeout)
        return None if got is None else got[1].decode()

    def write_states(self, items: list[tuple[str, str, int, bytes]]) -> list[bool]:
        """``write_state`` for many (session, node, epoch, state) in one pipelined round
        trip; each write is fenced on its own."""
        pipe = self.r.pipeline(transaction=False)
        now = repr(time.time())
        for session_id, node_id, epoch, state in items:
            self._write_state(
                keys=[self._session_key(session_id)],
                args=[node_id, epoch, state, now, self.session_ttl_ms],
                client=pipe,
            )
        return [bool(x) for x in pipe.execute()]

    def release(self, session_id: str, node_id: str, epoch: int) -> bool:
        """Forget the session if ``(node_id, epoch)`` still owns it."""
        return bool(self._release(keys=[self._session_key(session_id)], args=[node_id, epoch]))
