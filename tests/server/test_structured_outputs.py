"""Structured outputs against a real server with the official client: every output of a
property test over generated JSON schemas validates (``jsonschema``), pydantic models
parse through ``chat.completions.parse``, regex / choice / grammar outputs match, and what
cannot be enforced is a 400 naming the field before any token."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from agent_server import BUNDLED, FLAGS, MODEL, chat_body, client, post
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from kvserve.testing.procs import running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(BUNDLED, *FLAGS, log=tmp_path_factory.mktemp("so") / "s.log") as s:
        yield s


_NAMES = st.text(alphabet="abcdefgh", min_size=1, max_size=5)
LEAVES = st.one_of(
    st.just({"type": "integer", "minimum": -50, "maximum": 50}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.integers(1, 8).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.text(alphabet="abxyz ", min_size=1, max_size=4), min_size=1, max_size=4,
             unique=True).map(lambda v: {"enum": v}),
    st.sampled_from(
        [{"type": "string", "pattern": "^[a-z]{2,5}$"},
         {"type": "string", "pattern": "^[0-9]{3}-[0-9]{2}$"}]
    ),
)


def _nested(children: st.SearchStrategy) -> st.SearchStrategy:
    objects = st.dictionaries(_NAMES, children, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props),
                       "additionalProperties": False}
    )
    arrays = st.builds(
        lambda item, n: {"type": "array", "items": item, "minItems": 1, "maxItems": n},
        children,
        st.integers(1, 3),
    )
    return st.one_of(objects, arrays, st.lists(children, min_size=2, max_size=3).map(
        lambda cs: {"anyOf": cs}))  # fmt: skip


SCHEMAS = st.recursive(LEAVES, _nested, max_leaves=6).map(
    lambda s: {"type": "object", "properties": {"v": s}, "required": ["v"],
               "additionalProperties": False}
)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=SCHEMAS, seed=st.integers(0, 2**31))
def test_every_output_validates_against_its_generated_schema(server, schema, seed):
    r = client(server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Answer in JSON."}],
        max_tokens=400,
        temperature=1.0,
        seed=seed,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "t", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


class City(BaseModel):
    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=10**7)
    coastal: bool
    districts: list[str] = Field(max_length=3)


def test_parse_with_a_pydantic_model_and_json_object(server):
    c = client(server)
    for seed in range(3):
        r = c.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": "A city, please."}],
            response_format=City, max_tokens=300, temperature=1.0, seed=seed,
        )  # fmt: skip
        assert isinstance(r.choices[0].message.parsed, City)
        r = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "JSON"}], max_tokens=200,
            response_format={"type": "json_object"}, seed=seed,
            extra_body={"min_tokens": 2, "frequency_penalty": 1.0},
        )  # fmt: skip
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:  # an unbounded object may outgrow max_tokens; what there is starts one
            assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_regex_choice_and_grammar_outputs_match(server, stream):
    c = client(server)
    cases = [
        ({"structured_outputs": {"regex": r"[a-z]{2,6}-[0-9]{2}"}},
         lambda t: re.fullmatch(r"[a-z]{2,6}-[0-9]{2}", t)),
        ({"guided_regex": r"(yes|no), [0-9]+"}, lambda t: re.fullmatch(r"(yes|no), [0-9]+", t)),
        ({"structured_outputs": {"choice": ["red", "green", "blue"]}},
         lambda t: t in ("red", "green", "blue")),
        ({"guided_choice": ["pos itive", "négatif"]}, lambda t: t in ("pos itive", "négatif")),
        ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]? " ok"'}},
         lambda t: re.fullmatch(r"x[0-9]{1,2} ok", t)),
    ]  # fmt: skip
    for extra, ok in cases:
        for seed in range(2):
            kw = dict(model=MODEL, messages=[{"role": "user", "content": "?"}], max_tokens=40,
                      temperature=1.0, seed=seed, extra_body=extra)  # fmt: skip
            if stream:
                chunks = c.chat.completions.create(stream=True, **kw)
                text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            else:
                text = c.chat.completions.create(**kw).choices[0].message.content
            assert ok(text), (extra, text)
    # the completions endpoint takes the same fields
    r = c.completions.create(model=MODEL, prompt="x = ", max_tokens=20,
                             extra_body={"guided_regex": r"[0-9]{4}"})  # fmt: skip
    assert re.fullmatch(r"[0-9]{4}", r.choices[0].text)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "not": {"type": "string"}}}}},
         "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema"),
        ({"guided_regex": "(["}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}},
         "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}},
         "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
         "response_format"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ],
)  # fmt: skip
def test_what_cannot_be_enforced_is_a_400_naming_the_field(server, extra, param):
    status, err = post(server, "/v1/chat/completions", chat_body(**extra))
    assert status == 400, err
    assert err["error"]["param"] == param, err


def test_n_choices_each_follow_the_schema(server):
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b", "c"]},
              "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["k", "n"], "additionalProperties": False}  # fmt: skip
    r = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "?"}], n=4, seed=5,
        temperature=1.0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
    )  # fmt: skip
    assert len(r.choices) == 4
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), schema)
