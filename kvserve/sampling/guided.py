"""Structured outputs in the engine core: a ``StructuredSpec`` → a compiled grammar → one
``Guide`` (a grammar matcher) per request.

The grammar engine is xgrammar (the one vLLM, SGLang and TensorRT-LLM use). Contract:

- ``check_spec(spec)`` (API server, before the request is queued) raises ``ValueError``
  naming what cannot be enforced: an invalid schema, regex or grammar, or a JSON-schema
  keyword outside ``schema_check.ENFORCED``. It needs no tokenizer.
- ``Grammars.guide(spec)`` (engine core) compiles once per distinct spec (cached) and
  returns a fresh ``Guide``; raises ``ValueError`` like ``check_spec``.
- JSON is generated without free whitespace (``", "`` and ``": "`` between items): a
  small model given room for whitespace can spend every token on it.
- ``Guide.mask()`` is the packed int32 bitmask of the tokens allowed next (the sampler's
  ``SampleRow.mask``); ``Guide.advance(token)`` moves the matcher past a sampled (or, on a
  resume, a delivered) token and returns False when the grammar refuses it. Once
  ``terminated`` (the grammar complete and a stop token accepted) the request is done.
  The matcher only ever sees the request's own tokens, so a guide rebuilt from a stream's
  delivered tokens (failover) is in the primary's state.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from typing import Any

import torch

from kvserve.sampling.params import StructuredSpec
from kvserve.sampling.schema_check import unsupported_keyword

logger = logging.getLogger("kvserve")
_ANY_OBJECT = json.dumps({"type": "object"})


@functools.cache
def _xgr() -> Any:
    import xgrammar  # imported on first use: a second or so, only for structured outputs

    return xgrammar


def _schema_text(spec: StructuredSpec) -> str:
    try:
        schema = json.loads(spec.spec)
    except ValueError as e:
        raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    problem = unsupported_keyword(schema)
    if problem is not None:
        raise ValueError(problem)
    return spec.spec


def _ebnf_choice(spec: StructuredSpec) -> str:
    choices = json.loads(spec.spec)
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def check_spec(spec: StructuredSpec) -> None:
    """Raise ValueError (saying what to change) when ``spec`` cannot be enforced."""
    xgr = _xgr()
    try:
        if spec.kind == "json":
            xgr.Grammar.from_json_schema(_schema_text(spec))
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.spec)
        elif spec.kind == "grammar":
            xgr.Grammar.from_ebnf(spec.spec)
        elif spec.kind == "choice":
            xgr.Grammar.from_ebnf(_ebnf_choice(spec))
    except ValueError:
        raise
    except Exception as e:  # xgrammar reports bad input as RuntimeError
        raise ValueError(f"invalid {spec.kind}: {_short(e)}") from None


def _short(e: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(e).strip()
    if text.startswith("[") and "]" in text:
        text = text.split("]", 1)[1].strip()
        if ": " in text and ".cc:" in text.split(": ", 1)[0]:
            text = text.split(": ", 1)[1]
    return text.splitlines()[0] if text else type(e).__name__


class Guide:
    """One request's grammar matcher (engine core thread only)."""

    def __init__(self, matcher: Any, vocab_size: int):
        self._m = matcher
        self._bitmask = _xgr().allocate_token_bitmask(1, vocab_size)

    def mask(self) -> torch.Tensor:
        """The tokens allowed next, packed (a new tensor: the caller may keep it)."""
        self._m.fill_next_token_bitmask(self._bitmask)
        return self._bitmask[0].clone()

    def advance(self, token: int) -> bool:
        """Accept ``token``; False (and no change) when the grammar refuses it."""
        return bool(self._m.accept_token(token))

    @property
    def terminated(self) -> bool:
        return bool(self._m.is_terminated())


class Grammars:
    """Compiles specs for one tokenizer (cached per spec) and hands out guides."""

    def __init__(self, vocab: list[bytes], vocab_size: int, stop_token_ids: list[int]):
        xgr = _xgr()
        info = xgr.TokenizerInfo(
            vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        self.vocab_size = vocab_size
        self._compiled: dict[StructuredSpec, Any] = {}

    def _compile(self, spec: StructuredSpec) -> Any:
        c = self._compiler
        start = time.perf_counter()
        try:
            if spec.kind == "json":
                out = c.compile_json_schema(_schema_text(spec), any_whitespace=False)
            elif spec.kind == "json_object":
                out = c.compile_json_schema(_ANY_OBJECT, any_whitespace=False, strict_mode=False)
            elif spec.kind == "regex":
                out = c.compile_regex(spec.spec)
            elif spec.kind == "choice":
                out = c.compile_grammar(_ebnf_choice(spec))
            else:
                out = c.compile_grammar(spec.spec)
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(f"invalid {spec.kind}: {_short(e)}") from None
        ms = 1e3 * (time.perf_counter() - start)
        logger.debug("compiled a %s grammar in %.1f ms", spec.kind, ms)
        return out

    def guide(self, spec: StructuredSpec) -> Guide:
        """A fresh matcher for ``spec``; raises ValueError when it cannot be enforced."""
        compiled = self._compiled.get(spec)
        if compiled is None:
            compiled = self._compiled[spec] = self._compile(spec)
            if len(self._compiled) > 256:  # bounded: forget the oldest spec
                self._compiled.pop(next(iter(self._compiled)))
        return Guide(_xgr().GrammarMatcher(compiled), self.vocab_size)
