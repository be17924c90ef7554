"""Continuous batching with a per-step token budget, chunked prefill and recompute preemption.

Each step the scheduler hands every running request its next tokens (one for a decode, a
chunk for an unfinished prefill) while the token budget lasts, then admits waiting
requests in arrival order, each starting after the longest prefix the KV manager already
holds (prefix caching; a recomputed preempted request finds its own freed blocks there).
A running request whose blocks cannot be allocated preempts the most recently arrived
running request (possibly itself): its blocks are freed and it goes back to the front of
the queue to be recomputed (prompt + generated tokens).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvserve.config import SchedulerConfig
from kvserve.kv.manager import KVCacheManager
from kvserve.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    """The batch for one step; ``scheduled`` lists each request once."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting and running queues; mutates request status and KV blocks."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req, n) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
            i += 1
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            cached = self.kv.find_cached_prefix(req)
            computed = req.num_computed_tokens + len(cached) * self.kv.block_size
            remaining = req.num_tokens - computed
            if not self.config.enable_chunked_prefill and remaining > budget:
                break
            n = min(remaining, budget)
            if self.kv.allocate_slots(req, n, cached) is None:
                break
            if cached:
                req.num_computed_tokens = computed
                if req.num_preemptions == 0:
                    req.num_cached_tokens = computed
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
        return out

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mark ``req`` finished with ``status``, free its blocks, drop it from the queues."""
        req.status = status
        self.kv.free(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
