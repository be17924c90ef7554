"""OpenAI-compatible request bodies (pydantic) and their mapping to ``SamplingParams``.

Fields follow the OpenAI API; vLLM's common extensions are accepted (``top_k``, ``min_p``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``cache_salt``, ``repetition_penalty``,
``bad_words``, ``allowed_token_ids``, structured outputs) plus kvserve's ``session_id`` and
``priority``. A field this server does not implement is a 400 naming it, never silently
ignored; ``NO_OPS`` are the fields accepted on purpose without effect (``user`` …,
documented in docs/agents.md). Booleans are strict
(``"stream": "yes"`` is a 400, as it is at OpenAI), and a string anywhere in the body that
is not valid Unicode (a lone surrogate) is a 400 naming its path, before any field is read.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator
from pydantic_core import PydanticCustomError

from kvserve.model.tokenizer import Tokenizer
from kvserve.sampling import SamplingParams, StructuredSpec
from kvserve.server.errors import INVALID_TEXT, invalid_text_path
from kvserve.server.structured import StructuredFields
from kvserve.server.tools import prompt as tool_prompt
from kvserve.server.tools.spec import ToolChoice, ToolDef

# accepted and without effect: who the end user is, OpenAI's stored-completions options
NO_OPS = ("user", "store", "metadata")


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class ValidText(BaseModel):
    """A body any of whose strings that is not valid Unicode (a lone surrogate) is a 400
    naming its path, before any field is read."""

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        path = invalid_text_path(data)
        if path is not None:
            raise PydanticCustomError("invalid_text", f"{path}: {INVALID_TEXT}", {"path": path})
        return data


class _Common(StructuredFields, ValidText):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: StrictBool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    cache_salt: str | None = None
    return_token_ids: StrictBool = False  # token ids of the prompt and of each choice / delta
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float = Field(1.0, gt=0.0)
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    # kvserve extensions
    session_id: str | None = Field(None, max_length=256)
    priority: int = 0
    # accepted no-ops (NO_OPS)
    user: str | None = None
    store: StrictBool | None = None
    metadata: dict[str, str] | None = None

    def _bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        try:
            return {int(t): b for t, b in self.logit_bias.items()}
        except ValueError:
            raise ValueError("logit_bias: keys must be token ids") from None

    def _sampling(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        structured: StructuredSpec | None = None,
        skip_special_tokens: bool | None = None,
    ) -> SamplingParams:
        """The sampling parameters; raises ValueError naming the field."""
        own = self.structured_spec()
        if structured is not None and own is not None:
            raise ValueError("tool_choice: a required or named tool cannot be combined with "
                             "another structured-output constraint")  # fmt: skip
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=(
                self.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
            ),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self._bias(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            structured=structured or own,
        )


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: StrictBool = False

    def sampling_params(self) -> SamplingParams:
        return self._sampling(self.max_tokens, self.logprobs)

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as text or token-id lists; raises ValueError when empty."""
        p = self.prompt
        if isinstance(p, str):
            out: list[str | list[int]] = [p]
        elif not p:
            raise ValueError("prompt is empty")
        elif isinstance(p[0], int):
            out = [list(p)]  # type: ignore[arg-type]
        else:
            out = list(p)  # type: ignore[arg-type]
        if any(len(x) == 0 for x in out):
            raise ValueError("prompt is empty")
        return out


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str


class ToolCall(BaseModel):
    """An assistant's earlier tool call, in the history."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    refusal: str | None = None  # assistant: rendered as its text when content is empty

    def text(self) -> str:
        """The message text; content parts must be ``{"type": "text", "text": ...}``."""
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)

    def for_template(self, takes_tools: bool) -> dict[str, Any]:
        """This message as a chat template's input (``tools.prompt`` says how)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        calls = [c.model_dump() for c in self.tool_calls or []]
        if calls and takes_tools:
            for c in calls:
                c["function"]["arguments"] = tool_prompt.arguments_object(
                    c["function"]["arguments"]
                )
            out["tool_calls"] = calls
        elif calls:
            for c in calls:
                c["function"]["arguments"] = tool_prompt.arguments_object(
                    c["function"]["arguments"]
                )
            out["content"] += tool_prompt.written_calls(calls)
        if self.tool_call_id is not None and takes_tools:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: StrictBool = True
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool = True

    def sampling_params(
        self, structured: StructuredSpec | None = None, skip_special_tokens: bool | None = None
    ) -> SamplingParams:
        """``structured``: a tool choice's constraint; ``skip_special_tokens``: a tool
        parser's need of special tokens in the text. Raises ValueError."""
        max_tokens = self.max_completion_tokens or self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, logprobs, structured, skip_special_tokens)

    @property
    def tools_in_prompt(self) -> bool:
        """Are tools offered to the model (given, and ``tool_choice`` is not ``none``)?"""
        return bool(self.tools) and self.tool_choice != "none"

    def conversation(self, template: str | None = None) -> list[dict[str, Any]]:
        """The messages as the chat template ``template`` takes them (tools.prompt)."""
        takes = tool_prompt.takes_tools(template)
        messages = [m.for_template(takes) for m in self.messages]
        if self.tools_in_prompt and not takes:
            tool_prompt.with_tools_prompt(messages, self._tool_dicts())
        return messages

    def _tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def prompt_text(self, tok: Tokenizer) -> str:
        """The chat template rendered (with the tools when offered). Raises ValueError."""
        kwargs: dict[str, Any] = {}
        if self.tools_in_prompt and tool_prompt.takes_tools(tok.chat_template):
            kwargs["tools"] = self._tool_dicts()
        messages = self.conversation(tok.chat_template)
        return tok.apply_chat_template(messages, self.add_generation_prompt, **kwargs)

    def prompt_ids(self, tok: Tokenizer) -> list[int]:
        """The prompt token ids: ``prompt_text`` tokenized without special tokens (the
        template has them). The one definition a worker, a standby resuming the stream
        and a router placing it all use. Raises ValueError."""
        return tok.encode(self.prompt_text(tok), add_special_tokens=False)
