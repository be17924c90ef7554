"""Request state machine and the user-facing output types.

States: WAITING → RUNNING → (PREEMPTED | SWAPPED → RUNNING …) → FINISHED_*.
A request's token list is prompt + generated tokens; ``num_computed_tokens`` counts how
many of them have K/V in the cache. Preemption by recompute resets it to 0; by swap it is kept.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.sampling import Logprob, SamplingParams

if TYPE_CHECKING:
    from kvserve.sampling.guided import Guide

logger = logging.getLogger("kvserve")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; recomputed when resumed
    SWAPPED = "swapped"  # blocks copied to the host swap space; copied back when resumed
    LOADING = "loading"  # its prefix is being loaded from the KV store into its blocks
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


@dataclass
class Request:
    """One sequence being generated. The engine owns and mutates it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    max_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    prompt: str | None = None
    cache_salt: str | None = None  # isolates this request's prefix-cache blocks
    tenant: str = "default"
    priority: int = 0  # larger = more important (used by the tenant pool's preemption)
    session_id: str | None = None  # the conversation this turn belongs to
    session_ephemeral: bool = False  # a router-made id for one request: forget it at the end
    standby: str | None = None  # the node a router chose to continue this session if needed
    # a resumed stream (failover) recomputes what it must the way its primary computed it:
    # the prompt after the first ``restore_limit`` tokens (None: no limit) in one prefill
    # chunk, then each known output token in a one-token (decode) step
    replay: bool = False
    restore_limit: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    num_preemptions: int = 0
    stop_reason: int | None = None  # the stop token id that ended it (None: EOS/length)
    # the structured output's grammar matcher (engine core only, rebuilt on a resume)
    guide: Guide | None = field(default=None, repr=False)
    bad_words_ids: list[list[int]] = field(default_factory=list)  # params.bad_words tokenized

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output, without copying the whole list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def stop_status(self, token: int, max_model_len: int) -> RequestStatus | None:
        """The finished state that ``token`` (just appended) puts the request in, or None:
        stopped by a stop token id (recorded in ``stop_reason``) or EOS once ``min_tokens``
        are out; length at ``max_tokens`` or the context limit. Stop strings are checked on
        the text by the client. A request with a grammar moves its matcher past ``token``
        and stops once the grammar is complete and took a stop token."""
        p = self.params
        n_out = len(self.output_token_ids)
        if self.guide is not None:  # (a refused token cannot happen: the mask allowed it)
            if not self.guide.advance(token):
                logger.error("request %s: token %d breaks its grammar", self.request_id, token)
            if self.guide.terminated:
                return RequestStatus.FINISHED_STOPPED
        if n_out >= p.min_tokens:
            if token in p.stop_token_ids:
                self.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not p.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if n_out >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


@dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM-compatible field names)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass
class RequestOutput:
    """A request's prompt and its outputs; ``finished`` once every output has stopped."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
