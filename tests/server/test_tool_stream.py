"""Streamed tool calls, without a server: the deltas of every parser add up to the
non-streamed message whatever the token boundaries, and a stream resumed after any
delivered token (a failover) sends exactly what the client is still missing."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.default_model import DEFAULT_MODEL_DIR
from kvserve.engine.messages import EngineCoreOutput
from kvserve.engine.output import OutputProcessor
from kvserve.model.tokenizer import load_tokenizer
from kvserve.sampling import SamplingParams
from kvserve.server.render import ChoiceState
from kvserve.server.tools.parsers import (
    HermesParser,
    JsonArrayParser,
    Llama3JsonParser,
    MistralParser,
    NamedParser,
)
from kvserve.server.tools.stream import ToolCallStream

TOK = load_tokenizer(DEFAULT_MODEL_DIR)
CASES = [
    (HermesParser(), 'Sure! <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",'
     ' "unit": "c"}}\n</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
     "Sure! ", [("get_weather", '{"city": "Paris", "unit": "c"}'), ("add", '{"a": 1}')]),
    (MistralParser(), '[TOOL_CALLS] [{"name": "f", "arguments": {"x": [1, {"y": "}"}]}}]', None,
     [("f", '{"x": [1, {"y": "}"}]}')]),
    (Llama3JsonParser(), '{"name": "f", "parameters": {"q": "a;b"}}; {"name": "g", '
     '"parameters": {}}', None, [("f", '{"q": "a;b"}'), ("g", "{}")]),
    (JsonArrayParser(), '[{"name": "f", "parameters": {"k": "v\\"w"}}]', None,
     [("f", '{"k": "v\\"w"}')]),
    (NamedParser("f"), '{"a": 1, "b": "two"}', None, [("f", '{"a": 1, "b": "two"}')]),
    (HermesParser(), "No calls here <tool_ca", "No calls here <tool_ca", []),
    (HermesParser(), "Broken <tool_call>{nope</tool_call>", "Broken <tool_call>{nope</tool_call>",
     []),
]  # fmt: skip


def _pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def _collect(deltas: list[tuple[str, list[dict[str, Any]]]]) -> tuple[str, list[tuple]]:
    content, calls = "", {}
    for text, tool_deltas in deltas:
        content += text
        for d in tool_deltas:
            entry = calls.setdefault(d["index"], ["", ""])
            entry[0] += d.get("function", {}).get("name", "")
            entry[1] += d.get("function", {}).get("arguments", "")
    return content, [tuple(calls[k]) for k in sorted(calls)]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_streamed_deltas_add_up_to_the_message(parser, text, content, calls, cuts):
    stream = ToolCallStream(parser, parallel=True)
    so_far, deltas = "", []
    for piece in _pieces(text, cuts):
        so_far += piece
        deltas.append(stream.step(so_far, False))
    deltas.append(stream.step(so_far, True))
    got_content, got_calls = _collect(deltas)
    whole = ToolCallStream(parser, parallel=True)
    msg_content, msg_calls = whole.message(text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg_calls] == calls
    assert got_calls == calls
    assert (msg_content or "") == (content or "") and got_content == (content or "")


HERMES = CASES[0][1]


def _run(ids: list[int], delivered: int | None) -> list[dict[str, Any]]:
    """The chunks' choices a client receives: from the first token, or (a resume) after
    ``delivered`` tokens it already has."""
    params = SamplingParams(max_tokens=500)
    proc = OutputProcessor(TOK)
    start = delivered or 0
    proc.add_request("r", None, [1], params, output_token_ids=ids[:start])
    choice = ChoiceState(0, TOK, params, True, tools=ToolCallStream(HermesParser(), True))
    if delivered is not None:
        choice.resume_after(ids[:start], 0)  # a router counts no tool-call text
    out = []
    for i in range(start, len(ids)):
        last = i == len(ids) - 1
        delta = EngineCoreOutput("r", [ids[i]], finish_reason="stop" if last else None)
        outputs, _ = proc.process([delta])
        c = choice.update(outputs[0])
        if c is not None:
            out.append(c)
    return out


def _client_view(choices: list[dict[str, Any]]) -> tuple[str, list[tuple], str | None]:
    deltas = [(c["delta"].get("content") or "", c["delta"].get("tool_calls") or [])
              for c in choices]  # fmt: skip
    return (*_collect(deltas), choices[-1]["finish_reason"] if choices else None)


def test_a_resumed_tool_stream_sends_exactly_what_the_client_misses():
    ids = [*TOK.encode(HERMES, add_special_tokens=False), TOK.eos_token_id]
    full = _run(ids, None)
    want = _client_view(full)
    assert want[0] == "Sure! " and want[2] == "tool_calls" and len(want[1]) == 2
    # the client has what the primary sent with its first k tokens, then the standby's
    for k in range(1, len(ids) - 1):
        params = SamplingParams(max_tokens=500)
        proc = OutputProcessor(TOK)
        proc.add_request("p", None, [1], params)
        primary = ChoiceState(0, TOK, params, True, tools=ToolCallStream(HermesParser(), True))
        sent = []
        for i in range(k):
            outputs, _ = proc.process([EngineCoreOutput("p", [ids[i]])])
            c = primary.update(outputs[0])
            if c is not None:
                sent.append(c)
        got = _client_view(sent + _run(ids, k))
        assert got == want, k
