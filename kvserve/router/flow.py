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
from kvserve.server.responses.record import (
    RESPONSE_ID_HEADER,
    TOKEN_IDS_HEADER,
    new_response_id,
    session_of,
)

# the events that end a Responses stream, and those that stand alone (sent at once)
TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")
LIFECYCLE_EVENTS = ("response.created", "response.in_progress", *TERMINAL_EVENTS)


@dataclass
class Flow:
    """A client request in flight and what its client has received so far."""

    kind: str  # "completion", "chat" or "responses"
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
    response_id: str | None = None  # responses: the id the router chose (routes by it)
    events: int = 0  # responses: events the client got (the next one's sequence_number)
    near: str | None = None  # responses: the previous response's session (placement)
    pending: list[dict[str, Any]] = field(default_factory=list)  # responses: held events

    @classmethod
    def for_response(cls, body: dict[str, Any], headers: Any) -> Flow:
        """A ``/v1/responses`` request: the router names the response (so its session —
        the conversation's — is known before a worker answers: the previous response's
        holder is its owner) and adds a ``seed`` when the client gave none. Nothing else
        is added to the body; token ids come back in the events (``X-Kvserve-Token-Ids``)."""
        previous = body.get("previous_response_id")
        valid = isinstance(previous, str | None) and isinstance(body.get("seed"), int | None)
        stored = body.get("store") is not False
        # a response not stored starts a conversation of its own (an ephemeral session),
        # so it never takes over the stored one's session; it still goes near it
        rid = new_response_id(previous if valid and stored else None)
        up = dict(body)
        if valid and up.get("seed") is None:
            up["seed"] = secrets.randbits(62)
        flow = cls(
            "responses",
            up,
            session_of(rid) or rid,
            not stored,
            False,
            valid,
            headers.get("authorization"),
            stream=bool(body.get("stream")),
        )
        flow.response_id = rid
        if valid and isinstance(previous, str):
            flow.near = session_of(previous)
        return flow

    @property
    def done_marker(self) -> str:
        """What ends the client's SSE stream after the last event (Responses: nothing)."""
        return "" if self.kind == "responses" else "data: [DONE]\n\n"

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
        if self.response_id is not None:
            h[RESPONSE_ID_HEADER] = self.response_id
            h[TOKEN_IDS_HEADER] = "1"
        return h

    def observe(self, payload: dict[str, Any]) -> dict[str, Any] | None:
        """Note what this chunk (or whole response) gives the client; return it as the
        client gets it (same id and created as the first, token ids and usage only if
        asked), or None for a usage chunk the client did not ask for."""
        if self.kind == "responses":
            return self._observe_event(payload)
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

    def deliver(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        """A streamed chunk or event as the client gets it, now: for a Responses stream
        the events of one engine update are held until the one carrying its token ids
        (or a lifecycle event) arrives, then released together, numbered in the
        client's sequence — a worker failing amid an update leaves none of its events
        with the client, so its continuation repeats nothing."""
        if self.kind != "responses":
            out = self.observe(payload)
            return [] if out is None else [out]
        ids = payload.pop("kvserve_token_ids", None)
        kind = payload.get("type")
        if kind != "kvserve.token_ids":
            self.pending.append(payload)
        if not ids and kind not in LIFECYCLE_EVENTS and kind != "kvserve.token_ids":
            return []
        if isinstance(ids, list):
            self.ids += ids
        released, self.pending = self.pending, []
        for event in released:
            self._observe_event(event)
        return released

    def drop_pending(self) -> None:
        """The worker failed: the events of its unfinished update never reach the client."""
        self.pending = []

    def error_event(self, body: dict[str, Any]) -> dict[str, Any]:
        """The router's error ``body`` as the client's stream shows it: a Responses
        ``error`` event (numbered in its sequence), else the body itself."""
        if self.kind != "responses":
            return body
        err = body.get("error") or {}
        event = {"type": "error", "code": err.get("code") or "server_error",
                 "message": err.get("message"), "param": None,
                 "sequence_number": self.events}  # fmt: skip
        self.events += 1
        return event

    def _observe_event(self, payload: dict[str, Any]) -> dict[str, Any] | None:
        """A Responses event (or whole response object), numbered in the client's
        sequence; its usage noted."""
        kind = payload.get("type")
        response = payload.get("response") if isinstance(kind, str) else payload
        if isinstance(response, dict):
            if kind == "response.created":
                self.created = response.get("created_at")
            use = response.get("usage")
            if isinstance(use, dict):
                details = use.get("input_tokens_details") or {}
                self.cached_tokens = int(details.get("cached_tokens") or 0)
        if isinstance(kind, str):
            payload["sequence_number"] = self.events
            self.events += 1
            self.finished = kind in TERMINAL_EVENTS
        return payload
