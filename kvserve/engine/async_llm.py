"""AsyncLLM: the API server's side of the engine core, in its own process.

``AsyncLLM.start`` spawns the engine-core process through an ``AsyncMPClient``
(``engine.core_mp``, the ``CoreClient`` door ``LLM`` uses too) and waits for its
``EngineInfo``; ``attach`` (inside the server's event loop) starts the task that reads
its frames. Outputs arrive as per-step deltas; the ``OutputProcessor`` here turns them into
cumulative ``RequestOutput`` snapshots with incremental text and stop strings, so the
engine core never does text work.

Contracts:

- ``add_request`` / ``resume`` raise ``EngineError`` for a request the engine refuses and
  ``EngineDeadError`` once the core is gone; else return a ``RequestStream``. Leaving the
  stream early (disconnect, cancellation) aborts the request in the core.
- When the core process dies, every stream gets ``EngineDeadError``, every pending call
  fails with it, ``is_running`` turns False and ``dead`` is set — nothing hangs.
- ``stats`` is the core's newest ``EngineStats`` (``waiting`` includes adds in flight).
- ``shutdown`` asks the core to flush and exit, bounded by a timeout (then it is killed).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec

from kvserve.config import EngineArgs
from kvserve.engine.core_mp import AsyncMPClient
from kvserve.engine.messages import (
    Abort,
    AddRequest,
    AddResult,
    FinishStopped,
    Outputs,
    ResumeRequest,
    Shutdown,
    Utility,
    UtilityCall,
    UtilityResult,
)
from kvserve.engine.output import OutputProcessor
from kvserve.engine.requests import encode_prompt
from kvserve.engine.stats import EngineStats
from kvserve.errors import EngineDeadError, EngineError, QueueTimeout
from kvserve.ha.record import SessionRecord
from kvserve.kv.events import KVEvent
from kvserve.model.tokenizer import Tokenizer, load_tokenizer
from kvserve.request import RequestOutput
from kvserve.sampling import SamplingParams

logger = logging.getLogger("kvserve")


_INLINE_TOKENIZE = 4096  # characters; longer prompts are tokenized on a worker thread
_RATE_WINDOW_S = 30.0  # the window of completion_rate()


class RequestStream:
    """Cumulative outputs of one request; iterate once. Leaving the iteration before the
    final output (or calling ``abort``) aborts the request and frees its blocks."""

    def __init__(
        self,
        owner: AsyncLLM,
        request_id: str,
        queue: asyncio.Queue,
        n_prompt: int,
        first_output_timeout: float | None = None,
    ):
        """``first_output_timeout``: seconds the iteration waits for the first output;
        past them it raises ``QueueTimeout`` (and the request is aborted)."""
        self.owner = owner
        self.request_id = request_id
        self.num_prompt_tokens = n_prompt
        self._queue = queue
        self._first_timeout = first_output_timeout
        self.finished = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            deadline = self._first_timeout
            while not self.finished:
                if deadline is None:
                    item = await self._queue.get()
                else:
                    try:
                        item = await asyncio.wait_for(self._queue.get(), deadline)
                    except TimeoutError:
                        raise QueueTimeout(
                            f"the request had no output within {deadline:g} s "
                            "(--queue-timeout): the server is overloaded; retry later"
                        ) from None
                    deadline = None
                if isinstance(item, BaseException):
                    raise item
                self.finished = item.finished
                yield item
        finally:
            self.abort()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)


class AsyncLLM:
    """The engine core in its own process, driven from one asyncio loop."""

    def __init__(self, client: AsyncMPClient):
        self.client = client
        self.proc = client.proc
        self.info = client.info
        self.tokenizer: Tokenizer | None = load_tokenizer(self.info.model_dir)
        self.outputs = OutputProcessor(self.tokenizer)
        self._streams: dict[str, asyncio.Queue] = {}
        # requests without output yet, by id and per tenant; when recent ones finished
        self._queued: dict[str, str] = {}
        self._queued_by_tenant: Counter[str] = Counter()
        self._finished_at: deque[float] = deque()
        self._finished_lock = threading.Lock()  # the heartbeat thread reads the rate
        self._adds: dict[str, asyncio.Future] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._stats = EngineStats()
        self.error: BaseException | None = None
        self.dead = asyncio.Event()
        self._exited = asyncio.Event()  # the core process ended (expected or not)
        self._closing = False
        self._reader: asyncio.Task | None = None
        # called (in the loop) with each frame's KV events; the server's publisher
        self.on_kv_events: Callable[[list[KVEvent]], None] | None = None

    # ---- lifecycle --------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        args: EngineArgs,
        cluster_secret: str | None = None,
        log_level: str = "info",
        timeout: float = 3600.0,
    ) -> AsyncLLM:
        """Spawn the engine core and wait (up to ``timeout`` s) until it loaded the model.
        Raises ``EngineError`` with the core's reason when it cannot start."""
        return cls(
            AsyncMPClient.start(
                args, cluster_secret=cluster_secret, log_level=log_level, timeout=timeout
            )
        )

    def attach(self) -> None:
        """Start reading the core's frames on the running loop (call once, in the loop)."""
        self.client.attach()
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read())
        loop.add_reader(self.proc.sentinel, self._on_exit)

    def _on_exit(self) -> None:
        self._exited.set()
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self.proc.sentinel)
        if self.error is None and not self._closing:
            self._fail(EngineDeadError(f"the engine core exited ({self.proc.exitcode})"))

    def _fail(self, err: EngineDeadError) -> None:
        logger.error("%s", err)
        self.error = err
        self._end_streams(err)
        for fut in [*self._adds.values(), *self._calls.values()]:
            if not fut.done():
                fut.set_exception(err)
        self._adds.clear()
        self._calls.clear()
        self.dead.set()

    def end_all(self, reason: str) -> int:
        """End every running request now: the core aborts them (their KV blocks are
        freed) and each stream raises ``EngineDeadError(reason)`` — a 503 or an error event
        (which a router answers by resuming the stream elsewhere). The engine stays up.
        Returns how many requests were ended."""
        ended = self._end_streams(EngineDeadError(reason))
        for rid in ended:
            self.outputs.abort(rid)
        if ended and self.error is None:
            with contextlib.suppress(EngineDeadError):
                self._send(Abort(ended))
        return len(ended)

    def _end_streams(self, err: EngineDeadError) -> list[str]:
        """Raise ``err`` in every running stream and forget them; their request ids."""
        ended = list(self._streams)
        for q in self._streams.values():
            q.put_nowait(err)
        self._streams.clear()
        return ended

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Ask the core to flush and exit; kill it after ``timeout`` s."""
        self._closing = True  # its exit is expected from now on
        if self.proc.is_alive() and self.error is None:
            with contextlib.suppress(Exception):
                self._send(Shutdown())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exited.wait(), timeout)
        self.client.kill()
        if self._reader is not None:
            self._reader.cancel()
        self.error = self.error or EngineDeadError("the engine shut down")

    @property
    def is_running(self) -> bool:
        return self.error is None

    # ---- frames ---------------------------------------------------------------------------
    def _send(self, msg: Any) -> None:
        if self.error is not None:
            raise EngineDeadError(str(self.error))
        self.client.send(msg)

    async def _read(self) -> None:
        """Dispatch the core's frames until cancelled; a frame that cannot be read or
        handled is fatal (every stream and call fails, none is left waiting)."""
        try:
            await self._read_frames()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("reading the engine core's output failed")
            if self.error is None:
                self._fail(EngineDeadError(f"the engine core's output is unreadable: {e!r}"))
            if self.proc.is_alive():
                self.proc.kill()

    async def _read_frames(self) -> None:
        while True:
            msg = await self.client.get_output_async()
            if isinstance(msg, Outputs):
                self._stats = msg.stats
                self._deliver(msg)
                if msg.kv_events and self.on_kv_events is not None:
                    try:
                        self.on_kv_events(msg.kv_events)
                    except Exception:  # routers resynchronise; streams must not fail
                        logger.exception("publishing KV events failed")
            elif isinstance(msg, AddResult):
                fut = self._adds.pop(msg.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, UtilityResult):
                fut = self._calls.pop(msg.call_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    def _deliver(self, msg: Outputs) -> None:
        outs, hits = self.outputs.process(msg.outputs)
        for hit in hits:
            self._send(FinishStopped(hit.request_id, hit.num_output_tokens))
        now = time.monotonic()
        for out in outs:
            self._started(out.request_id)
            q = self._streams.get(out.request_id)
            if q is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
                with self._finished_lock:
                    self._finished_at.append(now)
                    self._drop_finished_before(now - _RATE_WINDOW_S)
            q.put_nowait(out)

    def _started(self, request_id: str) -> None:
        """``request_id`` has its first output (or left): it is no longer queued."""
        tenant = self._queued.pop(request_id, None)
        if tenant is not None:
            self._queued_by_tenant[tenant] -= 1

    def queued(self, tenant: str) -> int:
        """``tenant``'s requests added that have no output yet (waiting, or in their
        first prefill)."""
        return self._queued_by_tenant[tenant]

    def completion_rate(self) -> float:
        """Requests finished per second over the last ``_RATE_WINDOW_S`` seconds (callable
        from another thread: the cluster heartbeat's)."""
        with self._finished_lock:
            self._drop_finished_before(time.monotonic() - _RATE_WINDOW_S)
            return len(self._finished_at) / _RATE_WINDOW_S

    def _drop_finished_before(self, horizon: float) -> None:
        """Forget finish times older than ``horizon`` (under ``_finished_lock``): the
        window stays bounded even when nobody asks for the rate."""
        done = self._finished_at
        while done and done[0] < horizon:
            done.popleft()

    # ---- requests -------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s = self._stats
        if self._adds:
            s = msgspec.structs.replace(s, waiting=s.waiting + len(self._adds))
        return s

    def tokenize(self, text: str, params: SamplingParams | None = None) -> list[int]:
        """Token ids of a prompt; with ``params``, raises EngineError (before building the
        ids) when the prompt cannot fit the context with its ``max_tokens``."""
        info = self.info
        return encode_prompt(self.tokenizer, info.model, info.max_model_len, text, params)

    async def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        seed: int | None = None,
        first_output_timeout: float | None = None,
        **kwargs: Any,
    ) -> RequestStream:
        """Queue one sequence; ``kwargs`` are ``AddRequest`` fields (``tenant`` …);
        ``first_output_timeout``: the stream's (``RequestStream``)."""
        text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, str) and len(prompt) > _INLINE_TOKENIZE:
            # off the event loop: a huge prompt must not stall it
            ids = await asyncio.to_thread(self.tokenize, prompt, params)
        elif isinstance(prompt, str):
            ids = self.tokenize(prompt, params)
        else:
            ids = [int(t) for t in prompt]
        msg = AddRequest(request_id, ids, params, seed, **kwargs)
        return await self._add(
            request_id, msg, text, ids, params, first_output_timeout=first_output_timeout
        )

    async def resume(
        self,
        request_id: str,
        record: SessionRecord,
        delivered: Sequence[int],
        seen_epoch: int | None,
    ) -> RequestStream:
        """``LLMEngine.resume_request`` as a stream (a failover's continuation)."""
        msg = ResumeRequest(request_id, record, [int(t) for t in delivered], seen_epoch)
        return await self._add(
            request_id, msg, None, record.prompt_token_ids, record.params, msg.delivered
        )

    async def _add(
        self,
        request_id: str,
        msg: AddRequest | ResumeRequest,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        delivered: list[int] | None = None,
        first_output_timeout: float | None = None,
    ) -> RequestStream:
        # the stream exists before the core can answer: its first delta may be read in the
        # same batch of frames as the AddResult
        queue: asyncio.Queue = asyncio.Queue()
        self.outputs.add_request(request_id, text, ids, params, delivered)
        self._streams[request_id] = queue
        fut = asyncio.get_running_loop().create_future()
        self._adds[request_id] = fut
        if isinstance(msg, AddRequest):  # queued until its first output (or its end)
            self._queued[request_id] = msg.tenant
            self._queued_by_tenant[msg.tenant] += 1
        try:
            try:
                self._send(msg)
            except OverflowError as e:  # an integer field beyond 64 bits: the client's error
                raise EngineError(f"a number in the request is out of range ({e})") from None
            result: AddResult = await fut
        except BaseException:  # refused on the wire, cancelled, or the core is gone
            self.abort(request_id)
            raise
        finally:
            self._adds.pop(request_id, None)
        if result.error is not None:
            self.abort(request_id)
            if result.internal:
                raise RuntimeError(result.error)
            raise EngineError(result.error)
        return RequestStream(self, request_id, queue, len(ids), first_output_timeout)

    def abort(self, request_id: str) -> None:
        """Abort a request in the core (no-op if unknown or the core is gone)."""
        self._streams.pop(request_id, None)
        self._started(request_id)
        self.outputs.abort(request_id)
        if self.error is None:
            with contextlib.suppress(EngineDeadError):
                self._send(Abort([request_id]))

    async def call(self, call: UtilityCall, type: Any = Any, timeout: float | None = None) -> Any:
        """Run a utility call between steps; returns its value decoded as ``type``.
        Raises ValueError with the core's message when the call failed there."""
        call_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            self._send(Utility(call_id, call))
            result: UtilityResult = await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)
        if result.error is not None:
            raise ValueError(result.error)
        return msgspec.msgpack.decode(result.value, type=type)
