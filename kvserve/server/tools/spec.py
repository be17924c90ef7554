"""A chat request's tools and ``tool_choice`` → one ``ToolPlan``.

``plan_tools`` decides, before any token, how a request uses its tools: which parser
reads calls out of the output, and for ``required`` or a named function the JSON schema
that constrains decoding so the output always parses (``required``: an array of
``{"name", "parameters"}`` objects, one of them when ``parallel_tool_calls`` is false; a
named function: its arguments object). It raises ``ValueError`` (a 400 naming the field)
for a choice that names no tool, a tool schema structured outputs cannot enforce, or a
``tool_choice`` without tools.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from kvserve.sampling.params import StructuredSpec
from kvserve.sampling.schema_check import unsupported_keyword
from kvserve.server.tools.parsers import JsonArrayParser, NamedParser, ToolParser


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses its tools. ``parser`` None: tool calls are not read (no tools,
    or ``tool_choice`` ``none``); ``structured``: the constraint ``required`` or a named
    function puts on the output; ``parallel``: more than one call may be returned."""

    parser: ToolParser | None
    structured: StructuredSpec | None
    parallel: bool
    in_prompt: bool  # the tools are rendered into the prompt


def _parameters(tool: ToolDef) -> dict[str, Any]:
    schema = tool.function.parameters or {"type": "object", "properties": {}}
    problem = unsupported_keyword(schema)
    if problem is not None:
        raise ValueError(f"tools: function {tool.function.name!r}: {problem}")
    return schema


def plan_tools(
    tools: list[ToolDef] | None,
    choice: ToolChoice | None,
    parallel: bool,
    auto_parser: ToolParser,
) -> ToolPlan:
    """The plan for ``tools`` and ``choice`` (``auto`` reads calls with ``auto_parser``);
    raises ValueError."""
    if not tools:
        if choice is not None and choice != "none":
            raise ValueError("tool_choice: only allowed when tools are given")
        return ToolPlan(None, None, parallel, False)
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError("tools: function names must be unique")
    choice = "auto" if choice is None else choice
    if choice == "none":
        return ToolPlan(None, None, parallel, False)
    if choice == "auto":
        for t in tools:
            _parameters(t)
        return ToolPlan(auto_parser, None, parallel, True)
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            raise ValueError(f"tool_choice: no tool is named {choice.function.name!r}")
        spec = StructuredSpec("json", json.dumps(_parameters(named[0])))
        return ToolPlan(NamedParser(choice.function.name), spec, False, True)
    defs: dict[str, Any] = {}
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "parameters": _hoist_defs(_parameters(t), t.function.name, defs),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if defs:
        array["$defs"] = defs
    if not parallel:
        array["maxItems"] = 1
    return ToolPlan(JsonArrayParser(), StructuredSpec("json", json.dumps(array)), parallel, True)


def _hoist_defs(schema: dict[str, Any], tool: str, defs: dict[str, Any]) -> dict[str, Any]:
    """``schema`` nested under the array of calls: its ``$defs``/``definitions`` move to
    the root's ``$defs`` as ``<tool>.<name>`` and its local ``$ref``s follow them."""
    local = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    if not local:
        return schema
    renamed = {f"#/{kind}/{name}": f"#/$defs/{tool}.{name}"
               for kind in ("$defs", "definitions") for name in local}  # fmt: skip

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                k: renamed.get(v, v) if k == "$ref" and isinstance(v, str) else rewrite(v)
                for k, v in node.items()
            }
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for name, sub in local.items():
        defs[f"{tool}.{name}"] = rewrite(sub)
    return rewrite({k: v for k, v in schema.items() if k not in ("$defs", "definitions")})
