"""KV events: which block hashes a node holds, as a stream of changes.

A worker tells the cluster's routers what it can serve from cache so they can send a
request to the worker holding the longest part of its prefix (``router.index``). Events
name blocks by the chained hashes of ``kv.hashing`` — the same names the engine's prefix
cache and the KV store use — in two tiers:

- ``device``: the block pool's prefix index (used or cached-free blocks: either serves a
  hit without a copy). ``BlocksStored`` when a full block is registered,
  ``BlocksRemoved`` when its hash is dropped (the block was reused, or the prefix cache
  reset).
- ``host``: the first KV store tier (host memory; a hit costs one copy). Its keys include
  stored sessions' keys, which never match a block chain, so they are harmless noise.

The engine collects events in a ``KVEventLog`` (thread-safe: the host tier is written
from the replication and pre-warm threads too) and drains it once per loop iteration into
its ``Outputs`` frame; the API server numbers and publishes them (``server.kv_events``).
The log is bounded: past ``max_pending`` undrained hashes it drops what it holds and
raises ``overflowed``; the engine then sends the whole state in its place
(``full_state``: each tier cleared and everything it holds stored), so the publisher's
mirror, and every reader, is exact again.

**Sealed names.** With a cluster secret, published hashes are sealed: a keyed BLAKE2b of
each hash under a key derived from the secret (``events_key``, ``seal``). A router holds
the secret and seals the chains it computes the same way; anyone else who reads the
events port cannot tell from them whether a given prompt was sent.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable

import msgspec

DEVICE, HOST = "device", "host"
TIERS = (DEVICE, HOST)


class BlocksStored(msgspec.Struct, tag=True, array_like=True):
    """These hashes are now held in ``tier``."""

    tier: str
    hashes: list[bytes]


class BlocksRemoved(msgspec.Struct, tag=True, array_like=True):
    """These hashes are no longer held in ``tier``."""

    tier: str
    hashes: list[bytes]


class TierCleared(msgspec.Struct, tag=True, array_like=True):
    """Forget everything ``tier`` held; what follows is its new content. ``lossy``: detail
    was lost upstream, the reader needs a snapshot to know the tier again."""

    tier: str
    lossy: bool = False


KVEvent = BlocksStored | BlocksRemoved | TierCleared


class KVEventLog:
    """Changes since the last ``drain``, in order, consecutive ones of a kind merged."""

    def __init__(self, max_pending: int = 1 << 20):
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._events: list[KVEvent] = []
        self._pending = 0  # hashes in _events
        self.num_overflows = 0
        self.overflowed = False  # events were dropped: send ``full_state`` next

    def stored(self, tier: str, hashes: Iterable[bytes]) -> None:
        self._add(BlocksStored, tier, hashes)

    def removed(self, tier: str, hashes: Iterable[bytes]) -> None:
        self._add(BlocksRemoved, tier, hashes)

    def _add(self, kind: type[BlocksStored] | type[BlocksRemoved], tier: str, hashes) -> None:
        hashes = list(hashes)
        if not hashes:
            return
        with self._lock:
            if self.overflowed:
                return  # (the full state sent next covers it)
            if self._pending + len(hashes) > self.max_pending:
                self.num_overflows += 1
                self.overflowed = True
                self._events, self._pending = [], 0
                return
            last = self._events[-1] if self._events else None
            if type(last) is kind and last.tier == tier:  # type: ignore[union-attr]
                last.hashes.extend(hashes)  # type: ignore[union-attr]
            else:
                self._events.append(kind(tier, hashes))
            self._pending += len(hashes)

    def drain(self) -> list[KVEvent] | None:
        """Every event since the last drain (and forget them); None after an overflow
        (cleared by this call): the caller sends ``full_state`` instead, taken after
        this call — changes made meanwhile are in the next drain as well, and applying
        them twice changes nothing."""
        with self._lock:
            out, self._events, self._pending = self._events, [], 0
            if self.overflowed:
                self.overflowed = False
                return None
        return out

    def __bool__(self) -> bool:
        return bool(self._events) or self.overflowed


def full_state(tiers: dict[str, Iterable[bytes]]) -> list[KVEvent]:
    """Events that replace a reader's view of each tier in ``tiers`` by its content."""
    out: list[KVEvent] = []
    for tier, hashes in tiers.items():
        out.append(TierCleared(tier))
        held = list(hashes)
        if held:
            out.append(BlocksStored(tier, held))
    return out


def apply(held: dict[str, set[bytes]], events: Iterable[KVEvent]) -> bool:
    """Apply ``events`` to a ``tier → hashes`` view (changes it). Returns False when an
    event lost detail (a lossy ``TierCleared``): the view needs a snapshot."""
    ok = True
    for e in events:
        tier = held.setdefault(e.tier, set())
        if isinstance(e, BlocksStored):
            tier.update(e.hashes)
        elif isinstance(e, BlocksRemoved):
            tier.difference_update(e.hashes)
        else:
            tier.clear()
            ok = ok and not e.lossy
    return ok


def events_key(secret: str | None) -> bytes | None:
    """The key sealing published hashes: derived from the cluster secret (None without
    one: hashes are published as the engine names them)."""
    if not secret:
        return None
    return hashlib.blake2b(b"kvserve-kv-events\0" + secret.encode(), digest_size=32).digest()


def seal(key: bytes | None, hashes: Iterable[bytes]) -> list[bytes]:
    """``hashes`` as they are published under ``key`` (unchanged when None)."""
    if key is None:
        return list(hashes)
    return [hashlib.blake2b(h, key=key, digest_size=len(h)).digest() for h in hashes]


def sealed(key: bytes | None, events: Iterable[KVEvent]) -> list[KVEvent]:
    """``events`` with their hashes sealed under ``key``."""
    if key is None:
        return list(events)
    return [
        type(e)(e.tier, seal(key, e.hashes)) if isinstance(e, BlocksStored | BlocksRemoved) else e
        for e in events
    ]
