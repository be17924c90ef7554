"""Tool-call parsers: a model's output text → content and tool calls, per output format.

Each parser reads the whole text so far (``parse(text, final)``) and returns what is
certain: the content before any tool call (minus a tail that could still become a call's
opening marker, while ``final`` is False) and the calls as far as generated. Parsing the
cumulative text keeps streaming and non-streaming identical by construction. A final
parse whose calls do not all parse as JSON objects with a name is plain content (the
model wrote something that only looked like a call).

Formats (``--tool-call-parser``): ``hermes`` (Hermes, Qwen 2.5/3 and kvserve's own prompt
for templates that do not take tools: ``<tool_call>{"name", "arguments"}</tool_call>``),
``llama3_json`` (Llama 3.x: a JSON object ``{"name", "parameters"}`` as the whole reply,
calls separated by ``;``, after an optional ``<|python_tag|>``), ``mistral``
(``[TOOL_CALLS]`` then a JSON array of calls). Two more serve ``tool_choice``
``required`` and a named function, whose output a grammar constrains: ``json_array``
(``[{"name", "parameters"}, …]``) and ``NamedParser`` (the output is the arguments).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from kvserve.server.tools.json_scan import PartialCall, scan_call, scan_calls, skip_ws


@dataclass
class Parsed:
    content: str
    calls: list[PartialCall] = field(default_factory=list)


def _held(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _settle(parsed: Parsed, text: str, final: bool) -> Parsed:
    if final and parsed.calls and not all(c.valid for c in parsed.calls):
        return Parsed(text)
    return parsed


class ToolParser(ABC):
    name: ClassVar[str]
    # its markers are special tokens: the text it reads must keep them
    keeps_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def parse(self, text: str, final: bool) -> Parsed:
        """Content and calls of ``text`` (the whole output so far)."""


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        at = text.find(self.OPEN)
        if at < 0:
            keep = len(text) if final else len(text) - _held(text, self.OPEN)
            return Parsed(text[:keep])
        calls: list[PartialCall] = []
        i = at
        while i >= 0:
            j = skip_ws(text, i + len(self.OPEN))
            if j >= len(text):
                break
            if text[j] != "{":
                calls.append(PartialCall())  # not a call: invalid at the end
                break
            call = scan_call(text, j)
            calls.append(call)
            if call.end is None:
                break
            i = text.find(self.OPEN, call.end)
        return _settle(Parsed(text[:at], calls), text, final)


class MistralParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True
    MARK = "[TOOL_CALLS]"

    def parse(self, text: str, final: bool) -> Parsed:
        at = text.find(self.MARK)
        if at < 0:
            keep = len(text) if final else len(text) - _held(text, self.MARK)
            return Parsed(text[:keep])
        j = skip_ws(text, at + len(self.MARK))
        calls: list[PartialCall] = []
        if j < len(text):
            if text[j] == "[":
                calls, _ = scan_calls(text, j + 1)
            elif text[j] == "{":
                calls, _ = scan_calls(text, j)
            else:
                calls = [PartialCall()]
        return _settle(Parsed(text[:at], calls), text, final)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    keeps_special_tokens = True
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].lstrip()
        elif not final and self.TAG.startswith(body):
            return Parsed("")  # may still become the tag
        if not body:
            return Parsed(text if final else "")
        if body[0] != "{":
            return Parsed(text)
        calls, _ = scan_calls(body, 0, sep=";")
        return _settle(Parsed("", calls), text, final)


class JsonArrayParser(ToolParser):
    """``tool_choice: "required"``: the grammar makes the output a JSON array of calls."""

    name = "json_array"

    def parse(self, text: str, final: bool) -> Parsed:
        j = skip_ws(text, 0)
        if j >= len(text):
            return Parsed("")
        if text[j] != "[":
            return Parsed(text)
        calls, _ = scan_calls(text, j + 1)
        return _settle(Parsed("", calls), text, final)


class NamedParser(ToolParser):
    """A named ``tool_choice``: the grammar makes the whole output that function's
    arguments object."""

    name = "named"

    def __init__(self, function: str):
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.strip()
        call = PartialCall(self.function, body, args_done=final, end=len(text) if final else None)
        return _settle(Parsed("", [call] if body or final else []), text, final)


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, MistralParser, Llama3JsonParser)
}
PARSER_NAMES = ("auto", *PARSERS)


def parser_for_template(choice: str, template: str | None) -> ToolParser:
    """The parser ``--tool-call-parser`` names; ``auto`` reads the chat template: Mistral's
    marker, Llama 3's python tag, else Hermes (also what kvserve's own tools prompt asks
    of a model whose template does not take tools)."""
    if choice != "auto":
        return PARSERS[choice]()
    t = template or ""
    if MistralParser.MARK in t:
        return MistralParser()
    if Llama3JsonParser.TAG in t or ("tools" in t and '"parameters"' in t):
        return Llama3JsonParser()
    return HermesParser()
