"""Tool calling on /v1/chat/completions with the official client against a real server:
``required`` and a named function are enforced by constrained decoding (the output always
parses, even on the bundled 6.8 M model), ``auto`` reads the Hermes format, streamed
deltas add up to the non-streamed message, and a tool result continues the conversation."""

from __future__ import annotations

import json

import jsonschema
import pytest
from agent_server import BUNDLED, FLAGS, MODEL, chat_body, client, post

from kvserve.testing.procs import running_server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(BUNDLED, *FLAGS, log=tmp_path_factory.mktemp("tools") / "s.log") as s:
        yield s


def _valid_calls(calls) -> list[tuple[str, dict]]:
    out = []
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        out.append((c.function.name, args))
    return out


def _streamed(stream) -> tuple[str, list[dict], str | None]:
    """Content, calls (id, name, arguments) and finish reason of a streamed choice."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or []:
            if d.index not in calls:  # the first delta of a call names it
                assert d.id and d.type == "function" and d.function.name
                assert d.function.arguments == ""
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and not d.function.name
            calls[d.index]["arguments"] += d.function.arguments or ""
        finish = ch.finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


@pytest.mark.parametrize("seed", range(6))
def test_required_always_gives_valid_calls_streamed_as_whole(server, seed):
    """(One call per reply: allowed several, the bundled model keeps adding calls until
    max_tokens, which ends any reply unparsed.)"""
    c = client(server)
    kw = dict(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required",
              max_tokens=200, temperature=1.0, seed=seed, parallel_tool_calls=False)  # fmt: skip
    r = c.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.refusal is None
    assert len(_valid_calls(choice.message.tool_calls)) == 1
    content, streamed, finish = _streamed(c.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls" and content == ""
    want = [(t.function.name, t.function.arguments) for t in choice.message.tool_calls]
    assert [(s["name"], s["arguments"]) for s in streamed] == want


def test_named_function_and_parallel_calls(server):
    c = client(server)
    for seed in range(4):
        r = c.chat.completions.create(
            model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=100, temperature=1.0,
            seed=seed, tool_choice={"type": "function", "function": {"name": "add"}},
        )  # fmt: skip
        assert r.choices[0].finish_reason == "tool_calls"
        assert [n for n, _ in _valid_calls(r.choices[0].message.tool_calls)] == ["add"]
    # parallel calls: the array's first calls are whole calls as it is generated
    stream = c.chat.completions.create(
        model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required", max_tokens=120,
        temperature=1.0, seed=1, stream=True,
    )  # fmt: skip
    _, calls, _ = _streamed(stream)
    assert len(calls) >= 2
    for call in calls[:-1]:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


HERMES = r'Let me check\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "P[a-z]{1,6}", "unit": "c"\}\}\n</tool_call>'  # noqa: E501


def test_auto_reads_the_hermes_format_streamed_and_not(server):
    """A model that writes the template's format (forced here by a regex, as a real tool
    model would write it): auto turns it into a call, with the text before it as content."""
    c = client(server)
    kw = dict(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=120, seed=3,
              extra_body={"structured_outputs": {"regex": HERMES}})  # fmt: skip
    r = c.chat.completions.create(**kw)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert m.content == "Let me check. "
    [(name, args)] = _valid_calls(m.tool_calls)
    assert name == "get_weather" and args["unit"] == "c"
    content, streamed, finish = _streamed(c.chat.completions.create(stream=True, **kw))
    assert (content, finish) == (m.content, "tool_calls")
    assert [(s["name"], s["arguments"]) for s in streamed] == [
        (m.tool_calls[0].function.name, m.tool_calls[0].function.arguments)
    ]
    # without tools the same text is plain content
    plain = c.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=120, seed=3,
        extra_body={"structured_outputs": {"regex": HERMES}},
    )  # fmt: skip
    assert plain.choices[0].message.tool_calls is None
    assert "<tool_call>" in plain.choices[0].message.content


def test_a_tool_result_continues_the_conversation(server):
    c = client(server)
    first = c.chat.completions.create(
        model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=100, seed=1,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    history = [
        *MSGS,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "21 degrees, sunny"},
    ]
    second = c.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                       max_tokens=16, seed=1)  # fmt: skip
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the tool result is in the prompt: more prompt tokens than the first turn's
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    none = c.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=8,
                                     tool_choice="none")  # fmt: skip
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "if": {}}}}], "tool_choice": "required"}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s_naming_the_field(server, body, param):
    status, err = post(server, "/v1/chat/completions", chat_body(**body))
    assert status == 400, err
    assert err["error"]["param"] == param, err
