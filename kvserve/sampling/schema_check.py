"""Which JSON-schema keywords structured outputs enforce, checked before any token.

The grammar engine turns a schema into a grammar; a keyword it cannot turn into one would
be silently ignored, and the output could then break the schema. ``unsupported_keyword``
walks a schema and names the first keyword outside ``ENFORCED`` and ``ANNOTATIONS``, so the
server refuses the request with a 400 instead (OpenAI's strict mode refuses such schemas
too). ``oneOf`` is enforced as ``anyOf`` (exact for discriminated unions, whose branches
exclude each other: what pydantic and zod emit).
"""

from __future__ import annotations

from typing import Any

ENFORCED = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "items", "prefixItems",
        "minItems", "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs",
        "definitions", "pattern", "minLength", "maxLength", "format", "minimum", "maximum",
        "exclusiveMinimum", "exclusiveMaximum", "nullable",
    }
)  # fmt: skip
ANNOTATIONS = frozenset(
    {
        "title", "description", "default", "examples", "$schema", "$id", "$comment",
        "deprecated", "readOnly", "writeOnly", "discriminator", "strict",
    }
)  # fmt: skip
FORMATS = frozenset(
    {"date", "time", "date-time", "duration", "email", "uuid", "uri", "ipv4", "ipv6",
     "hostname"}
)  # fmt: skip
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONES = ("items", "additionalProperties")


def unsupported_keyword(schema: Any, path: str = "") -> str | None:
    """A message naming the first keyword (with its path) that structured outputs cannot
    enforce in ``schema``, or None when every keyword is enforced or an annotation."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{path or 'schema'}: a JSON schema must be an object or a boolean"
    for key, value in schema.items():
        where = f"{path}.{key}" if path else key
        if key not in ENFORCED and key not in ANNOTATIONS:
            if key == "uniqueItems" and value is False:
                continue
            return f"the JSON-schema keyword '{key}' (at {where}) is not supported"
        if key == "format" and value not in FORMATS:
            return f"the JSON-schema format {value!r} (at {where}) is not supported"
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            return f"'allOf' with more than one schema (at {where}) is not supported"
        found = _children(key, value, where)
        if found is not None:
            return found
    return None


def _children(key: str, value: Any, where: str) -> str | None:
    if key in _SCHEMA_MAPS and isinstance(value, dict):
        for name, sub in value.items():
            found = unsupported_keyword(sub, f"{where}.{name}")
            if found is not None:
                return found
    elif key in _SCHEMA_LISTS and isinstance(value, list):
        for i, sub in enumerate(value):
            found = unsupported_keyword(sub, f"{where}.{i}")
            if found is not None:
                return found
    elif key in _SCHEMA_ONES and isinstance(value, dict | bool):
        return unsupported_keyword(value, where)
    return None
