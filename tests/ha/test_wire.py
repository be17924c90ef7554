"""The router↔worker resume body: one typed definition, encoded by the router and decoded
(and checked) by the worker."""

from __future__ import annotations

import msgspec
import pytest

from kvserve.ha.wire import ResumeBody, decode_resume


def test_the_router_s_body_decodes_to_the_same_struct():
    body = ResumeBody(
        session_id="s", request={"prompt": "x"}, kind="responses", delivered_token_ids=[1, 2],
        delivered_text_chars=3, seen_epoch=4, response_id="resp_1", created_at=5,
    )  # fmt: skip
    assert decode_resume(msgspec.json.encode(msgspec.to_builtins(body))) == body
    minimal = decode_resume(b'{"session_id": "s", "request": {}}')
    assert (minimal.kind, minimal.delivered_token_ids, minimal.seen_epoch) == (
        "completion",
        [],
        None,
    )


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b'{"request": {}}', "session_id"),
        (
            b'{"session_id": "s", "request": {}, "delivered_token_ids": ["x"]}',
            "delivered_token_ids",
        ),
        (b'{"session_id": "s", "request": {}, "kind": "embedding"}', "kind"),
        (b'{"session_id": "s", "request": {}, "surprise": 1}', "surprise"),
        (b'{"session_id": "s", "request": {}, "kind": "responses"}', "response_id"),
        (b'{"session_id": "s", "request": {}, "delivered_text_chars": -1}', "delivered_text_chars"),
        (b"not json", "not JSON"),
    ],
)
def test_a_bad_body_is_refused_saying_what_is_wrong(raw, says):
    with pytest.raises(ValueError, match=says):
        decode_resume(raw)
