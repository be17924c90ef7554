"""Stored sessions: a conversation's token ids and block hashes, kept in the KV store.

(Not the replicated stream state a standby resumes from: that is ``ha.record``'s
``SessionRecord``.) With a ``session_id`` on a request, the engine stores, when the turn
finishes, a ``StoredSession``: the session's tokens (prompt + output) and the hashes of its
full blocks. The blocks
themselves are in the store under those hashes already, so the next turn — here, after a
restart, or on another node sharing the tier — restores its prefix by the usual lookup;
the record says what the session holds, lets it expire (``ttl``) and be deleted with its
blocks (``DELETE /v1/sessions/{id}``). Records are per tenant: another tenant's session
with the same id is a different record.

Key: BLAKE2b-16 of ``kvserve-session`` ‖ tenant ‖ id, so records share the block
keyspace without colliding with blocks. Value: the ``StoredSession`` as JSON. An expired
record reads as absent and is deleted (a Redis tier with ``ttl=`` also expires it on its
own); one that does not decode is unreadable, never half-read. A record changes with every
turn, possibly on another node: a read takes the newest copy of every tier and promotes
none.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence

import msgspec

from kvserve.store.tiered import TieredStore


class StoredSession(msgspec.Struct):
    """One session's record: its tokens, the hashes of its full blocks (hex), when it was
    written and when it expires (Unix seconds). Fields a later version adds are ignored."""

    session: str
    tenant: str
    tokens: list[int]
    blocks: list[str]
    updated: float
    expires: float


def tokens_digest(tokens: Sequence[int]) -> str:
    """A short digest of a token list (is a session's newest turn this one?)."""
    return hashlib.blake2b(json.dumps(list(tokens)).encode(), digest_size=16).hexdigest()


def session_key(tenant: str, session_id: str) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(b"kvserve-session\0" + tenant.encode() + b"\0" + session_id.encode())
    return h.digest()


class SessionStore:
    """The stored sessions in a tiered store, each kept ``ttl`` seconds after its last turn."""

    def __init__(self, store: TieredStore, ttl: float):
        self.store = store
        self.ttl = ttl

    def record(
        self, tenant: str, session_id: str, token_ids: Sequence[int], blocks: Sequence[bytes]
    ) -> None:
        now = time.time()
        value = StoredSession(
            session_id, tenant, list(token_ids), [b.hex() for b in blocks], now, now + self.ttl
        )
        self.store.put([(session_key(tenant, session_id), msgspec.json.encode(value))])

    def get(self, tenant: str, session_id: str) -> StoredSession | None:
        """The stored session — the newest copy in any tier (another node may have
        recorded a later turn in the shared tier than this node's own tier holds) — or
        None when there is none, or it expired or is unreadable (then it is deleted)."""
        key = session_key(tenant, session_id)
        values = []
        for raw in self.store.get_each(key):
            try:
                values.append(msgspec.json.decode(raw, type=StoredSession))
            except msgspec.DecodeError:
                continue
        if not values:
            if self.store.lookup([key]):  # only unreadable copies
                self.store.delete([key])
            return None
        value = max(values, key=lambda v: v.updated)
        if value.expires < time.time():
            self.store.delete([key])
            return None
        return value

    def delete(self, tenant: str, session_id: str, if_tokens: str | None = None) -> bool:
        """Delete the record and its blocks; False when there was none — or, with
        ``if_tokens`` (a ``tokens_digest``), when the session's tokens are not those. Blocks
        shared with other sessions (a common system prompt) are deleted too: they are
        recomputed and stored again by whoever needs them next. Writes queued for the lower
        tiers land first (bounded wait), so none of the session's blocks reappears after."""
        value = self.get(tenant, session_id)
        if value is None or (if_tokens is not None and tokens_digest(value.tokens) != if_tokens):
            return False
        self.store.flush(10.0)
        self.store.delete([session_key(tenant, session_id)])
        self.store.delete([bytes.fromhex(h) for h in value.blocks])
        return True
