"""LLMEngine, the engine core: requests in, per-step token deltas out.

``step()`` = schedule → execute → update (append tokens, token-level stops, sessions).
Text is the client's (``engine.output``); assembly is ``engine.builder``'s, validation
``engine.requests``'. Not thread-safe: one caller drives it (the engine-core loop or ``LLM``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from kvserve.config import EngineArgs
from kvserve.engine import kv_metrics
from kvserve.engine.builder import EngineBuilder
from kvserve.engine.messages import FINISH_ABORT, EngineCoreOutput
from kvserve.engine.parts import EngineParts
from kvserve.engine.requests import RequestFactory
from kvserve.engine.stats import EngineStats, KVStats
from kvserve.errors import EngineError
from kvserve.ha import resume
from kvserve.ha.record import SessionRecord
from kvserve.kv.tenant_ledger import Budget
from kvserve.request import Request, RequestStatus
from kvserve.sampling import SamplingParams
from kvserve.sched.cost import attention_pairs
from kvserve.sched.output import SchedulerOutput, StepResult, StepUpdate

__all__ = ["EngineError", "LLMEngine"]

logger = logging.getLogger("kvserve")


class LLMEngine(EngineParts):
    """Synchronous engine: its parts (``EngineParts``, built by ``EngineBuilder``), the
    doors for requests (their state is the scheduler's) and the step loop. Not
    thread-safe: one caller drives it."""

    def __init__(self, args: EngineArgs, cluster_secret: str | None = None):
        super().__init__(**vars(EngineBuilder(args, cluster_secret).parts()))
        self.inputs = RequestFactory(
            self.tokenizer,
            self.model_config.model,
            self.spec.vocab_size,
            self.max_model_len,
            self.kv,
            self.eos_token_ids,
            self.cache_config.prefix_cache_isolation == "tenant",
            self.rng,
        )

    @property
    def requests(self) -> dict[str, Request]:
        """Every unfinished request by id (the scheduler's; read only)."""
        return self.scheduler.requests

    def close(self) -> None:
        """Flush the KV store and replication (if any), stop the workers; the end."""
        for part in (self.replicator, self.prewarmer, self.offloader, self.runner):
            if part is not None:
                part.close()

    # ---- requests -------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.inputs.tokenize(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        seed: int | None = None,
        *,
        tenant: str = "default",
        cache_salt: str | None = None,
        priority: int = 0,
        session_id: str | None = None,
        session_epoch: int | None = None,
        ephemeral_session: bool = False,
        standby: str | None = None,
    ) -> Request:
        """Validate and queue one sequence. Raises EngineError for what can never be served.

        ``cache_salt`` restricts prefix-cache sharing to requests with the same salt (and
        tenant, with ``prefix_cache_isolation`` ``tenant``). In a cluster the session is
        claimed for this node, only if still at ``session_epoch`` when given (else it is
        fenced and aborted); an ``ephemeral_session`` (a router-made id) is released when it
        ends; ``standby`` is the node told to pre-warm the session's KV."""
        self._check_id(request_id)
        salt = self.inputs.salt(tenant, cache_salt)
        req = self.inputs.build(request_id, prompt, params, seed, tenant, salt, priority)
        req.session_id = session_id
        req.session_ephemeral = ephemeral_session and session_id is not None
        req.standby = standby
        self._queue(req, session_epoch)
        return req

    def resume_request(
        self,
        request_id: str,
        record: SessionRecord,
        delivered: Sequence[int],
        seen_epoch: int | None = None,
    ) -> Request:
        """Continue a stream another node started (failover) from its replicated
        ``record``; ``delivered`` (what the client has) become the output so far, and the
        next token is drawn with the same (seed, position). Stored KV is restored bit-exact,
        the rest recomputed as the primary computed it (prompt remainder in one chunk, each
        delivered token as a decode), so the stream goes on exactly. Takes the session over
        (conditionally on ``seen_epoch``); raises EngineError when the record does not fit
        this engine or another node took the session first."""
        self._check_id(request_id)
        r = record
        req = self.inputs.build(
            request_id, r.prompt_token_ids, r.params, r.seed, r.tenant, r.cache_salt, 0
        )
        req.output_token_ids = self.inputs.check_delivered(req, delivered)
        # recompute like the primary did (Request.replay), restoring only what stays exact
        req.replay = True
        req.restore_limit = resume.restore_limit(
            record, req.num_prompt_tokens, self.kv.block_size, self.batch_invariant
        )
        req.session_id = record.session_id
        req.session_ephemeral = record.ephemeral
        self._queue(req, seen_epoch, claim_now=True)
        return req

    def _check_id(self, request_id: str) -> None:
        if request_id in self.requests:
            raise EngineError(f"request id {request_id!r} is already in use")

    def _queue(self, req: Request, seen_epoch: int | None = None, claim_now: bool = False) -> None:
        if self.replicator is not None and req.session_id is not None:
            try:
                won = self.replicator.start(req, seen_epoch, claim_now)
            except Exception as e:  # the coordinator (Redis) is unreachable
                raise EngineError(f"cannot take session {req.session_id!r} over: {e}") from None
            if not won:
                raise EngineError(f"session {req.session_id!r} was taken over by another node")
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks at once; no-op for unknown/finished ids."""
        req = self.requests.get(request_id)
        if req is not None and not req.is_finished:
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, num_output_tokens: int) -> None:
        """A stop string ended the request after ``num_output_tokens`` output tokens (the
        client saw it in the text): drop any tokens generated past them and finish it as
        stopped — its stored session and replication end as for a stop token. No-op for
        unknown or finished ids."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return
        del req.output_token_ids[num_output_tokens:]
        del req.output_logprobs[num_output_tokens:]
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
        self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        self._after_token(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop -------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Run one batch: schedule → execute → update. Returns a delta for every request
        that got a token or finished."""
        t0 = time.perf_counter()
        outputs = self._drop_fenced()
        sched = self.scheduler.schedule()
        self._observe_usage()
        result = self._execute(sched)
        if result is not None:
            outputs += self._deltas(self.scheduler.update_from_output(sched, result))
        self.step_seconds += time.perf_counter() - t0
        return outputs

    def _execute(self, sched: SchedulerOutput) -> StepResult | None:
        """Run ``sched``'s copies and batch; its result, None when it ran no batch."""
        if not sched.for_ranks:
            return None
        t1 = time.perf_counter()
        result = self.runner.step(sched)
        self.forward_seconds += (dt := time.perf_counter() - t1)
        if sched.is_empty:
            return None
        assert result is not None
        done = sched.computed()
        chunks = [(done[r], n) for r, n in sched.num_scheduled_tokens.items()]
        self.cost_model.observe_step(sched.num_tokens, attention_pairs(chunks), dt)
        return result

    def _deltas(self, update: StepUpdate) -> list[EngineCoreOutput]:
        """The outputs of a step's sampled tokens, after their sessions and replication
        took note of them."""
        outputs = []
        for event in update.appended:
            req = event.request
            self._after_token(req)
            want_plp = event.first and req.params.prompt_logprobs is not None
            outputs.append(
                EngineCoreOutput(
                    req.request_id,
                    [event.token],
                    [event.logprobs] if event.logprobs is not None else None,
                    req.status.value if req.is_finished else None,
                    req.stop_reason,
                    req.num_cached_tokens,
                    req.prompt_logprobs if want_plp else None,
                )
            )
        return outputs

    def _after_token(self, req: Request) -> None:
        """Session bookkeeping after ``req`` got a token (or finished)."""
        if req.is_finished and req.session_id is not None and self.offloader is not None:
            self.offloader.record_session(req)
        if self.replicator is not None and req.session_id is not None:
            self.replicator.after_step(req)

    def _drop_fenced(self) -> list[EngineCoreOutput]:
        """Abort requests whose session another node took over; their final deltas."""
        if self.replicator is None or not self.replicator.any_fenced():
            return []
        out = []
        for req in list(self.requests.values()):
            if req.session_id is not None and self.replicator.fenced(req.session_id):
                logger.warning(
                    "request %s: session %s fenced; dropped", req.request_id, req.session_id
                )
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                out.append(EngineCoreOutput(req.request_id, [], finish_reason=FINISH_ABORT))
        return out

    def _observe_usage(self) -> None:
        used = self.kv.pool.num_used
        self.peak_usage.record(used / self.kv.num_blocks)
        if self.usage_recorder is not None and self.usage_recorder.due():
            self.usage_recorder.maybe_record(
                used, self.kv.num_blocks, self.kv_spec.bytes_per_block, self.tenant_blocks()
            )

    # ---- tenants, integrity, stats --------------------------------------------------
    def tenant_blocks(self) -> dict[str, int]:
        """KV blocks charged to each tenant (the ledger's rule: every distinct block its
        requests hold, a block shared across tenants counting for each), so the tenants
        may sum to more than the pool's used blocks."""
        return {t: n for t, n in self.kv.ledger.usages().items() if n}

    def set_tenant_budgets(self, budgets: dict[str, Budget]) -> None:
        """Apply tenants' reservations and limits (at start or on a reload). Running
        requests keep their blocks; a tenant above a lowered limit takes no more until it
        is back under it (its own requests are preempted as they need blocks)."""
        self.kv.ledger.set_budgets(budgets)

    def check_integrity(self) -> None:
        """Raise AssertionError if KV bookkeeping is inconsistent (tests call this)."""
        self.kv.check_integrity()
        if self.swap is not None:
            self.swap.check_integrity()
            held = self.runner.swap_held() - set(self.scheduler.pending_drops)
            if held != self.swap.held():  # right after a step the worker holds the same
                raise AssertionError(f"host copies {held} != swapped {self.swap.held()}")
        copies, held = self.runner.request_copies(), self.scheduler.ranks.held_ids()
        if copies != len(held):  # after a step the ranks keep what the scheduler says
            raise AssertionError(f"the ranks keep {copies} requests, the scheduler {held}")
        live = {r.request_id for r in self.scheduler.running + self.scheduler.loading}
        if self.kv.num_requests() > len(live):
            raise AssertionError("blocks are held by requests that are not running")

    def metrics_snapshot(self) -> KVStats:
        """KV metrics (watermarks, fragmentation, tenants, preemptions, swap, store,
        replication); call on the engine's thread."""
        return kv_metrics.snapshot(self)

    def stats(self) -> EngineStats:
        """Queue lengths, pool occupancy, prefix-cache counters, time in steps (cheap)."""
        return kv_metrics.engine_stats(self)

    def info(self) -> dict[str, Any]:
        """The KV cache's shape and prefix-cache counters (``kvserve generate --json``)."""
        return kv_metrics.engine_info(self)
