"""The engine-core process: one busy loop that owns the engine (scheduler, KV, model).

Contract of the loop (``CoreLoop.run``), one iteration:

1. Read every message the client sent (without waiting when requests are running; up to
   ``IDLE_POLL_S`` when idle) and apply it with ``EngineCore.handle`` (``engine.core``,
   the handler the in-process client uses too): add, resume, abort, finish (stop string),
   utility calls (answered at once, except those that wait on the KV store's lower tiers:
   they run on an io thread and their answer is sent by a later iteration), shutdown.
2. If requests are unfinished, run one ``LLMEngine.step()`` and send its deltas with the
   engine's stats and the KV events logged since the last frame (``Outputs``); else send
   the stats once after anything changed, or when KV events are pending.
3. Exit when the parent (the API server, or an offline ``LLM(engine_process=True)``) is
   gone: no orphans. The kernel's parent-death
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
from kvserve.engine.core import IO_CALLS, EngineCore, engine_info
from kvserve.engine.gc_heap import freeze_startup_heap
from kvserve.engine.messages import ClientMessage, StartupFailed, Utility, UtilityResult
from kvserve.errors import EngineError

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine

logger = logging.getLogger("kvserve")

IDLE_POLL_S = 0.1


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; elsewhere the
    loop's parent check alone)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class CoreLoop:
    """The socket loop around one ``EngineCore``; ``run`` returns when told to shut down."""

    def __init__(self, engine: LLMEngine, inp: zmq.Socket, out: zmq.Socket, parent_pid: int):
        self.core = EngineCore(engine)
        self.engine = engine
        self.inp = inp
        self.out = out
        self.parent_pid = parent_pid
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(ClientMessage)
        self._poller = zmq.Poller()
        self._poller.register(inp, zmq.POLLIN)
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
        core = self.core
        while not core.stopped:
            busy = core.has_work()
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
                self.engine.runner.check_health()  # a dead rank fails the core while idle too
            if core.stopped:
                break
            if core.has_work():
                self._send(core.step(started=t0))
            elif changed or self.engine.kv_events:  # (the host tier fills from other threads)
                self._send(core.step())

    def _handle(self, msg: Any) -> None:
        """Apply one message; a utility call that waits on the network is answered from
        the io thread (a later iteration sends it)."""
        if isinstance(msg, Utility) and isinstance(msg.call, IO_CALLS):
            self._slow_pending += 1
            self._slow.submit(lambda: self._answers.put(self.core.answer(msg)))
            return
        for reply in self.core.handle(msg):
            self._send(reply)


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
    loop.core.abort_all()
    loop.close()
    engine.close()  # flushes queued KV store writes and replication
    inp.close(linger=0)
    out.close()
    ctx.term()
