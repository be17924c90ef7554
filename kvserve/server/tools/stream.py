"""One choice's tool calls as OpenAI sends them: whole (``message.tool_calls``) or as
streaming deltas (``delta.tool_calls``).

``ToolCallStream.step(text, final)`` parses the whole text so far and returns only what is
new: the content's next characters and, per call, a first delta with its ``index``, ``id``,
``type`` and ``function.name`` (``arguments`` ""), then deltas appending to
``function.arguments`` as they are generated — OpenAI's streaming shape. The deltas of a
stream concatenate to what ``message()`` returns for the same text, because both read the
same parse (a parse of a longer text only extends a shorter one's content and arguments).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from kvserve.server.tools.parsers import Parsed, ToolParser


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """``name_call(k)``: the id of the k-th call (default: random); a response that must
    name its calls the same when another worker continues it derives them (Responses)."""

    def __init__(
        self, parser: ToolParser, parallel: bool, name_call: Callable[[int], str] | None = None
    ):
        self.parser = parser
        self.parallel = parallel
        self.name_call = name_call or (lambda _: call_id())
        self.ids: list[str] = []
        self._content_sent = 0
        self._args_sent: list[int] = []  # per call announced: argument characters sent

    def _parse(self, text: str, final: bool) -> Parsed:
        parsed = self.parser.parse(text, final)
        if not self.parallel:
            parsed.calls = parsed.calls[:1]
        while len(self.ids) < len(parsed.calls):
            self.ids.append(self.name_call(len(self.ids)))
        return parsed

    @property
    def called(self) -> bool:
        """Has a tool call been announced (streaming) or found?"""
        return bool(self._args_sent)

    def step(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """The new content and the new tool-call deltas of ``text`` (the output so far)."""
        parsed = self._parse(text, final)
        content = parsed.content[self._content_sent :]
        self._content_sent = max(self._content_sent, len(parsed.content))
        deltas: list[dict[str, Any]] = []
        for k, call in enumerate(parsed.calls):
            if k == len(self._args_sent):
                if call.name is None:
                    break
                deltas.append(
                    {
                        "index": k,
                        "id": self.ids[k],
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
                self._args_sent.append(0)
            if call.name is None:
                break
            new = call.arguments[self._args_sent[k] :]
            if new:
                deltas.append({"index": k, "function": {"arguments": new}})
                self._args_sent[k] = len(call.arguments)
        return content, deltas

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The finished output's content (None when there are calls and no other text)
        and its tool calls."""
        parsed = self._parse(text, True)
        calls = [
            {
                "id": self.ids[k],
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for k, c in enumerate(parsed.calls)
        ]
        if calls:
            self._args_sent = [len(c.arguments) for c in parsed.calls]
        return (parsed.content or None) if calls else parsed.content, calls
