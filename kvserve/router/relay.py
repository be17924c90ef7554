"""One client request through the router: route it, relay the worker's answer, and fail
over to a standby when the worker dies.

The router forwards the client's body with four additions: ``session_id`` (the client's,
or an id made up for this one request — *ephemeral*, released when it ends),
``return_token_ids: true`` (the router must know the token ids the client has; it strips
them again unless the client asked), a ``seed`` when the client gave none (so a sampled
stream can be continued with the same draws; the seed is random, so nothing changes for
the client) and, on streams, ``stream_options.include_usage`` (the router learns how many
prompt tokens the worker had cached; the usage chunk is dropped again unless asked).
It also sends ``X-Kvserve-Session-Epoch``: the session's epoch as the router saw it,
which the worker's claim is conditional on. Everything else goes up as the client sent it
(tools, response_format, penalties …: the worker validates and answers). A body whose
``session_id`` or ``return_token_ids`` has the wrong type goes up with no additions at
all, so the worker refuses it with the same 400 it gives a direct client.

Placement: the session's owner when it is routable (affinity, whatever the policy), else
``scoring.Placement`` (prefix overlap against load, least-loaded or round-robin).

Disaggregated prefill/decode (some workers have ``--role prefill`` or ``decode``): a
new streamed, resumable request goes to a prefill-capable worker with a decode-capable
one as its standby; once the client has the first token the router continues the stream
on the decode worker through ``/internal/resume`` — a planned failover, with the same
exactness — and, once that worker answered, closes the prefill worker's stream (it
aborts there; its prompt blocks went to the decode worker's push and the shared tier).
If the decode worker does not take the stream, the prefill worker finishes it. A prefill
worker that dies first is an ordinary failover (to the decode worker). Whole
(non-streamed) requests and those that cannot resume run on one decode-capable worker.

A worker has failed when its connection breaks, when its stream ends without
``[DONE]``, when it sends an error event, or when it stays silent for ``stall_timeout``
and then fails a liveness check (registry + ``/health`` within ``probe_timeout``). Then
the router asks the session's standby to continue (``POST /internal/resume`` with the
token ids and text characters the client already has and the epoch it saw) and relays
the continuation into the same client stream, with the first response's ``id`` and
``created``. The failed worker's connection is closed first, so nothing it might still
produce reaches the client. Requests that cannot be resumed exactly (``n > 1``, logprobs,
``echo``) are relayed without failover: a failure ends them with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import anyio
import httpx
import msgspec

from kvserve.ha.coordination import Coordinator
from kvserve.ha.wire import ResumeBody
from kvserve.router.config import RouterConfig
from kvserve.router.flow import Flow
from kvserve.router.scoring import Placement
from kvserve.router.workers import Worker, WorkerPool
from kvserve.server.errors import error_body
from kvserve.server.responses.record import session_of

logger = logging.getLogger("kvserve.router")
T = TypeVar("T")
_STREAM_TIMEOUT = httpx.Timeout(connect=2.0, read=None, write=10.0, pool=10.0)


class WorkerFailed(Exception):
    """The worker serving a request stopped serving it."""


class Unroutable(Exception):
    """No worker could take (or continue) the request; ``body`` is the error to send."""

    def __init__(self, status: int, message: str, type_: str = "ServiceUnavailableError"):
        super().__init__(message)
        self.status = status
        self.body = error_body(message, type_)


async def _closed(resp: httpx.Response) -> None:
    """Close ``resp`` (its connection, when unfinished: the worker aborts the request),
    also from a cancelled task: a client's disconnect cancels the ASGI server's task group,
    whose cancellation would otherwise cut this very close short and leave the worker
    generating for nobody."""
    with anyio.CancelScope(shield=True):
        await resp.aclose()


def _sse(payload: dict[str, Any]) -> str:
    """One SSE message; a Responses event names its type in an ``event:`` line too."""
    data = f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
    kind = payload.get("type")
    return f"event: {kind}\n{data}" if isinstance(kind, str) else data


class Relay:
    def __init__(
        self,
        pool: WorkerPool,
        coord: Coordinator,
        config: RouterConfig,
        metrics: Any,
        placement: Placement | None = None,
    ):
        self.pool = pool
        self.placement = placement or Placement("least-loaded", None)
        self.coord = coord
        self.config = config
        self.metrics = metrics

    # ---- helpers -------------------------------------------------------------------------
    async def _watched(self, aw: Awaitable[T], w: Worker) -> T:
        """``aw``'s result, unless ``w`` goes quiet for ``stall_timeout`` and then fails a
        liveness check (→ WorkerFailed). Transport errors become WorkerFailed."""
        task = asyncio.ensure_future(aw)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.config.stall_timeout)
                if done:
                    try:
                        return task.result()
                    except (httpx.HTTPError, httpx.StreamError) as e:
                        self.metrics.failovers_detected.labels("connection").inc()
                        raise WorkerFailed(f"{w.node_id}: {e!r}") from None
                if not await self.pool.alive(w):
                    self.metrics.failovers_detected.labels("stall").inc()
                    raise WorkerFailed(f"{w.node_id} stopped answering")
        finally:
            if not task.done():  # waited for even when this task is being cancelled, so
                task.cancel()  # the read has stopped before the response is closed
                with anyio.CancelScope(shield=True), contextlib.suppress(BaseException):
                    await task

    async def _owner(self, session: str):
        """The session's owner from the coordinator, or None: none, or the coordinator is
        unreachable — then requests route without affinity, and ask again only once the
        registry refresh (every ``--health-interval``) has read it again, so a stalled
        Redis costs one request its timeout, not every request."""
        if not self.pool.registry_ok:
            return None
        try:
            return await asyncio.to_thread(self.coord.owner, session)
        except Exception as e:  # Redis away: route without affinity
            logger.warning("coordinator unreachable: %s", e)
            self.pool.registry_ok = False
            return None

    def _epoch(self, owner) -> int | None:
        """The session's epoch the router saw, for the worker's conditional claim: its
        owner's, 0 when it has none, None when the registry is unreadable (the worker then
        reads the epoch itself)."""
        if owner is not None:
            return owner.epoch
        return 0 if self.pool.registry_ok else None

    async def _send(self, w: Worker, path: str, body: dict, headers: dict) -> httpx.Response:
        http = self.pool.client(w)
        req = http.build_request(
            "POST", w.url + path, json=body, headers=headers, timeout=_STREAM_TIMEOUT
        )
        return await self._watched(http.send(req, stream=True), w)

    # ---- routing -------------------------------------------------------------------------
    async def open(self, flow: Flow) -> tuple[Worker, httpx.Response]:
        """Send the request to the session's primary (its owner if routable, else where
        ``placement`` puts it). Returns the worker and its response (any status; a 200
        is open for streaming). Failures before an answer go to ``resume`` (which can
        start from nothing delivered)."""
        owner = await self._owner(flow.session)
        w = self.pool.get(owner.node) if owner is not None else None
        if w is None and flow.near is not None:  # a response not stored: near its history
            near = await self._owner(flow.near)
            w = self.pool.get(near.node) if near is not None else None
        standby = None
        if w is not None:
            self.metrics.decisions.labels("affinity").inc()
        else:
            w, standby = self._place(flow)
        self.metrics.decision_seconds.observe(time.perf_counter() - flow.arrived)
        epoch = self._epoch(owner)
        headers = flow.headers(epoch)
        if flow.response_id is not None and self.config.cluster_secret:  # it names the id
            headers["X-Kvserve-Cluster-Secret"] = self.config.cluster_secret
        standby = standby or self.pool.standby(flow.session, {w.node_id})
        if standby is not None:  # the node a failover would pick: it pre-warms the session
            headers["X-Kvserve-Standby"] = standby.node_id
        w.inflight += 1
        try:
            resp = await self._send(w, self._path(flow), flow.body, headers)
        except WorkerFailed as e:
            w.inflight -= 1
            self.metrics.failovers_detected.labels("open").inc()
            return await self.resume(flow, w, str(e))
        except BaseException:  # the client went away meanwhile
            w.inflight -= 1
            raise
        if resp.status_code in (502, 503, 504) and flow.resumable:  # draining / engine dead
            await resp.aclose()
            w.inflight -= 1
            return await self.resume(flow, w, f"{w.node_id} answered {resp.status_code}")
        return w, resp

    def _place(self, flow: Flow) -> tuple[Worker, Worker | None]:
        """A new request's worker (and, disaggregated, the decode worker it is handed to
        after its first token: also its standby). Raises Unroutable."""
        cands = self.pool.routable()
        if not cands:
            raise Unroutable(503, "no worker is available")
        decode: Worker | None = None
        if any(c.role != "both" for c in cands):  # the workers split prefill and decode
            prefill = [c for c in cands if c.can("prefill")]
            if flow.stream and flow.resumable and prefill:
                d = self.placement.choose(prefill, flow.session, flow.prompt)
                rest = [c for c in cands if c.can("decode") and c is not d.worker]
                if rest:
                    decode = self.placement.choose(rest, flow.session, flow.prompt).worker
                    flow.handoff_to = decode.node_id
            else:  # a whole request (or one that cannot be handed over) stays on one worker
                d = self.placement.choose(
                    [c for c in cands if c.can("decode")] or cands, flow.session, flow.prompt
                )
        else:
            d = self.placement.choose(cands, flow.session, flow.prompt)
        self.metrics.decisions.labels(d.reason).inc()
        if d.prompt_tokens:  # tokenized for the chosen worker: a guess to check later
            flow.predicted_cached = d.predicted_cached
            flow.placed_prompt_tokens = d.prompt_tokens
        return d.worker, decode

    def _path(self, flow: Flow) -> str:
        return {"chat": "/v1/chat/completions", "responses": "/v1/responses"}.get(
            flow.kind, "/v1/completions"
        )

    async def resume(self, flow: Flow, failed: Worker, why: str) -> tuple[Worker, httpx.Response]:
        """Continue ``flow`` on a standby after ``failed`` failed; returns the standby and
        its open 200 response. Tries at most ``max_failovers`` standbys in all, and waits
        at most ``failover_timeout`` seconds for one to be routable (a standby whose
        probe failed on a loaded machine comes back; waiting uses no attempt). Raises
        Unroutable when no worker can continue it."""
        if not flow.resumable:
            raise Unroutable(502, f"the worker failed ({why}) and this request cannot resume")
        start = time.monotonic()
        flow.failed.add(failed.node_id)
        flow.handoff_to = None  # a failed-over stream is not handed over any more
        failed.healthy = False  # until its next probe says otherwise
        logger.warning("session %s: %s; failing over", flow.session, why)
        while flow.failovers < self.config.max_failovers:
            w = self.pool.standby(flow.session, flow.failed)
            if w is None:
                if time.monotonic() - start >= self.config.failover_timeout:
                    break
                await asyncio.sleep(self.config.health_interval)  # wait for a worker
                continue
            flow.failovers += 1
            try:
                resp = await self._open_resume(flow, w)
            except WorkerFailed as e:
                flow.failed.add(w.node_id)
                logger.warning("session %s: standby %s failed too: %s", flow.session, w.node_id, e)
                continue
            if resp.status_code == 200:
                self.metrics.failovers.inc()
                self.metrics.failover_seconds.observe(time.monotonic() - start)
                logger.info("session %s resumed on %s", flow.session, w.node_id)
                return w, resp
            detail = await self._refusal(w, resp)
            if resp.status_code == 409:  # the epoch moved under us: read it again
                continue
            if 400 <= resp.status_code < 500:
                self.metrics.failover_failures.inc()
                raise Unroutable(502, f"the stream could not be resumed: {detail}", "APIError")
            logger.warning(
                "session %s: standby %s answered %d: %s", flow.session, w.node_id,
                resp.status_code, detail,
            )  # fmt: skip
            flow.failed.add(w.node_id)
        self.metrics.failover_failures.inc()
        raise Unroutable(503, f"the worker failed ({why}) and no standby could resume")

    async def handoff(self, flow: Flow) -> tuple[Worker, httpx.Response] | None:
        """Continue a disaggregated ``flow`` on its decode worker (``flow.handoff_to``,
        cleared): that worker and its open 200 response, or None — it is not routable or
        did not take the stream (retried once when the session's epoch moved) — and then
        the prefill worker's stream simply goes on. The caller closes the prefill stream
        only after this succeeded."""
        target, flow.handoff_to = flow.handoff_to, None
        w = self.pool.get(target) if target is not None else None
        if w is None:
            return None
        start = time.monotonic()
        for _ in range(2):
            try:
                resp = await self._open_resume(flow, w)
            except WorkerFailed as e:
                logger.warning("session %s: hand-over to %s failed: %s", flow.session, target, e)
                return None
            if resp.status_code == 200:
                self.metrics.handoffs.inc()
                self.metrics.handoff_seconds.observe(time.monotonic() - start)
                flow.predicted_cached = None  # the usage now reports the decode worker's cache
                return w, resp
            detail = await self._refusal(w, resp)
            if resp.status_code != 409:
                break
        logger.warning("session %s: %s refused the hand-over: %s", flow.session, target, detail)
        return None

    async def _open_resume(self, flow: Flow, w: Worker) -> httpx.Response:
        """``POST /internal/resume`` on ``w`` for what the client has of ``flow`` (at the
        session's current epoch); ``w.inflight`` counts it from here (and is given back
        if this raises). Raises WorkerFailed."""
        owner = await self._owner(flow.session)
        responses = flow.kind == "responses"  # then: the response the client has begun
        body = ResumeBody(
            session_id=flow.session,
            request=flow.body,
            kind=flow.kind,
            delivered_token_ids=flow.ids,
            delivered_text_chars=flow.chars,
            seen_epoch=self._epoch(owner),
            ephemeral=flow.ephemeral,
            response_id=flow.response_id if responses else None,
            created_at=flow.created if responses else None,
        )
        headers = flow.headers()
        if self.config.cluster_secret:
            headers["X-Kvserve-Cluster-Secret"] = self.config.cluster_secret
        w.inflight += 1
        try:
            return await self._send(w, "/internal/resume", msgspec.to_builtins(body), headers)
        except BaseException:  # failed, or the client went away meanwhile
            w.inflight -= 1
            raise

    async def _refusal(self, w: Worker, resp: httpx.Response) -> str:
        """Read and close a non-200 answer of ``w`` (giving its ``inflight`` back); its
        body, shortened."""
        try:
            return (await resp.aread()).decode(errors="replace")[:500]
        except httpx.HTTPError as e:
            return repr(e)
        finally:
            await resp.aclose()
            w.inflight -= 1

    async def forward(
        self, method: str, path: str, query: str, response_id: str, auth: str | None
    ) -> tuple[Worker | None, int, bytes]:
        """A stored response's request: a ``GET`` to the owner of its conversation's
        session when routable, else to the others in load order, until one answers
        other than 404 (or all did); a ``DELETE`` to every worker (each holds its own
        copies), answered by the first that had it. The worker, status and body; (None,
        503, error) when no worker answered."""
        session = session_of(response_id)
        owner = await self._owner(session) if session is not None else None
        cands = sorted(self.pool.routable(), key=lambda w: w.load)
        if owner is not None:
            cands.sort(key=lambda w: w.node_id != owner.node)
        headers = {"Authorization": auth} if auth else {}
        url = path + (f"?{query}" if query else "")
        answer: tuple[Worker | None, int, bytes] | None = None
        for w in cands:
            try:
                r = await self.pool.client(w).request(method, w.url + url, headers=headers)
            except httpx.HTTPError:
                continue
            if answer is None or (answer[1] == 404 and r.status_code != 404):
                answer = (w, r.status_code, r.content)
            if r.status_code != 404 and method != "DELETE":
                return answer
        if answer is not None:
            return answer
        return None, 503, json.dumps(Unroutable(503, "no worker is available").body).encode()

    # ---- relaying ------------------------------------------------------------------------
    async def events(self, flow: Flow, w: Worker, resp: httpx.Response) -> AsyncIterator[str]:
        """The client's SSE stream: ``resp`` relayed, continued elsewhere on failures."""
        current: Worker | None = w
        try:
            while True:
                moved: tuple[Worker, httpx.Response] | None = None
                try:
                    async with contextlib.aclosing(self._upstream(w, resp)) as upstream:
                        async for payload in upstream:
                            if payload is None:
                                yield flow.done_marker
                                return
                            for out in flow.deliver(payload):
                                yield _sse(out)
                            if flow.handoff_to is not None and flow.ids and not flow.finished:
                                moved = await self.handoff(flow)  # the prompt is done
                                if moved is not None:
                                    break
                    if moved is None and flow.finished and not flow.done_marker:
                        return  # a Responses stream ends after its terminal event
                    if moved is None:
                        self.metrics.failovers_detected.labels("connection").inc()
                        raise WorkerFailed(f"{w.node_id} ended the stream early")
                except WorkerFailed as e:
                    await resp.aclose()
                    w.inflight -= 1
                    current = None
                    flow.drop_pending()
                    if flow.finished:  # everything was delivered; only [DONE] was missing
                        yield flow.done_marker
                        return
                    try:
                        w, resp = await self.resume(flow, w, str(e))
                    except Unroutable as u:
                        yield _sse(flow.error_event(u.body))
                        return
                    current = w
                    continue
                await resp.aclose()  # the prefill worker's part is done (it aborts there)
                w.inflight -= 1
                w, resp = moved
                current = w
        finally:  # also when the client goes away: close the worker's stream (it aborts)
            await _closed(resp)
            if current is not None:
                current.inflight -= 1
            self.metrics.observe_cached(flow)

    async def _upstream(self, w: Worker, resp: httpx.Response) -> AsyncIterator[dict | None]:
        """Parsed ``data:`` payloads of an SSE response (None for ``[DONE]``); raises
        WorkerFailed on a broken or stalled connection and on an error event."""
        lines = resp.aiter_lines()
        while True:
            try:
                line = await self._watched(anext(lines), w)
            except StopAsyncIteration:
                return
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                yield None
                return
            payload = json.loads(data)
            if payload.get("type") == "response.failed":  # the worker's engine is gone
                self.metrics.failovers_detected.labels("error_event").inc()
                raise WorkerFailed(f"{w.node_id}: the response failed")
            if "error" in payload:
                self.metrics.failovers_detected.labels("error_event").inc()
                raise WorkerFailed(f"{w.node_id}: {payload['error'].get('message')}")
            yield payload

    async def whole(self, flow: Flow, w: Worker, resp: httpx.Response) -> dict[str, Any]:
        """A non-streaming response's JSON, continued elsewhere on failures (from
        nothing delivered: the client has received nothing yet). Raises Unroutable."""
        current: Worker | None = w
        try:
            while True:
                try:
                    payload = json.loads(await self._watched(resp.aread(), w))
                except (WorkerFailed, json.JSONDecodeError) as e:
                    await resp.aclose()
                    w.inflight -= 1
                    current = None
                    w, resp = await self.resume(flow, w, str(e))
                    current = w
                    continue
                out = flow.observe(payload)
                assert out is not None  # (a whole response is never a usage-only chunk)
                return out
        finally:
            await _closed(resp)
            if current is not None:
                current.inflight -= 1
            self.metrics.observe_cached(flow)
