"""A request's structured-output fields → one ``StructuredSpec`` (or None).

Accepted, one source per request: OpenAI's ``response_format`` (``text``, ``json_object``,
``json_schema``), vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``,
``grammar``, ``json_object``) and vLLM's older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` (with ``guided_decoding_backend`` ``xgrammar`` or
``auto`` — the one engine kvserve has). ``structured_spec`` raises ``ValueError`` naming
the field for two sources at once or an empty one; whether a spec can be enforced is
``sampling.guided.check_spec``'s question.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from kvserve.sampling.params import StructuredSpec


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of the constraints."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None


class StructuredFields(BaseModel):
    """The structured-output fields both endpoints accept (mixed into their bodies)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Literal["xgrammar", "auto"] | None = None

    def structured_spec(self) -> StructuredSpec | None:
        """The one constraint these fields ask for, or None; raises ValueError."""
        return self._source[1] if self._source else None

    def structured_field(self) -> str:
        """The name of the field the constraint comes from (errors name it)."""
        return self._source[0] if self._source else "response_format"

    @functools.cached_property
    def _source(self) -> tuple[str, StructuredSpec] | None:
        """(field, constraint) of the one source given (read once: a schema is dumped
        once however often it is asked for); raises ValueError."""
        found: list[tuple[str, StructuredSpec]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredSpec("json_object")))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ValueError("response_format.json_schema.schema: a JSON schema is required")
            found.append(("response_format", _json(rf.json_schema.schema_)))
        so = self.structured_outputs
        if so is not None:
            given = [
                (name, spec)
                for name, spec in (
                    ("json", None if so.json_ is None else _json(so.json_)),
                    ("regex", _maybe("regex", so.regex)),
                    ("choice", _choice(so.choice)),
                    ("grammar", _maybe("grammar", so.grammar)),
                    ("json_object", StructuredSpec("json_object") if so.json_object else None),
                )
                if spec is not None
            ]
            if len(given) != 1:
                raise ValueError("structured_outputs: give exactly one constraint")
            found.append((f"structured_outputs.{given[0][0]}", given[0][1]))
        for name, spec in (
            ("guided_json", None if self.guided_json is None else _json(self.guided_json)),
            ("guided_regex", _maybe("regex", self.guided_regex)),
            ("guided_choice", _choice(self.guided_choice)),
            ("guided_grammar", _maybe("grammar", self.guided_grammar)),
        ):
            if spec is not None:
                found.append((name, spec))
        if len(found) > 1:
            others = ", ".join(n for n, _ in found[1:])
            raise ValueError(
                f"{found[0][0]}: also given {others}; give only one structured-output constraint"
            )
        return found[0] if found else None


def _json(schema: dict[str, Any] | str) -> StructuredSpec:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    return StructuredSpec("json", json.dumps(schema))


def _maybe(kind: Literal["regex", "grammar"], value: str | None) -> StructuredSpec | None:
    if value is None:
        return None
    if not value:
        raise ValueError(f"the {kind} is empty")
    return StructuredSpec(kind, value)


def _choice(choices: list[str] | None) -> StructuredSpec | None:
    if choices is None:
        return None
    return StructuredSpec("choice", json.dumps(choices))
