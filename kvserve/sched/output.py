"""The step's data at the scheduler's doors: what one step does (``SchedulerOutput``, to
the ranks), what it produced (``StepResult``, from rank 0) and what the update after it
did (``StepUpdate``, to the engine's outputs, sessions and replication).

``Scheduler.schedule()`` → ``SchedulerOutput`` → every rank → ``StepResult`` →
``Scheduler.update_from_output()`` → ``StepUpdate``.

``SchedulerOutput`` is plain data (ids, token ids, block ids, sampling parameters): it
names no ``Request``. Each rank keeps its own copy of every request's tokens and block
tables (``worker.requests.RankRequests``) and builds its own inputs from it, so the step
message carries deltas: a request the ranks have not seen comes whole
(``NewRequestData``), one they know comes as its new tokens and new blocks
(``CachedRequestData``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvserve.kv.swap import SwapIn, SwapOut
from kvserve.request import Request
from kvserve.sampling import SamplingParams
from kvserve.store.offloader import KVLoad


@dataclass
class NewRequestData:
    """A request the ranks do not know yet (or must take whole again): every known token
    (prompt, then output), what its sampler rows need, and its block tables (one per KV
    group)."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    eos_token_ids: tuple[int, ...]
    bad_words_ids: list[list[int]]
    block_ids: list[list[int]]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """Requests the ranks know, as parallel lists: the tokens each got since the ranks
    last saw it, the blocks appended to each group's table (None: none), and its computed
    tokens. A table that changed otherwise (a window freed a block, a preemption or a swap
    gave new blocks) comes whole in ``tables``."""

    request_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[list[list[int]] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    tables: dict[str, list[list[int]]] = field(default_factory=dict)


@dataclass
class SchedulerOutput:
    """What one step does, as data. ``num_scheduled_tokens``: each scheduled request's
    new tokens, in batch order; the ranks first forget ``finished_ids``, take
    ``new_requests`` and the ``cached`` deltas, then drop the host copies of
    ``swap_drop``, copy the ``swap_out`` blocks to the host, then ``swap_in`` back, copy
    the ``kv_loads`` fetched from the KV store into their blocks, and run the forward pass
    (``grammar_masks``: the packed allowed tokens of each sampled request with a grammar).
    ``preempted``: the requests this step sent back to the waiting queue."""

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached: CachedRequestData = field(default_factory=CachedRequestData)
    finished_ids: list[str] = field(default_factory=list)
    grammar_masks: dict[str, torch.Tensor] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    swap_out: list[SwapOut] = field(default_factory=list)
    swap_in: list[SwapIn] = field(default_factory=list)
    swap_drop: list[str] = field(default_factory=list)
    kv_loads: list[KVLoad] = field(default_factory=list)  # store blocks fetched for requests

    @property
    def for_ranks(self) -> bool:
        """Whether the ranks have anything to do: tokens to compute, copies to make or
        requests to forget."""
        return bool(
            self.num_scheduled_tokens
            or self.finished_ids
            or self.swap_out
            or self.swap_in
            or self.swap_drop
            or self.kv_loads
        )

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    def computed(self) -> dict[str, int]:
        """Each scheduled request's computed tokens before this step."""
        done = {r.request_id: r.num_computed_tokens for r in self.new_requests}
        done.update(zip(self.cached.request_ids, self.cached.num_computed_tokens, strict=True))
        return done


@dataclass
class StepResult:
    """Sampled tokens (and optional logprobs) keyed by request id."""

    tokens: dict[str, int]
    logprobs: dict[str, dict]
    prompt_logprobs: dict[str, list[dict]] = field(default_factory=dict)


@dataclass(frozen=True)
class TokenAppended:
    """``request`` got ``token`` (``logprobs`` when it asked for them); ``first``: its
    first output token. The request may have finished with it (``request.is_finished``)."""

    request: Request
    token: int
    logprobs: dict | None
    first: bool


@dataclass
class StepUpdate:
    """What the update after a step did beyond moving the scheduled requests on:
    ``appended``, one event per sampled token, in batch order."""

    appended: list[TokenAppended] = field(default_factory=list)


# the KV store's saves of a step's newly full blocks (the engine's, run by the update
# after the blocks are cached and before a window or a finish frees any)
BlocksFull = Callable[[list[Request]], None]
