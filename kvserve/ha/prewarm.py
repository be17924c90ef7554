"""Warm standbys: a worker pre-fetches the KV of the sessions it is standby for.

The router names a standby for every session it routes (``X-Kvserve-Standby``, the same
node it would fail over to); the primary's replicator tells that node each time it
published the session's record (``Coordinator.notify_standby``). The standby's
``Prewarmer`` thread takes those notifications, reads the record, and copies the
session's replicated blocks that its host tier lacks from the shared tiers into the host
tier (``TieredStore.get`` promotes). A takeover then restores the session from local
memory instead of from Redis/S3.

Bounds: the host tier's own capacity and LRU evict warm replicas like any other block
(memory bound, LRU); the per-session progress map is an LRU of ``max_sessions`` entries
whose entries also expire after ``ttl`` seconds without news (a stale session is warmed
from scratch if it ever comes back). Nothing here is on the engine's step path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

from kvserve.ha.coordination import Coordinator
from kvserve.ha.record import SessionRecord
from kvserve.kv.manager import KVCacheManager
from kvserve.store.tiered import TieredStore

logger = logging.getLogger("kvserve")


class Prewarmer:
    def __init__(
        self,
        coord: Coordinator,
        node_id: str,
        kv: KVCacheManager,
        store: TieredStore,
        *,
        max_sessions: int = 4096,
        ttl: float = 600.0,
    ):
        self.coord = coord
        self.node_id = node_id
        self.kv = kv
        self.store = store
        self.block_size = kv.block_size
        self.max_sessions = max_sessions
        self.ttl = ttl
        self._warm: OrderedDict[str, tuple[int, float]] = OrderedDict()  # → (blocks, when)
        self._retry: dict[str, float] = {}  # session → when to look again (blocks missing)
        self._attempts: dict[str, int] = {}
        self.num_sessions = 0  # notifications handled
        self.num_blocks = 0  # blocks copied into the host tier
        self.num_errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-prewarm", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                wait = 0.2 if self._retry else 1.0
                session = self.coord.next_standby_work(self.node_id, timeout=wait)
                if session is not None:
                    self.warm(session)
                now = time.monotonic()
                for s in [s for s, due in self._retry.items() if due <= now]:
                    del self._retry[s]
                    self.warm(s)
            except Exception as e:  # Redis away: try again shortly
                self.num_errors += 1
                logger.debug("pre-warming failed: %s", e)
                self._stop.wait(0.5)

    def warm(self, session: str) -> int:
        """Bring ``session``'s replicated blocks into the host tier; returns how many were
        copied (0 when this node owns the session or nothing is replicated)."""
        own = self.coord.owner(session)
        if own is None or own.state is None or own.node == self.node_id:
            return 0
        record = SessionRecord.from_json(own.state)
        tokens = record.tokens()
        n = min(record.stored_tokens, len(tokens)) // self.block_size
        now = time.monotonic()
        done, when = self._warm.pop(session, (0, now))
        if now - when > self.ttl:
            done = 0
        if n <= done:
            self._remember(session, done, now)
            return 0
        hashes = self.kv.hashes_for(tokens[: n * self.block_size], record.cache_salt)
        host = self.store.tiers[0]
        local = [host.contains([h]) > 0 for h in hashes[done:]]
        missing = [h for h, here in zip(hashes[done:], local, strict=True) if not here]
        got = iter(self.store.get(missing) if missing else [])
        fetched = [here or next(got) is not None for here in local]  # get promotes hits
        copied = sum(fetched) - sum(local)
        self.num_sessions += 1
        self.num_blocks += copied
        # the leading blocks now local: progress stops at the first gap
        reached = done + next((i for i, ok in enumerate(fetched) if not ok), len(fetched))
        self._remember(session, reached, now)
        if reached < n and self._attempts.get(session, 0) < 5:
            # the record can arrive before its last blocks reach the shared tier: retry
            self._attempts[session] = self._attempts.get(session, 0) + 1
            self._retry[session] = now + 0.2
        else:
            self._attempts.pop(session, None)
        return copied

    def _remember(self, session: str, blocks: int, now: float) -> None:
        self._warm[session] = (blocks, now)
        while len(self._warm) > self.max_sessions:
            self._warm.popitem(last=False)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
