"""Request bodies a server and a router must both refuse with the same 400 (issue 17)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

# (path, raw body, the error's param): raw bytes, so lone surrogates travel as JSON escapes
BAD_BODIES: list[tuple[str, bytes, str | None]] = [
    ("/v1/completions", rb'{"prompt": "a\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", rb'{"prompt": ["ok", "a\udfffb"], "max_tokens": 2}', "prompt.1"),
    (
        "/v1/chat/completions",
        rb'{"messages": [{"role": "user", "content": "a\ud800b"}], "stream": true}',
        "messages.0.content",
    ),
    ("/v1/completions", rb'{"model": "\ud800", "prompt": "x"}', "model"),
    ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', "stream"),
    ("/v1/completions", b'{"prompt": "x", "stream": 1}', "stream"),
    ("/v1/completions", b'{"prompt": "x", "echo": "true"}', "echo"),
    ("/v1/completions", b'{"prompt": "x", "min_tokens": 5, "max_tokens": 2}', None),
    ("/v1/completions", b'{"prompt": "\xff\xfe x"}', None),
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"[1, 2]", None),
    # fields a router sets itself: a wrong type must still reach the worker (issue 46)
    ("/v1/completions", b'{"prompt": "x", "return_token_ids": "yes"}', "return_token_ids"),
    ("/v1/completions", b'{"prompt": "x", "session_id": 123}', "session_id"),
]


def post_raw(url: str, body: bytes, key: str | None = None) -> tuple[int, dict]:
    """POST ``body`` as JSON; returns (status, parsed JSON body)."""
    req = urllib.request.Request(url, data=body, method="POST")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
