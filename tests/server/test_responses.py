"""The Responses API on a real server with the official client: create, stream (events in
OpenAI's order), retrieve, delete, input items; a 3-turn chain through
``previous_response_id`` whose later turns restore the conversation's KV (from the
prefix cache and, after a reset, from the KV store tier); tenants cannot read each
other's responses; tools, ``function_call_output`` and ``text.format``; fields kvserve
does not implement are 400s naming them; expiry and the per-tenant limit free the KV."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import jsonschema
import openai
import pytest
from agent_server import BUNDLED, FLAGS, MODEL, tenants_file

from kvserve.testing.procs import running_server, wait_until

ACME, BETA, ADMIN = "sk-acme", "sk-beta", "sk-admin"
STORE = ("--kv-store", "host://?capacity=64MiB")
LONG = "Paris is the capital of France and its largest city. " * 12
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses")
    tenants = tenants_file(tmp / "tenants.json", {"acme": ACME, "beta": BETA})
    args = (*FLAGS, *STORE, "--tenants", str(tenants), "--admin-key", ADMIN)
    with running_server(BUNDLED, *args, log=tmp / "s.log") as s:
        yield s


def _client(server, key: str = ACME) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def _create(c: openai.OpenAI, **kw):
    body = {"model": MODEL, "max_output_tokens": 12, "temperature": 0}
    body.update(kw)
    return c.responses.create(**body)


def _http(server, method: str, path: str, body: dict | None = None, key: str = ACME):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(server.url + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_create_retrieve_input_items_delete(server):
    c = _client(server)
    r = _create(c, input="Hello there", instructions="Be brief.", metadata={"k": "v"})
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete") and r.model == MODEL
    assert r.instructions == "Be brief." and r.metadata == {"k": "v"}
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    got = c.responses.retrieve(r.id)
    assert got.output_text == r.output_text and got.usage == r.usage
    items = c.responses.input_items.list(r.id)
    assert [i.type for i in items.data] == ["message"]
    assert items.data[0].role == "user" and items.data[0].content[0].text == "Hello there"
    assert server.metric("kvserve_responses_stored_bytes") > 0
    # pages: the SDK's auto-pager asks again with ``after``
    many = _create(c, input=[{"role": "user", "content": f"part {i}"} for i in range(3)])
    pages = c.responses.input_items.list(many.id, limit=2, order="asc")
    assert [i.content[0].text for i in pages] == ["part 0", "part 1", "part 2"]
    status, out = _http(server, "GET", f"/v1/responses/{many.id}?stream=true")
    assert status == 400 and out["error"]["param"] == "stream"
    deleted = c.responses.delete(r.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    for call in (lambda: c.responses.retrieve(r.id), lambda: c.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError):
            call()


def test_stream_events_follow_openai_order(server):
    c = _client(server)
    kinds, seqs, deltas, final = [], [], [], None
    for ev in _create(c, input="Tell me a story", stream=True, max_output_tokens=16):
        kinds.append(ev.type)
        seqs.append(ev.sequence_number)
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert seqs == list(range(len(seqs)))
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    n = len(deltas)
    assert kinds[4 : 4 + n] == ["response.output_text.delta"] * n
    assert kinds[4 + n :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete" if final.status == "incomplete" else "response.completed",
    ]
    assert final.usage.output_tokens > 0
    assert "".join(deltas) == final.output_text == c.responses.retrieve(final.id).output_text
    whole = _create(c, input="Tell me a story", max_output_tokens=16)
    assert whole.output_text == final.output_text  # greedy: the same text either way


def test_three_turn_chain_restores_the_conversation_kv(server):
    c = _client(server)
    r1 = _create(c, input=LONG, instructions="You answer questions.")
    r2 = _create(
        c, input="And Berlin?", previous_response_id=r1.id, instructions="You answer questions."
    )
    assert r2.previous_response_id == r1.id
    assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
    cached = r2.usage.input_tokens_details.cached_tokens
    assert cached >= 0.8 * r2.usage.input_tokens, r2.usage
    # the device prefix cache emptied: turn 3 restores turn 2 from the KV store tier
    status, _ = _http(server, "POST", "/admin/reset_prefix_cache", {}, key=ADMIN)
    assert status == 200
    r3 = _create(
        c, input="And Rome?", previous_response_id=r2.id, instructions="You answer questions."
    )
    cached = r3.usage.input_tokens_details.cached_tokens
    assert cached >= 0.8 * r3.usage.input_tokens, r3.usage
    # the chain is one session: its record holds the newest turn
    status, session = _http(server, "GET", f"/v1/sessions/{r3.id[:29]}")
    assert status == 200 and session["num_tokens"] == r3.usage.total_tokens


def test_another_tenant_gets_404s(server):
    acme, beta = _client(server), _client(server, BETA)
    r = _create(acme, input="a secret")
    with pytest.raises(openai.NotFoundError):
        beta.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        beta.responses.input_items.list(r.id)
    with pytest.raises(openai.NotFoundError):
        beta.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        _create(beta, input="more", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    assert acme.responses.retrieve(r.id).output_text == r.output_text


def test_store_false_keeps_nothing(server):
    c = _client(server)
    r = _create(c, input="forget me", store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)


def test_tools_and_function_call_output(server):
    c = _client(server)
    r = _create(
        c,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and r.status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    r2 = _create(
        c,
        previous_response_id=r.id,
        tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
    )
    assert r2.output[0].type == "message"
    cached = r2.usage.input_tokens_details.cached_tokens
    assert cached >= 0.8 * r2.usage.input_tokens, r2.usage
    items = c.responses.input_items.list(r2.id)
    assert [i.type for i in items.data] == ["function_call_output"]
    # a named function, streamed: the argument deltas add up to the call's arguments
    args, done = [], None
    for ev in _create(
        c,
        input="Weather in Rome?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=200,
        stream=True,
    ):
        if ev.type == "response.function_call_arguments.delta":
            args.append(ev.delta)
        if ev.type == "response.function_call_arguments.done":
            done = ev.arguments
    assert done is not None and "".join(args) == done
    jsonschema.validate(json.loads(done), WEATHER["parameters"])


def test_text_format_json_schema(server):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    r = _create(
        _client(server),
        input="A number, as JSON",
        text={"format": {"type": "json_schema", "name": "num", "schema": schema}},
        max_output_tokens=64,
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, None),
        ({"truncation": "auto"}, "truncation"),
        ({"background": True}, "background"),
        ({"text": {"format": {"type": "json_schema", "schema": {"not": {}}}}}, "text.format"),
        ({"input": ""}, "input"),
    ],
)
def test_unsupported_fields_are_400s_naming_them(server, extra, param):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **extra}
    status, out = _http(server, "POST", "/v1/responses", body)
    assert status == 400, out
    assert out["error"]["type"] == "BadRequestError"
    if param is not None:
        assert out["error"]["param"] == param, out


def test_expiry_and_the_tenant_limit_free_the_kv(tmp_path):
    args = (*FLAGS, *STORE, "--responses-ttl", "8", "--responses-max-per-tenant", "2")
    with running_server(BUNDLED, *args, log=tmp_path / "s.log") as s:
        c = _client(s, "x")
        first, second, third = (_create(c, input=f"turn {i} " + LONG) for i in range(3))
        with pytest.raises(openai.NotFoundError):  # the tenant's oldest made room
            c.responses.retrieve(first.id)
        assert s.metric("kvserve_responses_removed_total", 'reason="evicted"') == 1
        session = f"/v1/sessions/{third.id[:29]}"
        assert _http(s, "GET", session, key="x")[0] == 200
        assert c.responses.retrieve(third.id).id == third.id

        def gone() -> bool:
            return _http(s, "GET", f"/v1/responses/{third.id}", key="x")[0] == 404

        wait_until(gone, 60, "the response expired")
        assert _http(s, "GET", session, key="x")[0] == 404  # its KV went with it
        assert _http(s, "GET", f"/v1/responses/{second.id}", key="x")[0] == 404
        assert s.metric("kvserve_responses_stored") == 0
