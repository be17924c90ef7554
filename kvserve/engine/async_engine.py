"""AsyncLLMEngine: the synchronous engine on its own thread, with a coroutine API.

The step loop runs on a dedicated thread so model compute never blocks the event loop
(PyTorch releases the GIL inside its kernels). Everything that touches the engine — adding,
aborting, stepping — happens on that thread: callers enqueue operations, the thread runs
them between steps, and outputs travel back to each request's ``asyncio.Queue`` with
``call_soon_threadsafe``.

Contract of ``add_request``: it raises ``EngineError`` for a request the engine rejects,
else returns a ``RequestStream`` yielding cumulative ``RequestOutput`` snapshots, the last
one with ``finished`` set; if the consumer stops early (client disconnect, cancellation)
the request is aborted and its KV blocks are freed on the engine thread's next turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.output import OutputProcessor
from kvserve.request import RequestOutput
from kvserve.sampling import SamplingParams

logger = logging.getLogger("kvserve")


class EngineDeadError(RuntimeError):
    """The engine thread failed; the server must report unhealthy."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


def _deliver(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
        loop.call_soon_threadsafe(fn, *args)


def _settle(fut: asyncio.Future, value: Any = None, error: BaseException | None = None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


class RequestStream:
    """Cumulative outputs of one request; iterate once. Leaving the iteration before the
    final output (or calling ``abort``) aborts the request and frees its blocks."""

    def __init__(
        self, owner: AsyncLLMEngine, request_id: str, queue: asyncio.Queue, num_prompt_tokens: int
    ):
        self.owner = owner
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self._queue = queue
        self.finished = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._queue.get()
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


class AsyncLLMEngine:
    """Owns the engine thread. Call ``start()`` once, ``shutdown()`` at exit."""

    def __init__(self, engine: LLMEngine, idle_wait: float = 0.05):
        self.engine = engine
        self.outputs = OutputProcessor(engine.tokenizer)
        self._ops: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._pending_adds = 0  # submitted, not yet in the scheduler (counted as waiting)
        self._stop = False
        self._idle_wait = idle_wait
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self.error: BaseException | None = None

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread after its current step (running requests are aborted)."""
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # ---- submission -------------------------------------------------------------------
    def _submit(self, op: Callable[[], None]) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine thread failed: {self.error!r}")
        with self._lock:
            self._ops.append(op)
        self._wake.set()

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps; returns its result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def op() -> None:
            try:
                result = fn(self.engine)
            except Exception as e:
                _deliver(loop, _settle, fut, None, e)
            else:
                _deliver(loop, _settle, fut, result)

        self._submit(op)
        return await fut

    def abort(self, request_id: str) -> None:
        """Abort a request and free its blocks on the engine thread (no-op if unknown)."""

        def op() -> None:
            self._streams.pop(request_id, None)
            self.outputs.abort(request_id)
            self.engine.abort_request(request_id)

        if self.error is None:
            self._submit(op)

    async def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        seed: int | None = None,
        **kwargs: Any,
    ) -> RequestStream:
        """Add one sequence; returns its output stream once the engine accepted it.
        Raises ``EngineError`` for a request the engine rejects. ``kwargs`` go to
        ``LLMEngine.add_request`` (``tenant``, ``cache_salt`` …)."""
        return await self._add(
            request_id, lambda e: e.add_request(request_id, prompt, params, seed, **kwargs)
        )

    async def resume(
        self,
        request_id: str,
        record: dict[str, Any],
        delivered: Sequence[int],
        seen_epoch: int | None,
    ) -> RequestStream:
        """``LLMEngine.resume_request`` as a stream (a failover's continuation)."""
        return await self._add(
            request_id, lambda e: e.resume_request(request_id, record, delivered, seen_epoch)
        )

    async def _add(self, request_id: str, make: Callable[[LLMEngine], Any]) -> RequestStream:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        added = loop.create_future()

        def add() -> None:
            with self._lock:
                self._pending_adds -= 1
            try:
                req = make(self.engine)
            except Exception as e:
                _deliver(loop, _settle, added, None, e)
                return
            self._streams[request_id] = _Stream(loop, queue)
            self.outputs.add_request(
                request_id, req.prompt, req.prompt_token_ids, req.params, req.output_token_ids
            )
            _deliver(loop, _settle, added, len(req.prompt_token_ids))

        with self._lock:
            self._pending_adds += 1
        self._submit(add)
        try:
            num_prompt_tokens = await added
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return RequestStream(self, request_id, queue, num_prompt_tokens)

    # ---- the thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                with self._lock:
                    ops, self._ops = self._ops, []
                for op in ops:
                    op()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(self._idle_wait)
                    self._wake.clear()
                    continue
                outs, stops = self.outputs.process(self.engine.step())
                for hit in stops:
                    self.engine.finish_request(hit.request_id, hit.num_output_tokens)
                for out in outs:
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue
                    if out.finished:
                        del self._streams[out.request_id]
                    _deliver(stream.loop, stream.queue.put_nowait, out)
        except BaseException as e:  # a bug or an unrecoverable device error
            logger.exception("engine thread failed")
            self.error = e
            err = EngineDeadError(f"the engine failed: {e!r}")
            for stream in self._streams.values():
                _deliver(stream.loop, stream.queue.put_nowait, err)
            self._streams.clear()
            with self._lock:  # ops waiting for an answer would hang otherwise
                ops, self._ops = self._ops, []
            for op in ops:
                with contextlib.suppress(Exception):
                    op()
        finally:
            gone = EngineDeadError("the engine shut down")
            for rid, stream in list(self._streams.items()):
                self.engine.abort_request(rid)
                _deliver(stream.loop, stream.queue.put_nowait, gone)
            self._streams.clear()

    # ---- read-only views (safe enough from another thread: ints and lengths) ----------
    def stats(self) -> dict[str, Any]:
        e = self.engine
        return {
            "running": len(e.scheduler.running),
            "waiting": len(e.scheduler.waiting) + self._pending_adds,
            "kv_blocks_used": e.kv.pool.num_used,
            "kv_blocks_total": e.kv.num_blocks,
            "kv_blocks_cached_free": e.kv.pool.num_cached_free,
            "kv_block_bytes": e.kv_spec.bytes_per_block,
            "prefix_cache_queries": e.kv.stats.queries,
            "prefix_cache_hits": e.kv.stats.hits,
            "num_preemptions": e.scheduler.num_preemptions,
        }
