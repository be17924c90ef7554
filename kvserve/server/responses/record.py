"""A stored response: what ``previous_response_id``, ``GET`` and ``input_items`` read.

Ids name their conversation: ``resp_<chain><own>``, two 24-hex-digit parts. ``chain`` is
the first response's own part, kept by every response continuing it, and
``resp_<chain>`` is the conversation's *session* — the KV-store session (``store.sessions``)
whose tokens and blocks the engine records at the end of every turn. So the KV of a
conversation is one session however long the chain grows, its owner in a cluster is the
session's owner (a router routes ``previous_response_id`` there without a look-up), and a
turn restores the previous turn's blocks by the usual prefix lookup.

Key of a record in the KV store: BLAKE2b-16 of ``kvserve-response`` ‖ tenant ‖ id — another
tenant's key for the same id is a different key, so it reads as absent (a 404).
"""

from __future__ import annotations

import hashlib
import re
import uuid
from typing import Any

import msgspec

# a router names the response before a worker answers (it routes by the conversation)
RESPONSE_ID_HEADER = "x-kvserve-response-id"
# … and asks for the output token ids in the events (it may continue the stream elsewhere)
TOKEN_IDS_HEADER = "x-kvserve-token-ids"
_ID = re.compile(r"^resp_([0-9a-f]{24})([0-9a-f]{24})$")


class StoredResponse(msgspec.Struct, kw_only=True):
    """One stored response. ``response``: the response object as the client got it;
    ``input_items``: its own input items (with ids); ``history``: the conversation as
    chat messages, without instructions, ending with this response's output;
    ``token_ids``: the prompt and output token ids of this turn (a continuation starts
    from them); ``expires_at``: Unix time after which it reads as absent."""

    id: str
    tenant: str
    created_at: int
    expires_at: float
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]]
    token_ids: list[int]

    @property
    def session_id(self) -> str:
        return session_of(self.id) or self.id

    def encode(self) -> bytes:
        return msgspec.json.encode(self)

    @staticmethod
    def decode(raw: bytes) -> StoredResponse | None:
        """The record in ``raw``, or None when it is not one (a foreign or torn value)."""
        try:
            return msgspec.json.decode(raw, type=StoredResponse)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None


def new_response_id(previous: str | None = None) -> str:
    """A fresh id; in ``previous``'s conversation when given (and one of ours)."""
    m = _ID.match(previous or "")
    chain = m.group(1) if m else uuid.uuid4().hex[:24]
    return f"resp_{chain}{uuid.uuid4().hex[:24]}"


def session_of(response_id: str) -> str | None:
    """The session holding the KV of ``response_id``'s conversation; None when the id is
    not one this server makes."""
    m = _ID.match(response_id)
    return f"resp_{m.group(1)}" if m else None


def record_key(tenant: str, response_id: str) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(b"kvserve-response\0" + tenant.encode() + b"\0" + response_id.encode())
    return h.digest()
