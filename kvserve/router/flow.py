"""A client request in flight through the router (``Flow``): the body as sent upstream,
the session it belongs to, and what its client has received so far — the token ids and text
characters a standby resumes after, the first response's ``id`` and ``created`` that later
chunks keep. ``Flow.observe`` notes each chunk (or whole response) as the client gets it."""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvserve.router.scoring import PromptInfo


@dataclass
class Flow:
    """A client request in flight and what its client has received so far."""

    kind: str  # "completion" or "chat"
    body: dict[str, Any]  # as sent upstream
    session: str
    ephemeral: bool
    want_ids: bool  # the client asked for token ids itself
    resumable: bool
    auth: str | None
    ids: list[int] = field(default_factory=list)  # token ids delivered (choice 0)
    chars: int = 0  # text characters delivered (choice 0)
    finished: bool = False  # choice 0 sent its finish_reason
    first_id: str | None = None
    created: int | None = None
    failed: set[str] = field(default_factory=set)
    failovers: int = 0
    prompt: PromptInfo = field(default_factory=PromptInfo)
    strip_usage: bool = False  # the router asked for the usage chunk, not the client
    cached_tokens: int | None = None  # the worker's usage.prompt_tokens_details
    predicted_cached: int | None = None  # placement's guess (prefix routing only)
    placed_prompt_tokens: int = 0  # the prompt in the placed worker's tokens (with the guess)
    arrived: float = field(default_factory=time.perf_counter)  # the client's request came
    stream: bool = False
    handoff_to: str | None = None  # disaggregated: the decode worker after the first token

    @classmethod
    def from_client(cls, kind: str, body: dict[str, Any], headers: Any) -> Flow:
        # fields the router sets: with a wrong type they must reach the worker as sent
        valid = isinstance(body.get("session_id"), str | None) and isinstance(
            body.get("return_token_ids", False), bool
        )
        session = (body.get("session_id") or headers.get("x-session-id")) if valid else None
        ephemeral = not session
        if ephemeral:
            session = f"rt-{uuid.uuid4().hex}"
        n = body.get("n") or 1
        resumable = valid and n == 1 and not body.get("logprobs") and not body.get("echo")
        up = dict(body, session_id=session) if valid else dict(body)
        if resumable:
            up["return_token_ids"] = True
            if up.get("seed") is None:
                up["seed"] = secrets.randbits(62)
        options = body.get("stream_options")
        strip_usage = (
            valid
            and bool(body.get("stream"))
            and isinstance(options, dict | None)  # (anything else: the worker's 400)
            and not (options or {}).get("include_usage")
        )
        if strip_usage:
            up["stream_options"] = {**(options or {}), "include_usage": True}
        return cls(
            kind,
            up,
            session,
            ephemeral,
            bool(body.get("return_token_ids")),
            resumable,
            headers.get("authorization"),
            strip_usage=strip_usage,
            stream=bool(body.get("stream")),
        )

    def headers(self, epoch: int | None = None) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.auth:
            h["Authorization"] = self.auth
        if epoch is not None:
            h["X-Kvserve-Session-Epoch"] = str(epoch)
        if self.ephemeral:
            h["X-Kvserve-Ephemeral-Session"] = "1"
        return h

    def observe(self, payload: dict[str, Any]) -> dict[str, Any] | None:
        """Note what this chunk (or whole response) gives the client; return it as the
        client gets it (same id and created as the first, token ids and usage only if
        asked), or None for a usage chunk the client did not ask for."""
        use = payload.pop("usage", None) if self.strip_usage else payload.get("usage")
        if isinstance(use, dict):
            details = use.get("prompt_tokens_details") or {}
            self.cached_tokens = int(details.get("cached_tokens") or 0)
            if self.strip_usage and not payload.get("choices"):
                return None
        if self.first_id is None:
            self.first_id, self.created = payload.get("id"), payload.get("created")
        else:
            payload["id"], payload["created"] = self.first_id, self.created
        for c in payload.get("choices") or []:
            if c.get("index", 0) == 0:
                self.ids += c.get("token_ids") or []
                if self.kind == "chat":
                    part = (c.get("delta") or c.get("message") or {}).get("content")
                else:
                    part = c.get("text")
                self.chars += len(part or "")
                if c.get("finish_reason") is not None:
                    self.finished = True
            if not self.want_ids:
                c.pop("token_ids", None)
        if not self.want_ids:
            payload.pop("prompt_token_ids", None)
        return payload
