"""Where stored responses live, for how long, and who can read them.

- **This worker** keeps every response it created in memory (``_local``), oldest first,
  until it expires (``ttl``) or its tenant has more than ``max_per_tenant`` here (the
  oldest goes). That copy is never evicted by KV traffic.
- **The KV store tiers** (host → file → Redis → S3, when the server has ``--kv-store``)
  get the same record, written to every tier before the response is answered
  (``PutRecords``), so another worker sharing a tier continues the conversation when
  this one is gone. A record read from a tier is checked: a foreign, torn or other
  tenant's value is absent.
- **Removal** (``DELETE``, expiry, eviction) drops the record everywhere and, when the
  response is the newest turn of its conversation (the session's tokens are its
  tokens: their digests agree), the conversation's KV blocks too (``DeleteSession``).
  An older turn's KV is shared with the newer one and stays until that goes. A record is
  read from the tiers without being copied into this node's own tier, so a deleted one
  stays deleted; a router sends ``DELETE`` to every worker (each drops its own copy).

Expiry is checked on every store operation and on every ``/metrics`` scrape (``sweep``).
A shared tier that fails (a timeout, an unreachable Redis) is logged and counted; the
local copy still serves this worker.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvserve.engine.async_llm import AsyncLLM
from kvserve.engine.messages import (
    DeleteRecords,
    DeleteSession,
    GetRecord,
    PutRecords,
    UtilityCall,
)
from kvserve.server.responses.record import StoredResponse, record_key
from kvserve.store.sessions import tokens_digest

logger = logging.getLogger("kvserve")
_CALL_TIMEOUT_S = 10.0
REMOVAL_REASONS = ("deleted", "expired", "evicted")


class ResponseStore:
    def __init__(self, engine: AsyncLLM, ttl: float, max_per_tenant: int, model_name: str):
        self.engine = engine
        self.ttl = ttl
        self.max_per_tenant = max_per_tenant
        self.shared = engine.info.has_kv_store
        self._local: OrderedDict[tuple[str, str], tuple[StoredResponse, int]] = OrderedDict()
        self._per_tenant: Counter[str] = Counter()
        self.num_bytes = 0
        self.removed: Counter[str] = Counter()
        self.shared_failures = 0
        self.collector = _Collector(self, model_name)

    def __len__(self) -> int:
        return len(self._local)

    async def save(self, record: StoredResponse) -> None:
        """Keep ``record`` here and in every KV store tier (awaited: when this returns,
        another worker can read it, unless a tier failed — logged and counted)."""
        await self.sweep()
        raw = record.encode()
        key = (record.tenant, record.id)
        self._forget(record)  # (saved again: a continuation after a failover)
        self._local[key] = (record, len(raw))
        self._per_tenant[record.tenant] += 1
        self.num_bytes += len(raw)
        if self.shared:
            await self._shared(PutRecords([(record_key(record.tenant, record.id), raw)]))
        while self._per_tenant[record.tenant] > self.max_per_tenant:
            oldest = next(r for (t, _), (r, _) in self._local.items() if t == record.tenant)
            await self._remove(oldest, "evicted")

    async def load(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's response ``response_id``, from here or a shared tier; None when
        there is none, it expired (then it is removed) or it is another tenant's."""
        await self.sweep()
        entry = self._local.get((tenant, response_id))
        if entry is not None:
            return entry[0]
        if not self.shared:
            return None
        raw = await self._shared(GetRecord(record_key(tenant, response_id)), bytes | None)
        record = StoredResponse.decode(raw) if raw else None
        if record is None or record.tenant != tenant or record.id != response_id:
            return None
        if record.expires_at < time.time():
            await self._remove(record, "expired")
            return None
        return record

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Remove the tenant's response and (when it is the newest turn) its KV; False
        when there is none."""
        record = await self.load(tenant, response_id)
        if record is None:
            return False
        await self._remove(record, "deleted")
        return True

    async def sweep(self) -> None:
        """Remove this worker's expired responses (oldest first: they expire in order)."""
        now = time.time()
        while self._local:
            record, _ = next(iter(self._local.values()))
            if record.expires_at >= now:
                return
            await self._remove(record, "expired")

    def _forget(self, record: StoredResponse) -> None:
        """Drop this worker's copy of ``record`` (if any) from the counts."""
        entry = self._local.pop((record.tenant, record.id), None)
        if entry is not None:
            self._per_tenant[record.tenant] -= 1
            self.num_bytes -= entry[1]

    async def _remove(self, record: StoredResponse, reason: str) -> None:
        self._forget(record)
        self.removed[reason] += 1
        if not self.shared:
            return
        await self._shared(DeleteRecords([record_key(record.tenant, record.id)]))
        newest = tokens_digest(record.token_ids)  # only if its turn is the session's newest
        await self._shared(DeleteSession(record.tenant, record.session_id, newest), bool)

    async def _shared(self, call: UtilityCall, result: Any = Any) -> Any:
        """``call`` on the engine's KV store, its value decoded as ``result``; None
        (counted) when it fails."""
        try:
            return await self.engine.call(call, result, timeout=_CALL_TIMEOUT_S)
        except Exception as e:  # a slow or failed tier: the local copy still serves
            self.shared_failures += 1
            logger.warning("stored responses: %s failed: %s", type(call).__name__, e)
            return None


class _Collector:
    """The store's size and removals in ``/metrics`` (this worker's copies)."""

    def __init__(self, store: ResponseStore, model_name: str):
        self.store = store
        self.model_name = model_name

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s, labels = self.store, ["model_name"]
        count = GaugeMetricFamily(
            "kvserve_responses_stored", "Stored responses this worker holds.", labels=labels
        )
        count.add_metric([self.model_name], len(s))
        yield count
        size = GaugeMetricFamily(
            "kvserve_responses_stored_bytes",
            "Bytes of the stored responses this worker holds (records; their KV blocks "
            "count in the KV store tiers).",
            labels=labels,
        )
        size.add_metric([self.model_name], s.num_bytes)
        yield size
        removed = CounterMetricFamily(
            "kvserve_responses_removed",
            "Stored responses removed, by reason (deleted, expired, evicted by the "
            "per-tenant limit).",
            labels=[*labels, "reason"],
        )
        for reason in REMOVAL_REASONS:
            removed.add_metric([self.model_name, reason], s.removed[reason])
        yield removed
        failures = CounterMetricFamily(
            "kvserve_responses_store_failures",
            "Reads and writes of stored responses in the KV store tiers that failed.",
            labels=labels,
        )
        failures.add_metric([self.model_name], s.shared_failures)
        yield failures
