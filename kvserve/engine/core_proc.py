"""The engine-core process: one busy loop that owns the engine (scheduler, KV, model).

Contract of the loop (``CoreLoop.run``), one iteration:

1. Read every message the client sent (without waiting when requests are running; up to
   ``IDLE_POLL_S`` when idle) and apply it: add, resume, abort, finish (stop string),
   utility calls (answered at once, except a checkpoint read from S3: it runs on an io
   thread and its answer is sent by a later iteration), shutdown.
2. If requests are unfinished, run one ``LLMEngine.step()`` and send its deltas with the
   engine's stats and the KV events logged since the last frame (``Outputs``); else send
   the stats once after anything changed, or when KV events are pending.
3. Exit when the parent (the API server) is gone: no orphans. The kernel's parent-death
   signal covers a SIGKILLed parent too. While idle, check the tensor-parallel ranks
   (``check_health``): a dead rank is a failure (exit 1) even with no request running.

Nothing else in this process does Python work the loop waits for during a forward pass:
there is no asyncio loop, no HTTP, no tokenizer here. A request the engine refuses gets
an ``AddResult`` with the reason; an exception inside ``step()`` is a bug or a device
failure: it is logged and the process exits 1, and the client fails every stream
(``EngineDeadError``) instead of hanging.

SIGINT and SIGTERM are ignored here: the API server drains first and then sends
``Shutdown``, after which the KV store and replication are flushed and the process exits 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from kvserve.config import EngineArgs
from kvserve.engine import kv_metrics
from kvserve.engine.gc_heap import freeze_startup_heap
from kvserve.engine.messages import (
    PROTOCOL_VERSION,
    Abort,
    AcceptPush,
    AddRequest,
    AddResult,
    CheckIntegrity,
    ClientMessage,
    DeleteRecords,
    DeleteSession,
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
    StartupFailed,
    Utility,
    UtilityCall,
    UtilityResult,
)
from kvserve.engine.stats import EngineStats
from kvserve.errors import EngineError
from kvserve.store.tiered import TieredStore

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.engine.parts import EngineParts

logger = logging.getLogger("kvserve")
# calls that read or write the KV store's lower tiers: never on the loop
_IO_CALLS = (ReadCheckpoint, PutRecords, GetRecord, DeleteRecords, GetSession, DeleteSession)

IDLE_POLL_S = 0.1


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; elsewhere the
    loop's parent check alone)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class CoreLoop:
    """The busy loop around one ``LLMEngine``; ``run`` returns when told to shut down."""

    def __init__(self, engine: LLMEngine, inp: zmq.Socket, out: zmq.Socket, parent_pid: int):
        self.engine = engine
        self.inp = inp
        self.out = out
        self.parent_pid = parent_pid
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(ClientMessage)
        self._poller = zmq.Poller()
        self._poller.register(inp, zmq.POLLIN)
        self._stop = False
        self._busy = 0.0  # seconds in iterations that stepped (up to their send)
        # calls that wait on the network (an S3 read) run here, not on the loop
        self._slow = ThreadPoolExecutor(1, thread_name_prefix="kvserve-core-io")
        self._answers: queue.SimpleQueue[UtilityResult] = queue.SimpleQueue()
        self._slow_pending = 0

    def close(self) -> None:
        """Wait for calls still running on the io thread (their answers are dropped)."""
        self._slow.shutdown(wait=True)

    def _send(self, msg: Any) -> None:
        self.out.send(self._enc.encode(msg), copy=False)

    def run(self) -> None:
        engine = self.engine
        while not self._stop:
            busy = engine.has_unfinished_requests()
            changed = False
            t0 = time.perf_counter()
            idle_ms = 5 if self._slow_pending else int(IDLE_POLL_S * 1000)
            if self._poller.poll(0 if busy else idle_ms):
                while True:
                    try:
                        frame = self.inp.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(self._dec.decode(frame.buffer))
                    changed = True
                if not busy:  # idle until now: the wait was not work
                    t0 = time.perf_counter()
            while self._slow_pending and not self._answers.empty():
                self._send(self._answers.get())
                self._slow_pending -= 1
            if os.getppid() != self.parent_pid:
                logger.error("engine core: the API server is gone; exiting")
                return
            if not busy:
                engine.runner.check_health()  # a dead rank fails the core while idle too
            if self._stop:
                break
            if engine.has_unfinished_requests():
                outputs = engine.step()
                self._busy += time.perf_counter() - t0
                self._send(Outputs(outputs, self._stats(), self._kv_events()))
            elif changed or engine.kv_events:  # (the host tier fills from other threads)
                self._send(Outputs([], self._stats(), self._kv_events()))

    def _stats(self) -> EngineStats:
        """The engine's stats with the loop's running busy total (every frame has it)."""
        stats = self.engine.stats()
        stats.loop_seconds = self._busy
        return stats

    def _kv_events(self) -> list:
        """The KV events since the last frame; the whole state after the log overflowed."""
        log = self.engine.kv_events
        if log is None:
            return []
        events = log.drain()
        if events is None:
            logger.warning("engine core: the KV event log overflowed; sending the full state")
            events = kv_state(self.engine)
        return events

    # ---- messages -----------------------------------------------------------------------
    def _handle(self, msg: Any) -> None:
        e = self.engine
        if isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, ResumeRequest):
            self._resume(msg)
        elif isinstance(msg, Abort):
            for rid in msg.request_ids:
                e.abort_request(rid)
        elif isinstance(msg, FinishStopped):
            e.finish_request(msg.request_id, msg.num_output_tokens)
        elif isinstance(msg, Utility):
            self._utility(msg)
        elif isinstance(msg, Shutdown):
            self._stop = True

    def _add(self, m: AddRequest) -> None:
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
            self._send(AddResult(m.request_id, error=str(err)))
        except Exception as err:  # a bug: refuse this request, keep serving
            logger.exception("engine core: add_request %s failed", m.request_id)
            self._send(AddResult(m.request_id, error=f"internal error: {err!r}", internal=True))
        else:
            self._send(AddResult(m.request_id))

    def _resume(self, m: ResumeRequest) -> None:
        try:
            self.engine.resume_request(m.request_id, m.record, m.delivered, m.seen_epoch)
        except (EngineError, ValueError) as err:
            self._send(AddResult(m.request_id, error=str(err)))
        except Exception as err:
            logger.exception("engine core: resume %s failed", m.request_id)
            self._send(AddResult(m.request_id, error=f"internal error: {err!r}", internal=True))
        else:
            self._send(AddResult(m.request_id))

    def _utility(self, m: Utility) -> None:
        if isinstance(m.call, _IO_CALLS):  # network I/O (S3, Redis): from the io thread
            self._slow_pending += 1
            self._slow.submit(lambda: self._answers.put(self._answer(m)))
            return
        self._send(self._answer(m))

    def _answer(self, m: Utility) -> UtilityResult:
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
            return [len(verified), refused, len(load.blocks) if load is not None else 0]
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


def run_engine_core(
    args: EngineArgs,
    input_addr: str,
    output_addr: str,
    parent_pid: int,
    cluster_secret: str | None = None,
    log_level: str = "info",
) -> None:
    """Entry point of the engine-core process (``multiprocessing`` spawn target)."""
    _die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the API server drains, then says Shutdown
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 5000)
    out.connect(output_addr)
    enc = msgspec.msgpack.Encoder()
    try:
        from kvserve.engine.llm_engine import LLMEngine

        engine = LLMEngine(args, cluster_secret)
    except Exception as e:  # a misconfiguration: the API server reports it and exits
        if isinstance(e, (ValueError, OSError, EngineError)):  # the user's to fix: no trace
            logger.debug("engine core failed to start", exc_info=True)
        else:
            logger.exception("engine core failed to start")
        config = isinstance(e, ValueError)  # EngineError and the model's errors are
        out.send(enc.encode(StartupFailed(str(e) or repr(e), config)))
        out.close()
        sys.exit(1)
    freeze_startup_heap()  # this process serves until it exits: never unfrozen
    out.send(enc.encode(engine_info(engine)))
    loop = CoreLoop(engine, inp, out, parent_pid)
    try:
        loop.run()
    except Exception:
        logger.exception("engine core failed")
        os._exit(1)  # the client sees the process die and fails every stream
    for rid in list(engine.requests):
        engine.abort_request(rid)
    loop.close()
    engine.close()  # flushes queued KV store writes and replication
    inp.close(linger=0)
    out.close()
    ctx.term()
