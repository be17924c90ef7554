"""The cluster's HTTP bodies between router and worker, as typed msgspec Structs: the one
definition both sides encode and decode, instead of a string-keyed dict on each side."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

ResumeKind = Literal["completion", "chat", "responses"]


class ResumeBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /internal/resume``: continue session ``session_id``'s stream from what the
    client already has.

    ``delivered_token_ids`` / ``delivered_text_chars``: the tokens and characters the
    client received; ``seen_epoch``: the session's epoch the router saw (None: it could
    not read the coordinator); ``request``: the client's original body, of ``kind``;
    ``ephemeral``: the router made the session id up; ``response_id`` / ``created_at``:
    the Responses stream the client has begun to get (``kind == "responses"`` only)."""

    session_id: str
    request: dict[str, Any]
    kind: ResumeKind = "completion"
    delivered_token_ids: list[int] = msgspec.field(default_factory=list)
    delivered_text_chars: int = 0
    seen_epoch: int | None = None
    ephemeral: bool = False
    response_id: str | None = None
    created_at: int | None = None

    def __post_init__(self) -> None:
        if self.kind == "responses" and self.response_id is None:
            raise ValueError("a responses resume needs its response_id")
        if self.delivered_text_chars < 0:
            raise ValueError("delivered_text_chars must be >= 0")


def decode_resume(raw: bytes) -> ResumeBody:
    """The resume body in ``raw``; raises ValueError saying what is wrong."""
    try:
        return msgspec.json.decode(raw, type=ResumeBody)
    except msgspec.ValidationError as e:
        raise ValueError(str(e)) from None
    except msgspec.DecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
