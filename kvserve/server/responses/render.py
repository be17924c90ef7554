"""A response's output as the Responses API shows it: the response object and, for a
stream, the semantic events in OpenAI's lifecycle order.

``ResponseEvents`` is fed the chat deltas of the response's one choice (``ChoiceState``
updates: content and tool-call deltas) and turns them into output items: a ``message``
item with one ``output_text`` part, opened at the first content, and a
``function_call`` item per tool call. The stream is::

    response.created, response.in_progress,
    (response.output_item.added, response.content_part.added,
     response.output_text.delta …, response.output_text.done,
     response.content_part.done, response.output_item.done)      per message item
    (response.output_item.added, response.function_call_arguments.delta …,
     response.function_call_arguments.done, response.output_item.done)  per call
    response.completed | response.incomplete | response.failed   (with usage)

Every event has a ``sequence_number`` counting from 0. A non-streamed response is built
by the same feed (its events are dropped), so both carry the same items.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any

from kvserve.server.responses.protocol import ResponsesRequest

# a choice's finish reason → the response's status and incomplete_details
_STATUS = {
    "stop": ("completed", None),
    "tool_calls": ("completed", None),
    "length": ("incomplete", {"reason": "max_output_tokens"}),
}


def usage(input_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def derived_id(response_id: str, prefix: str, n: int, digits: int = 32) -> str:
    """The id of the ``n``-th ``prefix`` thing of a response (an output item, a call):
    a worker continuing the response after a failover names it as the first did."""
    h = hashlib.blake2b(f"{response_id}/{prefix}/{n}".encode(), digest_size=16).hexdigest()
    return f"{prefix}_{h[:digits]}"


class ResponseEvents:
    """``created_at``: the first worker's, when this one continues its response."""

    def __init__(
        self, response_id: str, model: str, body: ResponsesRequest, created_at: int | None = None
    ):
        self.id = response_id
        self.model = model
        self.body = body
        self.created_at = int(time.time()) if created_at is None else created_at
        self.items: list[dict[str, Any]] = []
        self.status = "in_progress"
        self._seq = 0
        self._message: int | None = None  # output index of the open message item
        self._calls: dict[int, int] = {}  # tool-call index → output index (open calls)
        self.final: dict[str, Any] | None = None  # the response object, once finished

    # ---- the response object ------------------------------------------------------------
    def response(
        self, usage: dict[str, Any] | None = None, details: Any = None, error: Any = None
    ) -> dict[str, Any]:
        b = self.body
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "background": False,
            "error": error,
            "incomplete_details": details,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "metadata": b.metadata or {},
            "model": self.model,
            "output": self.items,
            "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": b.store,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "text": {
                "format": (
                    fmt.model_dump(by_alias=True, exclude_none=True)
                    if fmt is not None
                    else {"type": "text"}
                )
            },
            "tool_choice": _dump(b.tool_choice) if b.tool_choice is not None else "auto",
            "tools": [{"strict": None, **t.model_dump(exclude_none=True)} for t in b.tools or []],
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": b.user,
        }

    # ---- events ---------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def call_id(self, k: int) -> str:
        """The ``call_id`` of the response's k-th tool call (``ToolCallStream``)."""
        return derived_id(self.id, "call", k, 24)

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat delta choice (``{"delta": {"content", "tool_calls"}}``),
        in the order they were generated: argument text of the calls already open, then
        content (which ends those calls), then new calls (each ending the items before
        it — one item is open at a time, as OpenAI streams them)."""
        d = delta.get("delta") or {}
        calls = d.get("tool_calls") or []
        opened = set(self._calls)
        early = [c for c in calls if "id" not in c and c.get("index") in opened]
        events: list[dict[str, Any]] = []
        for call in early:
            events += self._call_delta(call)
        content = d.get("content")
        if content:
            events += self._text(content)
        for call in calls:
            if not any(call is c for c in early):
                events += self._call_delta(call)
        return events

    def _text(self, content: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._message is None:
            events += self._close_calls()
            events += self._open_message()
        item = self.items[self._message]  # type: ignore[index]
        item["content"][0]["text"] += content
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=self._message,
                content_index=0,
                delta=content,
                logprobs=[],
            )
        )
        return events

    def _call_delta(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A tool-call delta: a new call (an ``id``) opens its item; arguments extend it."""
        events: list[dict[str, Any]] = []
        fn = call.get("function") or {}
        if "id" in call:
            events += self._close_message() + self._close_calls()
            item = {
                "id": derived_id(self.id, "fc", len(self.items)),
                "type": "function_call",
                "status": "in_progress",
                "call_id": call["id"],
                "name": fn.get("name", ""),
                "arguments": "",
            }
            self._calls[call["index"]] = len(self.items)
            self.items.append(item)
            events.append(
                self._event(
                    "response.output_item.added", output_index=len(self.items) - 1, item=dict(item)
                )
            )
        args = fn.get("arguments")
        index = self._calls.get(call.get("index", -1))
        if args and index is not None:
            self.items[index]["arguments"] += args
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=self.items[index]["id"],
                    output_index=index,
                    delta=args,
                )
            )
        return events

    def finish(
        self,
        reason: str | None,
        usage: dict[str, Any],
        error: str | None = None,
        code: str = "server_error",
    ) -> list[dict[str, Any]]:
        """Close every open item and end with the terminal event for ``reason`` (the
        choice's finish reason; ``abort`` or an ``error``: failed, with ``code``)."""
        status, details = _STATUS.get(reason or "", ("failed", None))
        self.status = status
        events: list[dict[str, Any]] = []
        if not self.items and status != "failed":
            events += self._open_message()  # an empty answer is an empty message
        events += self._close_message() + self._close_calls()
        failure = None
        if status == "failed":
            failure = {"code": code, "message": error or "the request was aborted"}
        terminal = {"completed": "response.completed", "incomplete": "response.incomplete"}
        self.final = self.response(usage, details, failure)
        events.append(self._event(terminal.get(status, "response.failed"), response=self.final))
        return events

    # ---- items ----------------------------------------------------------------------------
    def _open_message(self) -> list[dict[str, Any]]:
        item = {
            "id": derived_id(self.id, "msg", len(self.items)),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self._message = len(self.items)
        self.items.append(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events = [
            self._event("response.output_item.added", output_index=self._message, item=_copy(item)),
            self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=self._message,
                content_index=0,
                part=dict(part),
            ),
        ]
        item["content"].append(part)
        return events

    def _close_message(self) -> list[dict[str, Any]]:
        if self._message is None:
            return []
        index, self._message = self._message, None
        item = self.items[index]
        item["status"] = "completed" if self.status != "incomplete" else "incomplete"
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self._event("response.output_text.done", **where, text=part["text"], logprobs=[]),
            self._event("response.content_part.done", **where, part=dict(part)),
            self._event("response.output_item.done", output_index=index, item=_copy(item)),
        ]

    def _close_calls(self) -> list[dict[str, Any]]:
        events = []
        for index in self._calls.values():
            item = self.items[index]
            item["status"] = "completed" if self.status != "incomplete" else "incomplete"
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
            events.append(
                self._event("response.output_item.done", output_index=index, item=dict(item))
            )
        self._calls.clear()
        return events


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": [dict(p) for p in item["content"]]}


def _dump(value: Any) -> Any:
    return value.model_dump() if hasattr(value, "model_dump") else value
