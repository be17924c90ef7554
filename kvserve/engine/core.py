"""EngineCore: the engine core's message handler, with no transport.

One ``LLMEngine`` behind the typed messages of ``engine.messages``: ``handle`` applies a
client message (add, resume, abort, finish, a utility call, shutdown) and returns the
replies it owes (``AddResult`` for an add or resume, ``UtilityResult`` for a call);
``step`` runs one engine step and returns its ``Outputs`` frame. Both clients of
``engine.core_client`` drive this same object: the in-process client calls it directly,
the engine-core process (``engine.core_proc``) calls it from its socket loop. So a request
means the same thing offline (``LLM``) and behind the server.

Contracts:

- A request the engine refuses is answered ``AddResult(error=reason)``; a bug while adding
  is logged and answered ``AddResult(internal=True)``: the engine keeps serving.
- A utility call that fails is answered ``UtilityResult(error=message)``; calls in
  ``IO_CALLS`` wait on the network (the KV store's lower tiers) and may be answered from
  another thread (``answer`` touches no scheduler state for them).
- ``stopped`` turns True on ``Shutdown``; nothing else changes then.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec

from kvserve.engine import kv_metrics
from kvserve.engine.messages import (
    PROTOCOL_VERSION,
    Abort,
    AcceptPush,
    AddRequest,
    AddResult,
    CheckIntegrity,
    DeleteRecords,
    DeleteSession,
    EngineCoreOutput,
    EngineInfo,
    FinishStopped,
    GetKVStats,
    GetRecord,
    GetSession,
    Outputs,
    PutRecords,
    ReadCheckpoint,
    ResetPrefixCache,
    ResumeRequest,
    SessionInfo,
    SetTenantBudgets,
    Shutdown,
    Utility,
    UtilityCall,
    UtilityResult,
)
from kvserve.engine.stats import EngineStats
from kvserve.errors import EngineError
from kvserve.store.tiered import TieredStore

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.engine.messages import ClientMessage
    from kvserve.engine.parts import EngineParts

logger = logging.getLogger("kvserve")
# calls that read or write the KV store's lower tiers (S3, Redis): never on a busy loop
IO_CALLS = (ReadCheckpoint, PutRecords, GetRecord, DeleteRecords, GetSession, DeleteSession)


class EngineCore:
    """The message handler around one engine; ``engine`` stays the caller's to close."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.stopped = False
        self.busy_seconds = 0.0  # the driving loop's time in iterations that stepped

    def handle(self, msg: ClientMessage) -> list[AddResult | UtilityResult]:
        """Apply one client message; the replies it owes, in order (none for an abort, a
        finish or a shutdown)."""
        e = self.engine
        if isinstance(msg, AddRequest):
            return [self._add(msg)]
        if isinstance(msg, ResumeRequest):
            return [self._resume(msg)]
        if isinstance(msg, Abort):
            for rid in msg.request_ids:
                e.abort_request(rid)
        elif isinstance(msg, FinishStopped):
            e.finish_request(msg.request_id, msg.num_output_tokens)
        elif isinstance(msg, Utility):
            return [self.answer(msg)]
        elif isinstance(msg, Shutdown):
            self.stopped = True
        return []

    def has_work(self) -> bool:
        """True while requests are unfinished: ``step`` has something to run."""
        return self.engine.has_unfinished_requests()

    def step(self, started: float | None = None) -> Outputs:
        """Run one engine step (none without requests); its deltas, the stats after it and
        the KV events logged since the last frame. ``started`` (``time.perf_counter``): when
        the caller's iteration began; from then to the step's end counts as busy time."""
        if not self.has_work():
            return self.frame([])
        t0 = time.perf_counter() if started is None else started
        outputs = self.engine.step()
        self.busy_seconds += time.perf_counter() - t0
        return self.frame(outputs)

    def frame(self, outputs: list[EngineCoreOutput]) -> Outputs:
        """A frame of ``outputs`` with the stats now and the KV events since the last one."""
        return Outputs(outputs, self.stats(), self.kv_events())

    def stats(self) -> EngineStats:
        """The engine's stats with the loop's running busy total (every frame has it)."""
        stats = self.engine.stats()
        stats.loop_seconds = self.busy_seconds
        return stats

    def kv_events(self) -> list:
        """The KV events since the last frame; the whole state after the log overflowed."""
        log = self.engine.kv_events
        if log is None:
            return []
        events = log.drain()
        if events is None:
            logger.warning("engine core: the KV event log overflowed; sending the full state")
            events = kv_state(self.engine)
        return events

    def abort_all(self) -> None:
        """Abort every request the engine holds (before it closes)."""
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)

    # ---- requests -----------------------------------------------------------------------
    def _add(self, m: AddRequest) -> AddResult:
        try:
            self.engine.add_request(
                m.request_id,
                m.prompt_token_ids,
                m.params,
                m.seed,
                tenant=m.tenant,
                cache_salt=m.cache_salt,
                priority=m.priority,
                session_id=m.session_id,
                session_epoch=m.session_epoch,
                ephemeral_session=m.ephemeral_session,
                standby=m.standby,
            )
        except EngineError as err:
            return AddResult(m.request_id, error=str(err))
        except Exception as err:  # a bug: refuse this request, keep serving
            logger.exception("engine core: add_request %s failed", m.request_id)
            return AddResult(m.request_id, error=f"internal error: {err!r}", internal=True)
        return AddResult(m.request_id)

    def _resume(self, m: ResumeRequest) -> AddResult:
        try:
            self.engine.resume_request(m.request_id, m.record, m.delivered, m.seen_epoch)
        except (EngineError, ValueError) as err:
            return AddResult(m.request_id, error=str(err))
        except Exception as err:
            logger.exception("engine core: resume %s failed", m.request_id)
            return AddResult(m.request_id, error=f"internal error: {err!r}", internal=True)
        return AddResult(m.request_id)

    # ---- utility calls ------------------------------------------------------------------
    def answer(self, m: Utility) -> UtilityResult:
        """Run one utility call; its value (msgpack) or the reason it failed."""
        try:
            value = self._call(m.call)
        except Exception as err:
            if not isinstance(err, ValueError | EngineError):
                logger.exception("engine core: %s failed", type(m.call).__name__)
            return UtilityResult(m.call_id, error=str(err) or repr(err))
        return UtilityResult(m.call_id, msgspec.Raw(msgspec.msgpack.encode(value)))

    def _call(self, call: UtilityCall) -> Any:
        e = self.engine
        if isinstance(call, ResetPrefixCache):
            return e.kv.reset_prefix_cache()
        if isinstance(call, CheckIntegrity):
            try:
                e.check_integrity()
            except AssertionError as err:  # a bug's trace, answered to the caller
                raise ValueError(f"KV bookkeeping is inconsistent: {err}") from None
            return None
        if isinstance(call, GetSession):
            rec = e.offloader.sessions.get(call.tenant, call.session_id) if e.offloader else None
            if rec is None:
                return None
            return SessionInfo(len(rec.tokens), len(rec.blocks), rec.updated, rec.expires)
        if isinstance(call, DeleteSession):
            sessions = e.offloader.sessions if e.offloader else None
            return bool(sessions and sessions.delete(call.tenant, call.session_id, call.if_tokens))
        if isinstance(call, SetTenantBudgets):
            e.set_tenant_budgets(call.budgets)
            return None
        if isinstance(call, GetKVStats):
            return kv_metrics.snapshot(e)
        if isinstance(call, AcceptPush):
            if e.offloader is None:
                raise ValueError("this worker has no KV store")
            from kvserve.ha.push import accept_push

            verified, refused = accept_push(e.offloader, call.body)
            load = e.offloader.place_warm(verified)  # and into the device pool, pre-warmed
            e.scheduler.add_copies(load)
            placed = len(load.rows) if load is not None else 0  # logical blocks
            return [len(verified), refused, placed]
        if isinstance(call, PutRecords | GetRecord | DeleteRecords):
            return _records(e.offloader.store if e.offloader else None, call)
        if isinstance(call, ReadCheckpoint):
            rep = e.replicator
            if rep is None or rep.checkpointer is None:
                return None
            return rep.checkpointer.read(call.session_id)
        raise ValueError(f"unknown call {type(call).__name__}")


def _records(store: TieredStore | None, call: PutRecords | GetRecord | DeleteRecords) -> Any:
    """A record call on the KV store (io thread); without a store: nothing kept, None."""
    if store is None:
        return None
    if isinstance(call, PutRecords):
        store.put_now(call.items)
        return None
    if isinstance(call, GetRecord):  # promoted nowhere: a deleted record stays deleted
        return store.get([call.key], promote=False)[0]
    store.delete(call.keys)
    return None


def kv_state(engine: EngineParts) -> list:
    """KV events that state everything the engine holds now (device pool, host tier)."""
    from kvserve.kv.events import DEVICE, HOST, full_state

    tiers = {DEVICE: engine.kv.pool.cached_hashes()}
    if engine.offloader is not None:
        tiers[HOST] = engine.offloader.host.keys()
    return full_state(tiers)


def engine_info(engine: EngineParts) -> EngineInfo:
    """What a client learns of the engine when it starts (``EngineInfo``)."""
    rep = engine.replicator
    return EngineInfo(
        protocol_version=PROTOCOL_VERSION,
        model=engine.model_config.model,
        model_dir=engine.model_dir,
        max_model_len=engine.max_model_len,
        num_blocks=engine.kv.num_blocks,
        block_size=engine.kv.block_size,
        bytes_per_block=engine.kv_spec.bytes_per_block,
        has_kv_store=engine.offloader is not None,
        cluster=engine.replication_url,
        node_id=rep.node_id if rep is not None else None,
        has_checkpointer=rep is not None and rep.checkpointer is not None,
        cache_keys=list(engine.kv.cache_keys),
        tenant_isolation=engine.cache_config.prefix_cache_isolation == "tenant",
        kv_events=engine.kv_events is not None,
    )
