"""The engine core in its own process, behind ``CoreClient`` (``engine.core_client``).

``spawn_core`` starts the process (``engine.core_proc.run_engine_core``) on two ZeroMQ
IPC sockets and waits for its ``EngineInfo``; ``SyncMPClient`` reads its frames by
blocking (``LLM(engine_process=True)``), ``AsyncMPClient`` from an asyncio loop (the API
server's ``AsyncLLM``).

Contracts: ``spawn_core`` raises ``EngineError`` with the core's reason when it cannot start
(``StartupConfigError`` for a misconfiguration), leaving no process, socket or directory
behind; a sync ``get_output`` checks every 0.2 s that the process lives and raises
``EngineDeadError`` once it died, so nothing waits on a dead core (the asyncio reader
does not: ``AsyncLLM`` watches the process's sentinel); ``kill`` (and ``shutdown`` after
it) closes the sockets and removes their directory.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvserve.config import EngineArgs
from kvserve.engine import tcmalloc
from kvserve.engine.core_client import CoreClient
from kvserve.engine.core_proc import run_engine_core
from kvserve.engine.messages import (
    PROTOCOL_VERSION,
    ClientMessage,
    CoreMessage,
    EngineInfo,
    Shutdown,
    StartupFailed,
)
from kvserve.errors import EngineDeadError, EngineError, StartupConfigError
from kvserve.utils import resolve_device

logger = logging.getLogger("kvserve")
_POLL_MS = 200  # how often a waiting reader checks that the core lives


def _device_type(device: str) -> str:
    """The type of device an engine of ``device`` runs on (``resolve_device``); a device
    it refuses (an absent CUDA device, a bad name) is the core's to report: not "cpu"."""
    try:
        return resolve_device(device).type
    except (ValueError, RuntimeError):
        return "unresolved"


@dataclass
class CoreProcess:
    """A started engine-core process, the sockets to it and what it said at start."""

    proc: Any  # multiprocessing.Process
    inp: zmq.Socket  # PUSH: client messages
    out: zmq.Socket  # PULL: core messages
    info: EngineInfo
    tmp: str  # the directory of the IPC sockets

    def close(self) -> None:
        """Close the sockets and remove their directory (the process is the caller's to
        stop); calling it again does nothing."""
        _close(self.inp, self.out, self.tmp)


def _close(inp: zmq.Socket, out: zmq.Socket, tmp: str) -> None:
    inp.close(linger=0)
    out.close(linger=0)
    with contextlib.suppress(OSError):
        for name in ("in", "out"):
            os.unlink(os.path.join(tmp, name))
        os.rmdir(tmp)


def spawn_core(
    args: EngineArgs,
    cluster_secret: str | None = None,
    log_level: str = "info",
    timeout: float = 3600.0,
) -> CoreProcess:
    """Spawn the engine core and wait (up to ``timeout`` s) until it loaded the model."""
    tmp = tempfile.mkdtemp(prefix="kvserve-core-")
    in_addr, out_addr = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
    ctx = zmq.Context.instance()
    inp = ctx.socket(zmq.PUSH)
    inp.bind(in_addr)
    out = ctx.socket(zmq.PULL)
    out.bind(out_addr)
    proc = multiprocessing.get_context("spawn").Process(
        target=run_engine_core,
        args=(args, in_addr, out_addr, os.getpid(), cluster_secret, log_level),
        name="kvserve-engine-core",
        daemon=True,
    )
    try:
        return _started(args, proc, inp, out, tmp, timeout)
    except BaseException:
        if proc.is_alive():
            proc.kill()
        if proc.pid is not None:
            proc.join(10)
        _close(inp, out, tmp)
        raise


def _started(
    args: EngineArgs, proc: Any, inp: zmq.Socket, out: zmq.Socket, tmp: str, timeout: float
) -> CoreProcess:
    """Start ``proc`` and read its first message (``spawn_core``'s errors)."""
    try:  # a CPU engine core preloads tcmalloc (engine/tcmalloc.py)
        with tcmalloc.preloaded_for_children(_device_type(args.device)) as lib:
            proc.start()
    except ValueError as e:  # a bad KVSERVE_TCMALLOC: refused before anything runs
        raise EngineError(str(e)) from None
    if lib is not None:
        logger.info("engine core started with tcmalloc preloaded (%s)", lib)
    deadline = time.monotonic() + timeout
    while True:
        if out.poll(_POLL_MS):
            msg = msgspec.msgpack.decode(out.recv(), type=CoreMessage)
            break
        if not proc.is_alive() or time.monotonic() > deadline:
            raise EngineError(f"the engine core exited while starting ({proc.exitcode})")
    if isinstance(msg, StartupFailed):
        proc.join(10)  # it exits by itself
        raise (StartupConfigError if msg.config else EngineError)(msg.message)
    if not isinstance(msg, EngineInfo) or msg.protocol_version != PROTOCOL_VERSION:
        raise EngineError("the engine core speaks another protocol version")
    return CoreProcess(proc, inp, out, msg, tmp)


class _MPClient(CoreClient):
    """What both process clients share: the process, the encoder, the stop."""

    def __init__(self, core: CoreProcess):
        super().__init__(core.info)
        self.process = core
        self.proc = core.proc
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(CoreMessage)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Ask the core to flush and exit (from outside an asyncio loop); kill it after
        ``timeout`` s."""
        if self.proc.is_alive():
            with contextlib.suppress(Exception):
                self.send(Shutdown())
            self.proc.join(timeout)
        self.kill()

    def kill(self) -> None:
        """Stop the process now (if it still runs) and remove its sockets."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.process.close()


class SyncMPClient(_MPClient):
    """The engine-core process read by blocking calls."""

    @classmethod
    def start(cls, args: EngineArgs, **kwargs: Any) -> SyncMPClient:
        """Spawn the core (``spawn_core``'s arguments and errors)."""
        return cls(spawn_core(args, **kwargs))

    def send(self, msg: ClientMessage) -> None:
        if not self.proc.is_alive():
            raise EngineDeadError(f"the engine core exited ({self.proc.exitcode})")
        self.process.inp.send(self._enc.encode(msg), copy=False)

    def _next(self) -> CoreMessage:
        out = self.process.out
        while not out.poll(_POLL_MS):
            if not self.proc.is_alive() and not out.poll(0):
                raise EngineDeadError(f"the engine core exited ({self.proc.exitcode})")
        return self._dec.decode(out.recv(copy=False).buffer)


class AsyncMPClient(_MPClient):
    """The engine-core process read from one asyncio loop; ``attach`` in that loop first."""

    _inp: zmq.asyncio.Socket | None = None
    _out: zmq.asyncio.Socket | None = None

    @classmethod
    def start(cls, args: EngineArgs, **kwargs: Any) -> AsyncMPClient:
        """Spawn the core (``spawn_core``'s arguments and errors)."""
        return cls(spawn_core(args, **kwargs))

    def attach(self) -> None:
        """Wrap the sockets for the running loop (call once, in the loop)."""
        self._inp = zmq.asyncio.Socket.from_socket(self.process.inp)
        self._out = zmq.asyncio.Socket.from_socket(self.process.out)

    def send(self, msg: ClientMessage) -> None:
        assert self._inp is not None, "attach() first"
        self._inp.send(self._enc.encode(msg), copy=False)

    async def get_output_async(self) -> CoreMessage:
        assert self._out is not None, "attach() first"
        frame = await self._out.recv(copy=False)
        return self._dec.decode(frame.buffer)
