"""The KVStore contract: a key → bytes store of KV blocks named by their chained hash.

Keys are the 16-byte chained block hashes of ``kvserve.kv.hashing`` (``BlockHash``), so a
key names a block's exact token prefix *and* what the bytes are (the hash is rooted in
the model fingerprint, KV dtype and block size). Values are serialized blocks
(``kvserve.store.serde``); a store never interprets them.

Contract for every backend:

- ``contains(keys)`` → how many *leading* keys are present (stops at the first miss);
  a prefix lookup needs exactly this.
- ``get(keys)`` → one ``bytes | None`` per key, in order (None: absent).
- ``put(items)`` stores ``(key, value)`` pairs; an existing key may be overwritten with
  the same bytes. A bounded store may evict others (LRU) to make room, and may drop a value
  larger than its capacity.
- ``delete(keys)`` removes the keys that exist; absent keys are ignored.
- ``close()`` releases connections/files; the store is unusable afterwards.
- Errors: a backend that cannot reach its server raises ``StoreUnavailable``; the tiered
  store counts it and serves from the other tiers (recompute as the last resort). Nothing
  else is raised for absent data.

Batches are lists so that network backends can pipeline them in one round trip.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

Key = bytes


class StoreUnavailable(RuntimeError):
    """The backend cannot serve right now (connection refused, timeout, server error)."""


class KVStore(ABC):
    """One tier. ``name`` labels its metrics (``host``, ``file``, ``redis``, ``s3`` …)."""

    name: str = "store"

    @abstractmethod
    def contains(self, keys: Sequence[Key]) -> int:
        """Number of leading ``keys`` present."""

    @abstractmethod
    def get(self, keys: Sequence[Key]) -> list[bytes | None]:
        """Values of ``keys`` (None where absent), in order."""

    @abstractmethod
    def put(self, items: Sequence[tuple[Key, bytes]]) -> None:
        """Store every ``(key, value)``."""

    @abstractmethod
    def delete(self, keys: Sequence[Key]) -> None:
        """Remove ``keys`` that exist."""

    def close(self) -> None:  # noqa: B027 - optional for backends with nothing to release
        """Release resources."""


def count_leading(keys: Sequence[Key], present: Callable[[Key], bool]) -> int:
    """How many leading ``keys`` are ``present`` (the ``contains`` contract)."""
    n = 0
    for k in keys:
        if not present(k):
            break
        n += 1
    return n
