"""The OpenAI schema's required fields in every response kind, the usage details, and the
request side: each field kvserve does not implement is a 400 naming it, the documented
no-ops are accepted, and logit_bias / penalties act as OpenAI documents."""

from __future__ import annotations

import json
import urllib.request

import pytest
from agent_server import BUNDLED, FLAGS, MODEL, chat_body, client, post

from kvserve.server.protocol import NO_OPS
from kvserve.testing.procs import running_server

# the "required" lists of OpenAI's OpenAPI schema for each object
REQUIRED = {
    "chat.completion": ["id", "object", "created", "model", "choices"],
    "chat.choice": ["index", "message", "finish_reason", "logprobs"],
    "chat.message": ["role", "content", "refusal"],
    "chat.completion.chunk": ["id", "object", "created", "model", "choices"],
    "chunk.choice": ["index", "delta", "finish_reason"],
    "text_completion": ["id", "object", "created", "model", "choices"],
    "completion.choice": ["index", "text", "finish_reason", "logprobs"],
    "usage": ["prompt_tokens", "completion_tokens", "total_tokens"],
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(BUNDLED, *FLAGS, log=tmp_path_factory.mktemp("conf") / "s.log") as s:
        yield s


def _has(obj: dict, kind: str) -> None:
    missing = [k for k in REQUIRED[kind] if k not in obj]
    assert not missing, f"{kind} lacks {missing}: {obj}"


def _sse(server, path: str, body: dict) -> list[dict]:
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        lines = r.read().decode().splitlines()
    return [json.loads(x[6:]) for x in lines if x.startswith("data: {")]


def test_every_response_kind_has_the_schemas_required_fields(server):
    status, r = post(server, "/v1/chat/completions", chat_body(max_tokens=4))
    assert status == 200
    _has(r, "chat.completion")
    _has(r["choices"][0], "chat.choice")
    _has(r["choices"][0]["message"], "chat.message")
    _has(r["usage"], "usage")
    assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    # a long prompt twice: its blocks come from the prefix cache, and usage says so
    long = [{"role": "user", "content": "import os, sys\n" * 40}]
    post(server, "/v1/chat/completions", chat_body(max_tokens=2, messages=long))
    _, again = post(server, "/v1/chat/completions", chat_body(max_tokens=2, messages=long))
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    chunks = _sse(server, "/v1/chat/completions",
                  chat_body(max_tokens=4, stream=True, stream_options={"include_usage": True}))
    for c in chunks:
        _has(c, "chat.completion.chunk")
        for ch in c["choices"]:
            _has(ch, "chunk.choice")
    _has(chunks[-1]["usage"], "usage")
    assert "cached_tokens" in chunks[-1]["usage"]["prompt_tokens_details"]
    status, r = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3})
    _has(r, "text_completion")
    _has(r["choices"][0], "completion.choice")
    _has(r["usage"], "usage")
    assert "cached_tokens" in r["usage"]["prompt_tokens_details"]


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/v1/chat/completions", "reasoning_effort"),
        ("/v1/chat/completions", "audio"),
        ("/v1/chat/completions", "prediction"),
        ("/v1/chat/completions", "web_search_options"),
        ("/v1/completions", "suffix"),
        ("/v1/completions", "best_of"),
        ("/v1/completions", "tools"),
    ],
)
def test_unimplemented_fields_are_400s_naming_them(server, path, field):
    body = chat_body() if "chat" in path else {"model": MODEL, "prompt": "x"}
    status, err = post(server, path, {**body, field: "x"})
    assert status == 400
    assert err["error"]["param"] == field and field in err["error"]["message"]
    # nested too: an unknown key in a message
    bad = chat_body(messages=[{"role": "user", "content": "hi", "colour": "red"}])
    status, err = post(server, "/v1/chat/completions", bad)
    assert status == 400 and err["error"]["param"] == "messages.0.colour"


def test_the_documented_no_ops_are_accepted(server):
    assert set(NO_OPS) == {"user", "store", "metadata"}
    c = client(server)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                  max_tokens=3, user="u-1", store=False, metadata={"k": "v"})
    assert r.choices[0].message.role == "assistant"
    r = c.completions.create(model=MODEL, prompt="x", max_tokens=3, user="u-1")
    assert r.choices[0].text is not None


def test_logit_bias_and_penalties_through_the_api(server):
    c = client(server)
    base = c.completions.create(model=MODEL, prompt="def f(x):", max_tokens=12, temperature=0,
                                extra_body={"return_token_ids": True})
    ids = base.choices[0].model_extra["token_ids"]
    banned = {str(t): -100 for t in set(ids)}
    r = c.completions.create(model=MODEL, prompt="def f(x):", max_tokens=12, temperature=0,
                             logit_bias=banned, extra_body={"return_token_ids": True})
    assert not set(r.choices[0].model_extra["token_ids"]) & set(ids)
    for seed in range(3):
        r = c.completions.create(model=MODEL, prompt="def f(x):", max_tokens=6, seed=seed,
                                 logit_bias={"42": 100}, extra_body={"return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == [42] * 6
    # penalties spread a greedy continuation over more distinct tokens
    plain = len(set(ids))
    r = c.completions.create(model=MODEL, prompt="def f(x):", max_tokens=12, temperature=0,
                             frequency_penalty=2.0, presence_penalty=2.0,
                             extra_body={"return_token_ids": True, "repetition_penalty": 1.5})
    assert len(set(r.choices[0].model_extra["token_ids"])) >= plain
    status, err = post(server, "/v1/completions", {"model": MODEL, "prompt": "x",
                                                   "logit_bias": {"99999999": 5}})
    assert status == 400 and "vocabulary" in err["error"]["message"]
