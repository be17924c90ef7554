"""Sampling parameters of one request, named as in vLLM and the OpenAI API.

``SamplingParams`` validates itself at construction (``ValueError`` naming the field) and
travels as plain data: msgpack to the engine core, JSON in a session record, so a standby
resuming a stream samples with exactly the primary's options. ``StructuredSpec`` is the one
typed description of a constrained output (JSON schema, regex, choice, grammar); the grammar
engine compiles it in the engine core (``sampling.guided``), never the raw request body.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

_GREEDY_EPS = 1e-5
_MASK64 = (1 << 64) - 1

StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class StructuredSpec:
    """A constrained output. ``spec`` is, by ``kind``: ``json`` a JSON schema (JSON text),
    ``json_object`` unused (any JSON object), ``regex`` a regular expression, ``choice`` a
    JSON list of the allowed strings, ``grammar`` an EBNF grammar (GBNF, as llama.cpp and
    xgrammar write it)."""

    kind: StructuredKind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("json", "json_object", "regex", "choice", "grammar"):
            raise ValueError(f"unknown structured output kind {self.kind!r}")
        if self.kind == "choice":
            choices = json.loads(self.spec)
            if (
                not isinstance(choices, list)
                or not choices
                or not all(isinstance(c, str) and c for c in choices)
            ):
                raise ValueError("choice must be a non-empty list of non-empty strings")


@dataclass
class SamplingParams:
    """Per-request sampling options, named as in vLLM / the OpenAI API.

    ``temperature`` 0 means greedy. ``top_k`` 0 or -1 disables top-k. ``seed`` None gets a
    random seed when the request is created (kept with the request, so preemption and
    failover reproduce the same tokens). ``logprobs`` N returns the sampled token's
    log-probability plus the top N, computed from the logits after the logits processors
    below (bias, penalties, masks) and before temperature; ``prompt_logprobs`` N does the
    same for every prompt token after the first from the raw logits (it disables
    prefix-cache hits for the request, since cached positions are not recomputed).

    Logits processors, applied in this order to every sampled row (greedy too), each a
    function of the request's own tokens only, so batch invariance holds:
    ``allowed_token_ids`` (every other token forbidden), ``bad_words`` (a word's last token
    is forbidden where the output ends with the rest of it), ``min_tokens`` (EOS and
    ``stop_token_ids`` forbidden until then), ``logit_bias`` (added; -100 forbids, +100
    forces), the ``structured`` output's grammar mask, then OpenAI's ``presence_penalty`` and
    ``frequency_penalty`` (over the output tokens) and vLLM's ``repetition_penalty`` (over
    prompt and output: positive logits divided by it, negative ones multiplied).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured: StructuredSpec | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop_strings = tuple(stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(not 0 <= t < 2**31 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be token ids (integers in [0, 2**31))")
        self._check_processors()

    def _check_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0**31:
            raise ValueError(
                f"repetition_penalty must be positive (1 disables it), got "
                f"{self.repetition_penalty}"
            )
        if self.logit_bias is not None:
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            for t, b in self.logit_bias.items():
                if not 0 <= t < 2**31:
                    raise ValueError(f"logit_bias: {t} is not a token id")
                if not -100.0 <= b <= 100.0:
                    raise ValueError(f"logit_bias: the bias of token {t} must be in [-100, 100]")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
            if not self.allowed_token_ids or any(
                not 0 <= t < 2**31 for t in self.allowed_token_ids
            ):
                raise ValueError("allowed_token_ids must be a non-empty list of token ids")
        if self.bad_words is not None and any(not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def penalized(self) -> bool:
        """Does any penalty need the request's token history?"""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass
class SampleRow:
    """What the sampler needs to know about one row of the logits.

    ``suppress``: token ids forbidden here (EOS under ``min_tokens``, bad words' last
    tokens). ``mask``: the structured output's allowed tokens as a packed bitmask (int32,
    bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed), or None. ``output_ids`` /
    ``prompt_ids``: the request's tokens so far, only when a penalty needs them.
    """

    params: SamplingParams
    seed: int
    position: int  # index in the sequence of the token being sampled
    suppress: tuple[int, ...] = ()
    mask: torch.Tensor | None = None
    output_ids: list[int] | None = None
    prompt_ids: list[int] | None = None


@dataclass(frozen=True)
class Logprob:
    """Log-probability of one token, its rank (1 = most likely) and decoded text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


def child_seed(seed: int | None, index: int) -> int | None:
    """Seed of output ``index`` of an ``n > 1`` request: the request's own seed for the
    first, a derived one for the others (None stays None: random seeds)."""
    return None if seed is None or index == 0 else position_seed(seed, -1 - index)


def position_seed(seed: int, position: int) -> int:
    """Mix (seed, position) into a 63-bit generator seed (splitmix64 finalizer)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)
