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
``echo``) are relayed without failover: a failure ends them with an error event. The
failover itself is ``router.failover``; the worker's side of it ``ha.resume``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from kvserve.ha.coordination import Coordinator
from kvserve.router.config import RouterConfig
from kvserve.router.failover import Failover
from kvserve.router.flow import Flow
from kvserve.router.scoring import Placement
from kvserve.router.upstream import Unroutable, Upstream, WorkerFailed, closed
from kvserve.router.workers import Worker, WorkerPool
from kvserve.server.responses.record import session_of

logger = logging.getLogger("kvserve.router")


def _sse(payload: dict[str, Any]) -> str:
    """One SSE message; a Responses event names its type in an ``event:`` line too."""
    data = f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
    kind = payload.get("type")
    return f"event: {kind}\n{data}" if isinstance(kind, str) else data


class Relay:
    """Routes a request, relays its answer, and continues it elsewhere (``failover``)."""

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
        self.config = config
        self.metrics = metrics
        self.up = Upstream(pool, coord, config, metrics)
        self.failover = Failover(self.up)

    # ---- routing -------------------------------------------------------------------------
    async def open(self, flow: Flow) -> tuple[Worker, httpx.Response]:
        """Send the request to the session's primary (its owner if routable, else where
        ``placement`` puts it). Returns the worker and its response (any status; a 200
        is open for streaming). Failures before an answer go to ``Failover.resume``
        (which can start from nothing delivered)."""
        owner = await self.up.owner(flow.session)
        w = self.pool.get(owner.node) if owner is not None else None
        if w is None and flow.near is not None:  # a response not stored: near its history
            near = await self.up.owner(flow.near)
            w = self.pool.get(near.node) if near is not None else None
        standby = None
        if w is not None:
            self.metrics.decisions.labels("affinity").inc()
        else:
            w, standby = self._place(flow)
        self.metrics.decision_seconds.observe(time.perf_counter() - flow.arrived)
        epoch = self.up.epoch(owner)
        headers = flow.headers(epoch)
        if flow.response_id is not None and self.config.cluster_secret:  # it names the id
            headers["X-Kvserve-Cluster-Secret"] = self.config.cluster_secret
        standby = standby or self.pool.standby(flow.session, {w.node_id})
        if standby is not None:  # the node a failover would pick: it pre-warms the session
            headers["X-Kvserve-Standby"] = standby.node_id
        w.inflight += 1
        try:
            resp = await self.up.send(w, self._path(flow), flow.body, headers)
        except WorkerFailed as e:
            w.inflight -= 1
            self.metrics.failovers_detected.labels("open").inc()
            return await self.failover.resume(flow, w, str(e))
        except BaseException:  # the client went away meanwhile
            w.inflight -= 1
            raise
        if resp.status_code in (502, 503, 504) and flow.resumable:  # draining / engine dead
            await resp.aclose()
            w.inflight -= 1
            return await self.failover.resume(flow, w, f"{w.node_id} answered {resp.status_code}")
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

    async def forward(
        self, method: str, path: str, query: str, response_id: str, auth: str | None
    ) -> tuple[Worker | None, int, bytes]:
        """A stored response's request: a ``GET`` to the owner of its conversation's
        session when routable, else to the others in load order, until one answers
        other than 404 (or all did); a ``DELETE`` to every worker (each holds its own
        copies), answered by the first that had it. The worker, status and body; (None,
        503, error) when no worker answered."""
        session = session_of(response_id)
        owner = await self.up.owner(session) if session is not None else None
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
                                moved = await self.failover.handoff(flow)  # the prompt is done
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
                        w, resp = await self.failover.resume(flow, w, str(e))
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
            await closed(resp)
            if current is not None:
                current.inflight -= 1
            self.metrics.observe_cached(flow)

    async def _upstream(self, w: Worker, resp: httpx.Response) -> AsyncIterator[dict | None]:
        """Parsed ``data:`` payloads of an SSE response (None for ``[DONE]``); raises
        WorkerFailed on a broken or stalled connection and on an error event."""
        lines = resp.aiter_lines()
        while True:
            try:
                line = await self.up.watched(anext(lines), w)
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
                    payload = json.loads(await self.up.watched(resp.aread(), w))
                except (WorkerFailed, json.JSONDecodeError) as e:
                    await resp.aclose()
                    w.inflight -= 1
                    current = None
                    w, resp = await self.failover.resume(flow, w, str(e))
                    current = w
                    continue
                out = flow.observe(payload)
                assert out is not None  # (a whole response is never a usage-only chunk)
                return out
        finally:
            await closed(resp)
            if current is not None:
                current.inflight -= 1
            self.metrics.observe_cached(flow)
