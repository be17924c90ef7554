"""The router's reading of a request's prompt: token ids, computed as a worker computes
them, with the tokenizer of each fingerprint the candidate workers registered
(``tokenizers.Tokenizers``: ``--tokenizer``'s or one taken from a worker).

``read`` never fails: a body the router cannot read (invalid, several prompts, no
tokenizer for any candidate yet) gets no token ids for the fingerprints concerned and is
placed by load; the worker answers it as it would anyway (a bad body is the worker's
400, worded once). Long prompts are tokenized off the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError

from kvserve.model.tokenizer import Tokenizer
from kvserve.router.scoring import PromptInfo
from kvserve.router.tokenizers import Tokenizers
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.server.responses.protocol import ResponsesRequest

_INLINE_CHARS = 8192  # longer prompts are tokenized off the event loop


class PromptReader:
    def __init__(self, tokenizers: Tokenizers):
        self.tokenizers = tokenizers

    async def read(self, kind: str, body: dict[str, Any], fps: Iterable[str | None]) -> PromptInfo:
        """The prompt's token ids for each fingerprint in ``fps`` the router has a
        tokenizer for (``kind``: ``chat``, ``completion`` or ``responses``), and its
        ``cache_salt``."""
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) else None
        toks = {fp: t for fp in set(fps) if fp and (t := self.tokenizers.get(fp)) is not None}
        if not toks:
            return PromptInfo({}, salt)
        size = len(str(body.get("messages") or body.get("prompt") or ""))
        if size * len(toks) > _INLINE_CHARS:
            ids = await asyncio.to_thread(_all_ids, kind, body, toks)
        else:
            ids = _all_ids(kind, body, toks)
        return PromptInfo(ids, salt)


def _all_ids(kind: str, body: dict[str, Any], toks: dict[str, Tokenizer]) -> dict[str, list[int]]:
    """fingerprint → prompt ids, for the tokenizers that can read the body."""
    try:
        req: ChatCompletionRequest | CompletionRequest
        if kind == "chat":
            req = ChatCompletionRequest.model_validate(body)
        elif kind == "responses":  # a new conversation (a continuation goes to its holder)
            if body.get("previous_response_id") is not None:
                return {}
            req = ResponsesRequest.model_validate(body).chat([])
        else:
            req = CompletionRequest.model_validate(body)
            if len(req.prompts()) != 1:
                return {}
    except (ValidationError, ValueError, TypeError):
        return {}
    out: dict[str, list[int]] = {}
    for fp, tok in toks.items():
        try:
            ids = _ids(req, tok)
        except (ValueError, TypeError):  # this tokenizer cannot (no chat template, say)
            continue
        out[fp] = ids
    return out


def _ids(req: ChatCompletionRequest | CompletionRequest, tok: Tokenizer) -> list[int]:
    if isinstance(req, ChatCompletionRequest):
        return req.prompt_ids(tok)
    p = req.prompts()[0]
    return tok.encode(p) if isinstance(p, str) else list(p)
