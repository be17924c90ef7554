"""The router's reading of a request's prompt: token ids, computed as a worker computes
them (``--tokenizer``: the model's directory), for prefix-aware placement.

A body the router cannot read (invalid, several prompts, no tokenizer) gets
``PromptInfo(None)``: it is placed by load and the worker answers it as it would anyway
(a bad body is the worker's 400, worded once).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvserve.model.tokenizer import Tokenizer, load_tokenizer
from kvserve.router.scoring import PromptInfo
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest

_INLINE_CHARS = 8192  # longer prompts are tokenized off the event loop


class PromptReader:
    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer

    @classmethod
    def from_path(cls, path: str | None) -> PromptReader:
        """The reader for ``--tokenizer PATH`` (a model directory, or the directory of a
        ``tokenizer.json``); no tokenizer without a path. Raises ValueError when the
        path has no tokenizer."""
        if path is None:
            return cls(None)
        p = Path(path)
        tok = load_tokenizer(p.parent if p.is_file() else p)
        if tok is None:
            raise ValueError(f"--tokenizer {path}: no tokenizer.json there")
        return cls(tok)

    @property
    def fingerprint(self) -> str | None:
        return self.tokenizer.fingerprint if self.tokenizer is not None else None

    async def read(self, kind: str, body: dict[str, Any]) -> PromptInfo:
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) else None
        if self.tokenizer is None:
            return PromptInfo(None, salt)
        try:
            size = len(str(body.get("messages") or body.get("prompt") or ""))
            if size > _INLINE_CHARS:
                ids = await asyncio.to_thread(self._ids, kind, body)
            else:
                ids = self._ids(kind, body)
        except (ValidationError, ValueError, TypeError):
            ids = None
        return PromptInfo(ids, salt)

    def _ids(self, kind: str, body: dict[str, Any]) -> list[int] | None:
        tok = self.tokenizer
        assert tok is not None
        if kind == "chat":
            return ChatCompletionRequest.model_validate(body).prompt_ids(tok)
        prompts = CompletionRequest.model_validate(body).prompts()
        if len(prompts) != 1:
            return None
        p = prompts[0]
        return tok.encode(p) if isinstance(p, str) else list(p)
