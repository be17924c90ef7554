"""The one door to the engine core: ``CoreClient``, in this process or in its own.

A client speaks the typed messages of ``engine.messages`` in both directions, whatever
carries them:

- ``send(msg)`` hands the core a ``ClientMessage`` (add, resume, abort, finish, a utility
  call, shutdown);
- ``get_output()`` (``get_output_async()`` for the asyncio clients) returns the core's next
  ``CoreMessage``: an ``AddResult`` or ``UtilityResult`` it owes, or a step's ``Outputs``.

Two kinds behind the same interface (vLLM v1's ``core_client`` shape):

- ``InprocClient`` (``LLM``'s default) drives an ``EngineCore`` directly: a send is
  applied at once; ``get_output`` returns the replies owed, else runs one step. It never
  blocks: without requests it returns an ``Outputs`` frame with no deltas.
- ``SyncMPClient`` and ``AsyncMPClient`` (``engine.core_mp``) talk to the engine-core
  process over ZeroMQ (``LLM(engine_process=True)`` and the API server's ``AsyncLLM``).
  ``SyncMPClient.get_output`` waits for the process and raises ``EngineDeadError`` once
  it died; ``AsyncMPClient.get_output_async`` only waits (``AsyncLLM`` watches the
  process's sentinel and fails every stream when it dies).

``LLM`` picks one by its ``engine_process`` flag. ``call`` runs a utility call on any sync
client; messages read while waiting for its answer are kept for the next ``get_output``.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import deque
from typing import TYPE_CHECKING, Any

import msgspec

from kvserve.engine.core import EngineCore, engine_info
from kvserve.engine.messages import (
    ClientMessage,
    CoreMessage,
    EngineInfo,
    Utility,
    UtilityCall,
    UtilityResult,
)

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine


class CoreClient(ABC):
    """The engine core as messages; ``info`` is what the core said when it started."""

    info: EngineInfo

    def __init__(self, info: EngineInfo):
        self.info = info
        self._held: deque[CoreMessage] = deque()  # read while a call waited
        self._call_ids = itertools.count()

    @abstractmethod
    def send(self, msg: ClientMessage) -> None:
        """Hand the core one message (raises ``EngineDeadError`` once it is gone)."""

    def get_output(self) -> CoreMessage:
        """The core's next message (sync clients; see the module doc for when it blocks)."""
        if self._held:
            return self._held.popleft()
        return self._next()

    def _next(self) -> CoreMessage:
        raise NotImplementedError(f"{type(self).__name__} is an asyncio client")

    async def get_output_async(self) -> CoreMessage:
        """The core's next message (asyncio clients)."""
        raise NotImplementedError(f"{type(self).__name__} is a sync client")

    def call(self, call: UtilityCall, type: Any = Any) -> Any:
        """Run a utility call between steps (sync clients); its value decoded as ``type``.
        Raises ValueError with the core's message when the call failed there."""
        call_id = next(self._call_ids)
        self.send(Utility(call_id, call))
        read: list[CoreMessage] = []
        while True:
            msg = self._next()
            if isinstance(msg, UtilityResult) and msg.call_id == call_id:
                break
            read.append(msg)
        self._held.extend(read)
        if msg.error is not None:
            raise ValueError(msg.error)
        return msgspec.msgpack.decode(msg.value, type=type)

    @abstractmethod
    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what runs, flush the KV store and replication, and stop the core
        (a process that does not exit within ``timeout`` s is killed)."""


class InprocClient(CoreClient):
    """The engine core in this process: a send is applied at once; ``get_output`` returns
    the replies owed first, then runs one step per call."""

    def __init__(self, engine: LLMEngine):
        super().__init__(engine_info(engine))
        self.engine = engine
        self.core = EngineCore(engine)
        self._replies: deque[CoreMessage] = deque()

    def send(self, msg: ClientMessage) -> None:
        self._replies.extend(self.core.handle(msg))

    def _next(self) -> CoreMessage:
        if self._replies:
            return self._replies.popleft()
        return self.core.step()  # without requests: no deltas, the stats and KV events

    def shutdown(self, timeout: float = 30.0) -> None:
        self.core.abort_all()
        self.engine.close()  # flushes queued KV store writes and replication
