"""``ResponseEvents``: chat deltas → Responses items and events in OpenAI's order — one
item open at a time, argument text of an open call before text that follows it in the
same update, each call closed before the next one is added, ids that a continuing
worker derives the same way."""

from __future__ import annotations

from kvserve.server.responses.protocol import ResponsesRequest
from kvserve.server.responses.render import ResponseEvents

BODY = ResponsesRequest(input="hi")


def _call(k: int, name: str | None = None, args: str = "", first: bool = False) -> dict:
    delta: dict = {"index": k, "function": {"arguments": args}}
    if first:
        delta |= {"id": f"call_{k}", "type": "function"}
        delta["function"]["name"] = name
    return delta


def _kinds(events: list[dict]) -> list[str]:
    return [e["type"].removeprefix("response.") for e in events]


def test_calls_and_text_open_and_close_in_generation_order():
    out = ResponseEvents("resp_x", "m", BODY)
    ev = out.start()
    ev += out.feed({"delta": {"content": "Let me check."}})
    ev += out.feed({"delta": {"tool_calls": [_call(0, "a", first=True), _call(0, args='{"x"')]}})
    # the call's last argument text and the text after it arrive in one update
    ev += out.feed({"delta": {"content": " Then", "tool_calls": [_call(0, args=": 1}")]}})
    ev += out.feed({"delta": {"tool_calls": [_call(1, "b", first=True), _call(1, args="{}")]}})
    ev += out.finish("tool_calls", {"input_tokens": 1})
    assert _kinds(ev) == [
        "created", "in_progress",
        "output_item.added", "content_part.added", "output_text.delta",
        "output_text.done", "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta",
        "function_call_arguments.delta",
        "function_call_arguments.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta",
        "output_text.done", "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta",
        "function_call_arguments.done", "output_item.done",
        "completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in ev] == list(range(len(ev)))
    final = ev[-1]["response"]
    assert [i["type"] for i in final["output"]] == [
        "message", "function_call", "message", "function_call"
    ]  # fmt: skip
    assert final["output"][1]["arguments"] == '{"x": 1}'  # nothing dropped
    assert final["output"][2]["content"][0]["text"] == " Then"
    # a continuing worker names the items the same way
    again = ResponseEvents("resp_x", "m", BODY)
    again.feed({"delta": {"content": "Let me check."}})
    again.feed({"delta": {"tool_calls": [_call(0, "a", first=True)]}})
    assert [i["id"] for i in again.items] == [i["id"] for i in final["output"][:2]]
    assert again.call_id(0) == out.call_id(0) != out.call_id(1)


def test_an_empty_answer_is_an_empty_message_and_length_is_incomplete():
    out = ResponseEvents("resp_y", "m", BODY)
    ev = out.finish("length", {"input_tokens": 1})
    assert _kinds(ev)[-1] == "incomplete"
    final = ev[-1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["content"][0]["text"] == ""
    failed = ResponseEvents("resp_z", "m", BODY).finish(None, {}, "engine gone")
    assert failed[-1]["type"] == "response.failed"
    assert failed[-1]["response"]["error"]["message"] == "engine gone"
