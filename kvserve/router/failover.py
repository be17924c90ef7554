"""The router's side of a failover: continue a stream on another worker.

When the worker serving a stream fails (``upstream.WorkerFailed``), ``Failover.resume``
asks the session's standby to continue it: ``POST /internal/resume`` with a
``ha.wire.ResumeBody`` (the original request, the token ids and text characters the
client has, the epoch the router saw). The worker's side — which record it resumes from,
at which epoch, how much stored KV it restores — is ``ha.resume``; the engine replays
what it must (``LLMEngine.resume_request``). ``handoff`` is the planned case: a
disaggregated stream moved from its prefill worker to its decode worker after its first
token, the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import msgspec

from kvserve.ha.wire import ResumeBody
from kvserve.router.flow import Flow
from kvserve.router.upstream import Unroutable, Upstream, WorkerFailed
from kvserve.router.workers import Worker

logger = logging.getLogger("kvserve.router")


class Failover:
    """Continues streams of ``up``'s pool on standbys (``--max-failovers``,
    ``--failover-timeout``)."""

    def __init__(self, up: Upstream):
        self.up = up
        self.pool = up.pool
        self.config = up.config
        self.metrics = up.metrics

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
            detail = await self.refusal(w, resp)
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
            detail = await self.refusal(w, resp)
            if resp.status_code != 409:
                break
        logger.warning("session %s: %s refused the hand-over: %s", flow.session, target, detail)
        return None

    async def _open_resume(self, flow: Flow, w: Worker) -> httpx.Response:
        """``POST /internal/resume`` on ``w`` for what the client has of ``flow`` (at the
        session's current epoch); ``w.inflight`` counts it from here (and is given back
        if this raises). Raises WorkerFailed."""
        owner = await self.up.owner(flow.session)
        responses = flow.kind == "responses"  # then: the response the client has begun
        body = ResumeBody(
            session_id=flow.session,
            request=flow.body,
            kind=flow.kind,
            delivered_token_ids=flow.ids,
            delivered_text_chars=flow.chars,
            seen_epoch=self.up.epoch(owner),
            ephemeral=flow.ephemeral,
            response_id=flow.response_id if responses else None,
            created_at=flow.created if responses else None,
        )
        headers = flow.headers()
        if self.config.cluster_secret:
            headers["X-Kvserve-Cluster-Secret"] = self.config.cluster_secret
        w.inflight += 1
        try:
            return await self.up.send(w, "/internal/resume", msgspec.to_builtins(body), headers)
        except BaseException:  # failed, or the client went away meanwhile
            w.inflight -= 1
            raise

    async def refusal(self, w: Worker, resp: httpx.Response) -> str:
        """Read and close a non-200 answer of ``w`` (giving its ``inflight`` back); its
        body, shortened."""
        try:
            return (await resp.aread()).decode(errors="replace")[:500]
        except httpx.HTTPError as e:
            return repr(e)
        finally:
            await resp.aclose()
            w.inflight -= 1
