"""The body of ``POST /v1/responses`` (pydantic) and its mapping onto a chat request.

A Responses request is rendered as a chat conversation: ``instructions`` as a system
message, then the stored history of ``previous_response_id`` (without its instructions:
OpenAI does not carry them over), then this request's ``input`` items — messages,
``function_call`` items (an assistant's earlier calls) and ``function_call_output``
items (tool results). ``tools`` (function tools), ``tool_choice`` and ``text.format``
become the chat request's tools and ``response_format``, so prompts, sampling, tool
parsing and structured outputs are the chat endpoint's own.

A field this server does not implement is a 400 naming it (``extra="forbid"``): hosted
tools (``web_search`` …), ``reasoning``, ``background: true``, ``include``, ``truncation:
"auto"``, image and file inputs, ``item_reference`` items. ``user`` is accepted without
effect; ``metadata`` is stored and returned.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator
from pydantic_core import PydanticCustomError

from kvserve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    ToolCall,
    ValidText,
)
from kvserve.server.structured import JsonSchemaFormat, ResponseFormat
from kvserve.server.tools.spec import FunctionDef, NamedFunction, NamedToolChoice, ToolDef

ITEM_TYPES = ("message", "function_call", "function_call_output")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ContentPart(_Strict):
    """Text of a message: ``input_text`` (user, system), ``output_text`` (assistant)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # output_text (what a client echoes back)
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    """An assistant's earlier tool call, sent back by a client that keeps its history."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    """A tool's result for the call ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    """``text.format``: plain text, any JSON object, or JSON matching ``schema``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only one a model without it has


class ResponsesRequest(_Strict, ValidText):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = Field(None, max_length=128)
    store: StrictBool = True
    stream: StrictBool = False
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool = True
    text: TextConfig | None = None
    truncation: Literal["disabled"] | None = None
    background: Literal[False] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None  # accepted without effect, as on the chat endpoint
    # vLLM / kvserve extensions
    seed: int | None = Field(None, ge=0, lt=2**63)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    stop: str | list[str] | None = None
    priority: int = 0
    cache_salt: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, value: Any) -> Any:
        """Items of a type this server does not take are refused by name."""
        if isinstance(value, list):
            for i, item in enumerate(value):
                kind = item.get("type", "message") if isinstance(item, dict) else None
                if isinstance(kind, str) and kind not in ITEM_TYPES:
                    path = f"input[{i}].type"
                    raise PydanticCustomError(
                        "unsupported_item",
                        f"{path}: items of type {kind!r} are not supported "
                        f"(supported: {', '.join(ITEM_TYPES)})",
                        {"path": path},
                    )
        if value == "" or value == []:
            raise PydanticCustomError("empty_input", "input: must not be empty", {"path": "input"})
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        """Hosted tools (web search, file search, MCP …) are refused by name."""
        if isinstance(value, list):
            for i, tool in enumerate(value):
                kind = tool.get("type") if isinstance(tool, dict) else None
                if isinstance(kind, str) and kind != "function":
                    path = f"tools[{i}].type"
                    raise PydanticCustomError(
                        "unsupported_tool",
                        f"{path}: {kind!r} tools are not supported; only function tools are",
                        {"path": path},
                    )
        return value

    def items(self) -> list[InputItem]:
        """``input`` as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def chat(self, history: list[ChatMessage]) -> ChatCompletionRequest:
        """This request as a chat request over ``history`` (the previous response's
        conversation, or []). Raises ValueError naming a field."""
        messages: list[ChatMessage] = []
        if self.instructions:
            messages.append(ChatMessage(role="system", content=self.instructions))
        messages += history
        messages += input_messages(self.items())
        tools = [
            ToolDef(
                type="function",
                function=FunctionDef(
                    name=t.name,
                    description=t.description,
                    parameters=t.parameters,
                    strict=t.strict,
                ),
            )
            for t in self.tools or []
        ]
        choice: Any = self.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
        return ChatCompletionRequest(
            messages=messages,
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            repetition_penalty=self.repetition_penalty,
            tools=tools or None,
            tool_choice=choice,
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=self._response_format(),
            cache_salt=self.cache_salt,
            priority=self.priority,
        )

    def _response_format(self) -> ResponseFormat | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return ResponseFormat(type="json_object")
        if fmt.schema_ is None:
            raise ValueError("text.format.schema: a JSON schema is required")
        return ResponseFormat(
            type="json_schema",
            json_schema=JsonSchemaFormat(
                name=fmt.name or "response",
                description=fmt.description,
                schema=fmt.schema_,
                strict=fmt.strict,
            ),
        )


def input_messages(items: list[InputItem]) -> list[ChatMessage]:
    """Input items as chat messages: ``function_call`` items join the assistant message
    before them (its text, then its calls), or make one of their own; a
    ``function_call_output`` is a tool message answering its call."""
    out: list[ChatMessage] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append(ChatMessage(role=item.role, content=item.text()))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(
                id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
            )
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":  # its text, then its calls
                out[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or []), call]})
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        else:
            out.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
    return out
