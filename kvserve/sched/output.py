"""The step's data at the scheduler's doors: what one step does (``SchedulerOutput``, to
the runner), what it produced (``StepResult``, from the runner) and what the update after
it did (``StepUpdate``, to the engine's outputs, sessions and replication).

``Scheduler.schedule()`` → ``SchedulerOutput`` → the runner → ``StepResult`` →
``Scheduler.update_from_output()`` → ``StepUpdate``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.kv.swap import SwapIn, SwapOut
from kvserve.request import Request
from kvserve.store.offloader import KVLoad


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    """What one step does, as data: ``scheduled`` lists each request once with its new
    tokens (its block table is the KV manager's); the worker first drops the host copies
    of ``swap_drop``, copies the ``swap_out`` blocks to the host, then ``swap_in`` back,
    copies the ``kv_loads`` fetched from the KV store into their blocks, and then runs the
    forward pass."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    swap_out: list[SwapOut] = field(default_factory=list)
    swap_in: list[SwapIn] = field(default_factory=list)
    swap_drop: list[str] = field(default_factory=list)
    kv_loads: list[KVLoad] = field(default_factory=list)  # store blocks fetched for requests

    @property
    def has_copies(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.swap_drop or self.kv_loads)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


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
