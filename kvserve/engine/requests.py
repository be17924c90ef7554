"""Input processing of the engine core: a prompt and its options → a validated ``Request``.

``RequestFactory.build`` raises ``EngineError`` — saying what to change — for anything the
engine could never serve: an empty prompt, a token outside the vocabulary, a context
longer than ``max_model_len``, more KV blocks than the cache or the tenant's limit holds.
It changes nothing (the request is not queued).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvserve.errors import EngineError
from kvserve.kv.manager import KVCacheManager
from kvserve.model.tokenizer import PromptTooLong, Tokenizer
from kvserve.request import Request
from kvserve.sampling import SamplingParams
from kvserve.sampling.guided import Grammars


def context_length_error(num_prompt: int, max_tokens: int, max_model_len: int) -> str | None:
    """Why a prompt of ``num_prompt`` tokens plus ``max_tokens`` cannot fit the context,
    or None when it fits."""
    if num_prompt + max_tokens <= max_model_len:
        return None
    return (
        f"this model's maximum context length is {max_model_len} tokens; the request has "
        f"{num_prompt} prompt tokens + max_tokens {max_tokens} = {num_prompt + max_tokens}"
    )


def encode_prompt(
    tokenizer: Tokenizer | None,
    model: str,
    max_model_len: int,
    text: str,
    params: SamplingParams | None = None,
) -> list[int]:
    """A text prompt's token ids, on the client's side of the engine core; with
    ``params``, raises EngineError (before building all the ids) when the prompt cannot
    fit the context with its ``max_tokens``. Raises EngineError without a tokenizer."""
    if tokenizer is None:
        raise EngineError(f"{model} has no tokenizer.json; pass prompt token ids")
    limit = max_model_len
    if params is not None and params.max_tokens is not None:
        limit -= params.max_tokens
    try:
        return tokenizer.encode(text, max_tokens=max(limit, 0) if params else None)
    except PromptTooLong as e:
        assert params is not None
        error = context_length_error(e.num_tokens, params.max_tokens or 0, max_model_len)
        raise EngineError(error or str(e)) from None


class RequestFactory:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        model: str,
        vocab_size: int,
        max_model_len: int,
        kv: KVCacheManager,
        eos_token_ids: tuple[int, ...],
        tenant_isolation: bool,
        rng: random.Random,
    ):
        self.tokenizer = tokenizer
        self.model = model
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv = kv
        self.eos_token_ids = eos_token_ids
        self.tenant_isolation = tenant_isolation
        self.rng = rng
        self._grammars: Grammars | None = None  # built by the first structured request

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise EngineError(f"{self.model} has no tokenizer.json; pass prompt token ids")
        return self.tokenizer.encode(prompt)

    def salt(self, tenant: str, cache_salt: str | None) -> str | None:
        """The prefix-cache salt of a request: its ``cache_salt``, and its tenant with
        ``prefix_cache_isolation`` ``tenant``."""
        parts = []
        if self.tenant_isolation:
            parts.append(f"tenant={tenant}")
        if cache_salt is not None:
            parts.append(f"salt={cache_salt}")
        return "|".join(parts) or None

    def build(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        seed: int | None,
        tenant: str,
        salt: str | None,
        priority: int,
    ) -> Request:
        """A validated request (not queued); raises EngineError."""
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise EngineError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        room = self.max_model_len - len(ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        error = context_length_error(len(ids), max_tokens, self.max_model_len)
        if error is not None:
            raise EngineError(error)
        need = self.kv.blocks_needed(len(ids) + max_tokens)
        if not self.kv.can_ever_fit(len(ids) + max_tokens):
            raise EngineError(
                f"the request needs {need} KV blocks, the whole cache has {self.kv.num_blocks}"
            )
        tenant_limit = self.kv.ledger.limit(tenant)
        if need > tenant_limit:
            raise EngineError(
                f"the request needs {need} KV blocks ({len(ids)} prompt tokens + max_tokens "
                f"{max_tokens}), more than tenant {tenant!r}'s limit of {tenant_limit} blocks"
            )
        req_seed = seed if seed is not None else params.seed
        if req_seed is None:
            req_seed = self.rng.getrandbits(63)
        req = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            seed=req_seed,
            max_tokens=max_tokens,
            eos_token_ids=self.eos_token_ids,
            prompt=text,
            cache_salt=salt,
            tenant=tenant,
            priority=priority,
        )
        self._add_processors(req)
        return req

    def _add_processors(self, req: Request) -> None:
        """The request's grammar matcher and tokenized bad words; raises EngineError."""
        p = req.params
        bad = [t for t in (p.allowed_token_ids or []) + list(p.logit_bias or {})
               if t >= self.vocab_size]  # fmt: skip
        if bad:
            raise EngineError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if p.bad_words:
            req.bad_words_ids = self._bad_words_ids(p.bad_words)
        if p.structured is not None:
            try:
                req.guide = self.grammars().guide(p.structured)
            except ValueError as e:
                raise EngineError(str(e)) from None

    def grammars(self) -> Grammars:
        """The grammar compiler of this model's vocabulary (built on first use, ~1 s)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise EngineError(f"{self.model} has no tokenizer.json: no structured outputs")
            vocab = self.tokenizer.vocab_bytes()
            self._grammars = Grammars(vocab, self.vocab_size, list(self.eos_token_ids))
        return self._grammars

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's token ids, as written and after a space (how it is tokenized
        inside a text), without duplicates."""
        if self.tokenizer is None:
            raise EngineError(f"{self.model} has no tokenizer.json: bad_words needs one")
        out: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def check_delivered(self, req: Request, delivered: Sequence[int]) -> list[int]:
        """The output tokens a client already has of a resumed stream; raises EngineError
        for ids outside the vocabulary or as many as ``max_tokens``."""
        ids = [int(t) for t in delivered]
        if any(not 0 <= t < self.vocab_size for t in ids) or len(ids) >= req.max_tokens:
            raise EngineError("delivered tokens outside the vocabulary or past max_tokens")
        if req.guide is not None and not all(req.guide.advance(t) for t in ids):
            raise EngineError("the delivered tokens do not follow the request's grammar")
        return ids
