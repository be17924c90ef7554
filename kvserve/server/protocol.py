"""OpenAI-compatible request bodies (pydantic) and their mapping to ``SamplingParams``.

Fields follow the OpenAI API; vLLM's common extensions are accepted (``top_k``, ``min_p``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``cache_salt``) plus kvserve's
``session_id`` and ``priority``. Unknown fields are ignored, as OpenAI clients send
options this server does not implement (penalties, ``user`` …). Booleans are strict
(``"stream": "yes"`` is a 400, as it is at OpenAI), and a string anywhere in the body that
is not valid Unicode (a lone surrogate) is a 400 naming its path, before any field is read.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator
from pydantic_core import PydanticCustomError

from kvserve.model.tokenizer import Tokenizer
from kvserve.sampling import SamplingParams
from kvserve.server.errors import INVALID_TEXT, invalid_text_path


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        path = invalid_text_path(data)
        if path is not None:
            raise PydanticCustomError("invalid_text", f"{path}: {INVALID_TEXT}", {"path": path})
        return data

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
    # kvserve extensions
    session_id: str | None = Field(None, max_length=256)
    priority: int = 0

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
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
            skip_special_tokens=self.skip_special_tokens,
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message text; content parts must be ``{"type": "text", "text": ...}``."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: StrictBool = True

    def sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens
        return self._sampling(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def prompt_ids(self, tok: Tokenizer) -> list[int]:
        """The prompt token ids: the chat template rendered, then tokenized without
        special tokens (the template has them). The one definition a worker, a standby
        resuming the stream and a router placing it all use. Raises ValueError."""
        text = tok.apply_chat_template(self.conversation(), self.add_generation_prompt)
        return tok.encode(text, add_special_tokens=False)
