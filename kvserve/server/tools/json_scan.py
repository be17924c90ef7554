"""Reading tool calls out of JSON text that is still being generated.

``scan_call(text, i)`` reads the object that starts at ``text[i]`` (``{``) as far as it
goes and returns what is certain so far: the function's name once its string is closed,
and the arguments' JSON text — all of it once closed, else the prefix generated so far
(a prefix only ever grows, so a stream can send the new part of it each time). This is a
lexer for streaming, not a validator: a finished call is checked with ``json.loads``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

NAME_KEYS = ("name",)
ARG_KEYS = ("arguments", "parameters")
_WS = " \t\r\n"


@dataclass
class PartialCall:
    """One tool call as far as it is known. ``arguments`` is JSON text (a prefix while
    ``args_done`` is False); ``end`` is the index after the object's ``}`` once closed."""

    name: str | None = None
    arguments: str = ""
    args_done: bool = False
    end: int | None = None

    @property
    def valid(self) -> bool:
        """A closed object with a name and arguments that parse as a JSON object."""
        if self.end is None or self.name is None or not self.args_done:
            return False
        try:
            return isinstance(json.loads(self.arguments), dict)
        except ValueError:
            return False


def skip_ws(t: str, i: int) -> int:
    while i < len(t) and t[i] in _WS:
        i += 1
    return i


def _string_end(t: str, i: int) -> int | None:
    """Index after the string starting at ``t[i]`` (``"``), or None when still open."""
    j = i + 1
    while j < len(t):
        c = t[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(t: str, i: int) -> int | None:
    """Index after the JSON value starting at ``t[i]``, or None when it is not closed
    (a scalar is closed by the character after it)."""
    if i >= len(t):
        return None
    c = t[i]
    if c == '"':
        return _string_end(t, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(t):
            c = t[j]
            if c == '"':
                end = _string_end(t, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(t) and t[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(t) else None


def scan_call(t: str, i: int) -> PartialCall:
    """The call whose object starts at ``t[i]`` (which must be ``{``)."""
    call = PartialCall()
    j = i + 1
    while True:
        j = skip_ws(t, j)
        if j >= len(t):
            return call
        if t[j] == "}":
            call.end = j + 1
            return call
        if t[j] == ",":
            j += 1
            continue
        if t[j] != '"':
            return call  # not JSON: never valid
        key_end = _string_end(t, j)
        if key_end is None:
            return call
        key = json.loads(t[j:key_end])
        j = skip_ws(t, key_end)
        if j >= len(t) or t[j] != ":":
            return call
        start = skip_ws(t, j + 1)
        end = value_end(t, start)
        if key in ARG_KEYS:
            _read_arguments(call, t, start, end)
        elif key in NAME_KEYS and end is not None:
            value = json.loads(t[start:end]) if t[start] == '"' else None
            call.name = value if isinstance(value, str) else None
        if end is None:
            return call
        j = end


def _read_arguments(call: PartialCall, t: str, start: int, end: int | None) -> None:
    if start < len(t) and t[start] == '"':  # arguments given as a JSON string of JSON
        if end is not None:
            value = json.loads(t[start:end])
            call.arguments, call.args_done = (value if isinstance(value, str) else ""), True
        return
    call.arguments = t[start:end] if end is not None else t[start:].rstrip(_WS)
    call.args_done = end is not None


def scan_calls(t: str, i: int, sep: str = ",") -> tuple[list[PartialCall], int]:
    """Calls written one after another from ``t[i]`` (objects separated by ``sep`` and
    whitespace); stops at the first character that starts no object. Returns the calls
    and the index where reading stopped."""
    calls: list[PartialCall] = []
    j = skip_ws(t, i)
    while j < len(t) and t[j] == "{":
        call = scan_call(t, j)
        calls.append(call)
        if call.end is None:
            return calls, len(t)
        j = skip_ws(t, call.end)
        if j < len(t) and t[j] == sep:
            j = skip_ws(t, j + 1)
    return calls, j
