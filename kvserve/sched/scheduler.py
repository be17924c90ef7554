"""Continuous batching under a per-step token budget, with tenants' KV budgets and
preemption by swap or recompute.

Each step:

1. Every running request gets its next tokens (one for a decode, a chunk for an unfinished
   prefill) while the token budget lasts. When its blocks cannot be allocated, a victim is
   preempted (``PreemptionPolicy``: tenants above their reservation first, then lower
   priority, then cheapest to restore) — among all running requests when the pool is
   short, among its own tenant's when the tenant is at its limit — until the allocation
   succeeds or the request itself was the victim. A victim already scheduled this step
   gives its tokens back to the budget.
2. Waiting requests are admitted in order: tenants below their reservation first, then
   higher priority (tenant, then request), then the tenant with the fewest running
   requests (fair share among equals: a flooding tenant does not push an equal one to
   the back of the queue), then earlier arrival (preempted requests keep their arrival
   time, so they come back before their tenant's later requests). A tenant at its limit or at its
   ``max_concurrent_requests`` is skipped for the step; a pool shortage or a full batch
   (``max_num_seqs``) stops admission, except that a tenant below its reservation
   preempts requests of tenants above theirs to get its blocks and its seat. In a step
   that preempted, only tenants below their reservation are admitted. A swapped request
   brought back and preempted again in the same step stays swapped: its swap-in is
   cancelled (its host copy is still there), so one step never swaps a request out twice.

New requests start after the longest prefix the KV manager already holds (prefix caching);
swapped requests get fresh blocks and their K/V copied back. The scheduler decides only:
it never touches a tensor. Copies it decides on (swap-outs of victims, swap-ins of
returning requests, dropped host copies) are lists in the ``SchedulerOutput`` the worker
executes before the step's forward pass.
"""

from __future__ import annotations

import sys
from collections import Counter

from kvserve.config import SchedulerConfig
from kvserve.kv.manager import POOL, KVCacheManager
from kvserve.kv.swap import SwapSpace
from kvserve.request import Request, RequestStatus
from kvserve.sched.cost import PreemptionCostModel
from kvserve.sched.output import (
    BlocksFull,
    SchedulerOutput,
    StepResult,
    StepUpdate,
    TokenAppended,
)
from kvserve.sched.preemption import PreemptionPolicy
from kvserve.sched.rank_view import RankView
from kvserve.store.offloader import KVLoad, KVOffloader

RESERVATION = "reservation"  # preempted so a tenant below its reservation gets its blocks

Batch = dict[str, tuple[Request, int]]  # a step's requests and their new tokens, in order


class Scheduler:
    """Owns the waiting and running queues; mutates request status and KV blocks.

    ``requests``: every unfinished request by id. ``preemptions`` counts preemptions by
    (mode, tenant, reason) with reason ``pool``, ``tenant_limit`` or ``reservation``.
    ``ranks``: what the ranks know of each request (each step's output carries deltas).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        *,
        swap: SwapSpace | None = None,
        cost: PreemptionCostModel | None = None,
        offloader: KVOffloader | None = None,
        max_model_len: int | None = None,
        window: int | None = None,
        attention_sinks: int = 0,
        on_blocks_full: BlocksFull | None = None,
    ):
        """``max_model_len``: the context limit a request stops at (None: none);
        ``window`` / ``attention_sinks``: the sliding window whose blocks the update
        frees; ``on_blocks_full``: the KV store's saves after each step (None: no store)."""
        self.config = config
        self.max_model_len = max_model_len or sys.maxsize  # None: no context limit
        self.window, self.attention_sinks = window, attention_sinks
        self.on_blocks_full = on_blocks_full
        self.kv = kv
        self.swap = swap
        self.cost = cost or PreemptionCostModel(bytes_per_token=1)
        self.policy = PreemptionPolicy(
            kv, self.cost, swap, config.preemption_mode, config.preemption_victim
        )
        self.offloader = offloader
        self._dropped: list[str] = []  # swapped requests finished since the last step
        self._pending_loads: list[KVLoad] = []  # pre-warm copies for the next step
        self.ranks = RankView(kv)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.loading: list[Request] = []  # admitted, their prefix loading from the store
        self.preemptions: Counter[tuple[str, str, str]] = Counter()

    @property
    def num_preemptions(self) -> int:
        return sum(self.preemptions.values())

    def add(self, request: Request) -> None:
        """Queue ``request`` (its id must not be in ``requests``)."""
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def pending_drops(self) -> list[str]:
        """Swapped requests finished since the last ``schedule`` (their host copies are
        dropped by the worker at the next step)."""
        return list(self._dropped)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    # ---- one step ------------------------------------------------------------------------
    def add_copies(self, load: KVLoad | None) -> None:
        """Rows to copy into device blocks before the next step runs (pre-warmed blocks:
        ``KVOffloader.place_warm``); they go with the next ``schedule()``'s output."""
        if load is not None:
            self._pending_loads.append(load)

    def schedule(self) -> SchedulerOutput:
        """The next step: which requests compute how many tokens, the copies before it,
        and the deltas the ranks need (``RankView.fill``). Changes the queues, the
        requests' states and blocks."""
        out = SchedulerOutput(swap_drop=self._dropped, kv_loads=self._pending_loads)
        self._dropped = []
        self._pending_loads = []
        scheduled: Batch = {}
        budget = self.config.max_num_batched_tokens
        if self.loading:
            self._finish_loads(out, wait=not self.running)
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            n = _chunk(req, budget)
            while self.kv.allocate_slots(req, n) is None:
                reason = self.kv.shortage or POOL
                pool = self.running
                if reason != POOL:
                    pool = [r for r in self.running if r.tenant == req.tenant]
                victim = self.policy.pick(req, pool)
                budget += self._preempt(victim, reason, out, scheduled)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                scheduled[req.request_id] = (req, n)
                budget -= n
        self._admit(out, scheduled, budget)
        self.ranks.fill(out, list(scheduled.values()))
        return out

    def _admit(self, out: SchedulerOutput, scheduled: Batch, budget: int) -> None:
        ledger = self.kv.ledger
        skip: set[str] = set()  # tenants that admit nothing more this step
        passed: set[str] = set()  # requests passed over this step
        while budget > 0:
            req = self._next_waiting(skip, passed)
            if req is None:
                return
            tenant = req.tenant
            below = ledger.usage(tenant) < ledger.reservation(tenant)
            cap = ledger.budget(tenant).max_concurrent_requests
            if (out.preempted and not below) or (
                cap is not None and sum(r.tenant == tenant for r in self.running) >= cap
            ):
                skip.add(tenant)
                continue
            remaining = req.num_tokens - req.num_computed_tokens
            if not self.config.enable_chunked_prefill and remaining > budget:
                return
            # within its reservation a tenant may take seats and blocks from tenants above
            entitled = below and ledger.usage(tenant) + self.kv.blocks_needed(
                min(req.num_tokens, req.num_computed_tokens + budget)
            ) <= ledger.reservation(tenant)
            if len(self.running) >= self.config.max_num_seqs:  # every seat is taken
                if not below:
                    return  # and the rest are not below their reservations either
                if not entitled:
                    passed.add(req.request_id)  # a smaller one of its tenant may be
                    continue
                victim = self._reservation_victim(req)
                if victim is None:
                    return  # nobody runs above their reservation
                budget += self._preempt(victim, RESERVATION, out, scheduled)
            n = self._try_admit(req, budget, out)
            if n == 0:  # its prefix is loading from the KV store
                continue
            while n is None and self.kv.shortage == POOL and entitled:
                victim = self._reservation_victim(req)
                if victim is None:
                    break
                budget += self._preempt(victim, RESERVATION, out, scheduled)
                n = self._try_admit(req, budget, out)
            if n is None:
                if below:  # too big for what the reservation covers now; smaller may fit
                    passed.add(req.request_id)
                elif self.kv.shortage != POOL:
                    skip.add(tenant)  # at its limit
                else:
                    return  # first come, first served among the rest
                continue
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = (req, n)
            budget -= n

    def _reservation_victim(self, req: Request) -> Request | None:
        """The running request that gives its seat or blocks to ``req`` (whose tenant is
        within its reservation): one of another tenant above its reservation, by the
        preemption policy's order; None when there is none."""
        ledger = self.kv.ledger
        others = [
            r for r in self.running if r.tenant != req.tenant and ledger.above_reservation(r.tenant)
        ]
        return max(others, key=self.policy.victim_key) if others else None

    def _next_waiting(self, skip: set[str], passed: set[str]) -> Request | None:
        """The waiting request to admit next (see the module docstring), or None."""
        ledger = self.kv.ledger
        seats = Counter(r.tenant for r in self.running)

        def key(r: Request) -> tuple:
            below = ledger.usage(r.tenant) < ledger.reservation(r.tenant)
            tenant_priority = -ledger.budget(r.tenant).priority
            return (not below, tenant_priority, -r.priority, seats[r.tenant], r.arrival_time)

        candidates = [
            r for r in self.waiting if r.tenant not in skip and r.request_id not in passed
        ]
        return min(candidates, key=key) if candidates else None

    def _try_admit(self, req: Request, budget: int, out: SchedulerOutput) -> int | None:
        """Allocate blocks for ``req``'s first chunk (≤ ``budget`` tokens); returns the
        chunk's size, or None (``kv.shortage`` says why)."""
        if req.status is RequestStatus.SWAPPED:
            assert self.swap is not None
            n = _chunk(req, budget)
            live = self.swap.live(req.request_id)
            shared = self.kv.shared_prefix_for_restore(req, live)
            fresh = self.kv.allocate_restored(req, live, n, shared)
            if fresh is None:
                return None
            copied = sum(live) - len(shared)
            out.swap_in.append(self.swap.release(req.request_id, fresh[:copied], len(shared)))
            return n
        cached = self.kv.find_cached_prefix(req)  # at most req.restore_limit's
        computed = req.num_computed_tokens + len(cached) * self.kv.block_size
        stored = 0
        if (
            self.offloader is not None
            and self.kv.enable_caching
            and not req.num_computed_tokens
            and req.params.prompt_logprobs is None
        ):
            stored = self.offloader.lookup(req, len(cached))
        if req.restore_limit is not None:
            stored = min(stored, max(req.restore_limit // self.kv.block_size - len(cached), 0))
        if stored:
            return self._start_load(req, cached, stored)
        n = _chunk(req, budget, computed)
        if self.kv.allocate_slots(req, n, cached) is None:
            return None
        if cached:
            req.num_computed_tokens = computed
            if req.num_preemptions == 0:
                req.num_cached_tokens = computed
        return n

    def _start_load(self, req: Request, cached: list[int], stored: int) -> int | None:
        """Take blocks for the device hits plus ``stored`` store hits and start loading
        the latter; returns 0 (nothing to compute this step) or None (no blocks)."""
        assert self.offloader is not None
        new = self.kv.allocate_slots(req, stored * self.kv.block_size, cached)
        if new is None:
            return None
        req.num_computed_tokens = len(cached) * self.kv.block_size
        self.offloader.start_load(req, len(cached), new)
        self.waiting.remove(req)
        req.status = RequestStatus.LOADING
        self.loading.append(req)
        return 0

    def _finish_loads(self, out: SchedulerOutput, wait: bool) -> None:
        """Loaded requests join the running queue with their loaded blocks computed (the
        worker copies the fetched rows in before this step runs)."""
        assert self.offloader is not None
        for req, load in self.offloader.poll(wait=wait):
            if req not in self.loading:
                continue  # aborted meanwhile
            self.loading.remove(req)
            out.kv_loads.append(load)
            n = load.rows.shape[0]
            req.num_computed_tokens += n * self.kv.block_size
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed_tokens
            self.kv.cache_full_blocks(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    def _preempt(
        self,
        req: Request,
        reason: str,
        out: SchedulerOutput,
        scheduled: Batch,
    ) -> int:
        """Swap out or free ``req``'s blocks and send it back to the waiting queue. Returns
        the tokens it gives back to this step's budget (it may already be scheduled)."""
        mode = self.policy.mode_for(req)
        table = self.kv.swap_table(req.request_id)
        null = self.kv.pool.null_block
        copy = None
        back = next((s for s in out.swap_in if s.request_id == req.request_id), None)
        if back is not None:  # swapped in earlier in this step: cancel that instead
            assert self.swap is not None
            out.swap_in.remove(back)
            self.swap.restore(req.request_id)
            mode = "swap"
        elif mode == "swap" and self.swap is not None:
            copy = self.swap.reserve(req.request_id, table, null)
        if mode == "swap" and back is None and copy is None:
            mode = "recompute"
        elif copy is not None:
            out.swap_out.append(copy)
        self.kv.free(req)
        if mode == "swap":
            req.status = RequestStatus.SWAPPED
        else:
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.preemptions[(mode, req.tenant, reason)] += 1
        self.running.remove(req)
        self.waiting.append(req)
        out.preempted.append(req.request_id)
        s = scheduled.pop(req.request_id, None)
        return 0 if s is None else s[1]

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mark ``req`` finished with ``status``, free its blocks (and swap space), drop it
        from the queues."""
        if self.swap is not None and self.swap.discard(req.request_id):
            self._dropped.append(req.request_id)  # the worker drops its copy next step
        if self.offloader is not None:
            self.offloader.forget(req)
        req.status = status
        self.requests.pop(req.request_id, None)
        self.ranks.forget(req.request_id)
        self.kv.free(req)
        for queue in (self.running, self.waiting, self.loading):
            if req in queue:
                queue.remove(req)
                break

    # ---- after a step ----------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result: StepResult) -> StepUpdate:
        """After ``out`` ran: free the swap room of the requests it swapped in
        (``SwapSpace.settle``); move each scheduled request on by its computed tokens and
        cache its full blocks; hand them to ``on_blocks_full`` (the store's saves); free
        the blocks that left their sliding window; place prompt logprobs; append each
        sampled token and finish the requests it stops (their blocks freed). Returns
        what it did, for the engine's outputs, sessions and replication."""
        if self.swap is not None:  # the step's swap-ins ran: their host copies are gone
            self.swap.settle()
        starts = []
        advanced = []
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests[rid]
            starts.append(req.num_computed_tokens)
            req.num_computed_tokens += n
            self.kv.cache_full_blocks(req)
            advanced.append(req)
        if self.on_blocks_full is not None:  # before a window or a finish frees a block
            self.on_blocks_full(advanced)
        update = StepUpdate()
        for req, start in zip(advanced, starts, strict=True):
            self.kv.free_outside_windows(req, self.window, self.attention_sinks)
            plp = result.prompt_logprobs.get(req.request_id)
            if plp is not None:  # entries for positions start+1 …; a recompute overwrites
                if not req.prompt_logprobs:
                    req.prompt_logprobs.append(None)  # the first token has no context
                req.prompt_logprobs[start + 1 : start + 1 + len(plp)] = plp
            token = result.tokens.get(req.request_id)
            if token is not None:
                update.appended.append(
                    self._append(req, token, result.logprobs.get(req.request_id))
                )
        return update

    def _append(self, req: Request, token: int, logprobs: dict | None) -> TokenAppended:
        """``token`` appended to ``req``'s output; finishes ``req`` when it stops it."""
        first = not req.output_token_ids
        req.output_token_ids.append(token)
        if logprobs is not None:
            req.output_logprobs.append(logprobs)
        status = req.stop_status(token, self.max_model_len)
        if status is not None:
            self.finish(req, status)
        return TokenAppended(req, token, logprobs, first)

    # ---- views ---------------------------------------------------------------------------
    def queue_lengths(self) -> dict[str, tuple[int, int]]:
        """(waiting, running) per tenant."""
        out: dict[str, list[int]] = {}
        for r in self.waiting:
            out.setdefault(r.tenant, [0, 0])[0] += 1
        for r in self.running:
            out.setdefault(r.tenant, [0, 0])[1] += 1
        return {t: (w, r) for t, (w, r) in out.items()}


def _chunk(req: Request, budget: int, computed: int | None = None) -> int:
    """Tokens to compute for ``req`` this step (``computed``: its computed tokens if not
    yet recorded). A replaying request (``Request.replay``) stops its prefill chunk at the
    prompt's end and then takes its known output tokens one per step, as its primary did,
    so its KV and logits come out of the same kernels."""
    done = req.num_computed_tokens if computed is None else computed
    n = min(req.num_tokens - done, budget)
    if req.replay:
        prompt = req.num_prompt_tokens
        n = min(n, prompt - done) if done < prompt else min(n, 1)
    return n
