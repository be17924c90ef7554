"""Asynchronous session replication from a primary.

For every running request with a ``session_id`` the primary claims the session in the
coordinator (``take_over``; conditional on the epoch the router saw when it routed the
request, so a primary that wakes up after a failover cannot take the session back). The
claim is made on the publisher thread, never on the engine's step path. Every
``every_tokens`` generated tokens — and when it finishes — it publishes the delta: the
newly full KV blocks are already offered to the shared store by the KV offloader
(content-addressed, so a block is stored once), and the session record goes to the
coordinator through a fenced write. The record holds what a standby needs to continue
the stream exactly: prompt and output token ids so far, sampling parameters and seed, the
number of tokens whose KV is in the store, and the epoch.

Publishing runs on a background thread; per session only the newest record waits (older
ones are superseded), so the queue is bounded by the number of sessions; while Redis is
unreachable records wait and the newest is written when it is back (replication catches
up, serving goes on). A refused claim or write means another node took the session
over: the session is marked fenced and the engine aborts its request at the next step
(the stale primary must not keep streaming).
Replication lag — tokens generated but not yet published, and seconds since the last
publish — is tracked per session.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.ha.coordination import Coordinator
from kvserve.ha.record import SessionRecord
from kvserve.request import Request

if TYPE_CHECKING:
    from kvserve.ha.checkpoint import Checkpointer
    from kvserve.ha.push import StandbyPusher

logger = logging.getLogger("kvserve")


@dataclass(eq=False)
class _Tracked:
    session: str
    seen_epoch: int | None  # the claim's condition (None: unconditional)
    epoch: int | None = None  # once the claim succeeded
    published_tokens: int = 0  # output tokens covered by the newest queued record
    acked_tokens: int = 0  # … by the newest record Redis accepted
    acked_at: float = field(default_factory=time.monotonic)


class Replicator:
    """Publishes session records of the requests running here (see the module doc).

    Engine-thread methods (``start``, ``after_step``, ``fenced``, ``lag``) never wait for
    Redis except ``start(claim_now=True)`` (the failover path, which needs the answer)."""

    def __init__(
        self,
        coordinator: Coordinator,
        node_id: str,
        every_tokens: int,
        block_size: int,
        pusher: StandbyPusher | None = None,
        checkpointer: Checkpointer | None = None,
    ):
        if every_tokens < 1:
            raise ValueError(f"replicate_every must be positive, got {every_tokens}")
        self.coord = coordinator
        self.node_id = node_id
        self.every = every_tokens
        self.block_size = block_size
        self.pusher = pusher  # --replicate-to standby
        self.linger_s = 0.02  # a publish waits this long for the step's other records
        self.checkpointer = checkpointer  # --replicate-to s3
        self._tracked: dict[str, _Tracked] = {}  # session id → state (engine thread)
        # the newest job per session: (state, tokens covered, record, release)
        self._pending: dict[str, tuple[_Tracked, int, SessionRecord | None, bool]] = {}
        self._fenced: set[str] = set()
        self._inflight = 0  # records taken by the publisher, not yet answered
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self.num_published = 0
        self.num_errors = 0
        self.num_fenced = 0
        self.num_bytes = 0  # session records written (the KV blocks go through the store)
        self._thread = threading.Thread(target=self._run, name="kvserve-replicator", daemon=True)
        self._thread.start()

    # ---- engine thread -----------------------------------------------------------------
    def start(self, req: Request, seen_epoch: int | None = None, claim_now: bool = False) -> bool:
        """The request begins serving its session here: claim ownership (a new epoch;
        with ``seen_epoch``, only if the session is still at it). The claim is queued for
        the publisher (a refusal fences the session) unless ``claim_now``: then it is made
        here and False means another node won (Redis errors propagate)."""
        if req.session_id is None:
            return True
        t = _Tracked(req.session_id, seen_epoch, published_tokens=len(req.output_token_ids))
        if claim_now:
            t.epoch = self.coord.take_over(req.session_id, self.node_id, seen_epoch)
            if t.epoch is None:
                return False
        with self._lock:
            self._fenced.discard(req.session_id)
            if not claim_now:
                self._pending[req.session_id] = (t, t.published_tokens, None, False)
        self._tracked[req.session_id] = t
        if not claim_now:
            self._wake.set()
        return True

    def after_step(self, req: Request) -> None:
        """Queue the session's record every ``every_tokens`` tokens and at its end."""
        t = self._tracked.get(req.session_id or "")
        if t is None:
            return
        n = len(req.output_token_ids)
        first = n == 1 and t.published_tokens == 0  # right after the prompt: how it was computed
        due = n // self.every > t.published_tokens // self.every  # crossed a multiple of N
        if not (due or req.is_finished or first):
            return
        t.published_tokens = n
        release = req.is_finished and req.session_ephemeral  # nobody resumes it any more
        record = None if release else SessionRecord.of_request(req, self.block_size)
        with self._lock:
            self._pending[req.session_id] = (t, n, record, release)
        self._wake.set()
        if req.is_finished:
            self._tracked.pop(req.session_id, None)

    def any_fenced(self) -> bool:
        """Cheap per-step check before looking at individual sessions."""
        return bool(self._fenced)

    def fenced(self, session_id: str | None) -> bool:
        """True once another node took this session over (abort the request)."""
        with self._lock:
            return session_id in self._fenced

    def lag(self) -> dict[str, tuple[int, float]]:
        """Per tracked session: (tokens generated but not yet acknowledged by Redis,
        seconds since the last acknowledged publish)."""
        now = time.monotonic()
        return {
            s: (t.published_tokens - t.acked_tokens, now - t.acked_at)
            for s, t in list(self._tracked.items())
        }

    # ---- publisher thread --------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(0.5)
            self._wake.clear()
            with self._lock:  # claims go at once; records wait for the step's others
                linger = bool(self._pending) and all(
                    job[0].epoch is not None for job in self._pending.values()
                )
            if linger and self.linger_s:
                time.sleep(self.linger_s)
            with self._lock:
                jobs, self._pending = self._pending, {}
                self._inflight = len(jobs)
            if jobs:
                self._publish_all(list(jobs.values()))
            with self._lock:
                self._inflight = 0

    def _claim(self, t: _Tracked) -> int | None:
        """Take the session over for this node (publisher thread). A concurrent request of
        the same session on this same node may have moved the epoch: then re-claim."""
        epoch = self.coord.take_over(t.session, self.node_id, t.seen_epoch)
        if epoch is None:
            own = self.coord.owner(t.session)
            if own is not None and own.node == self.node_id:
                epoch = self.coord.take_over(t.session, self.node_id, own.epoch)
        return epoch

    def _publish_all(self, jobs: list[tuple[_Tracked, int, SessionRecord | None, bool]]) -> None:
        """Claims and releases one by one (once per request), then every record in one
        pipelined round trip of fenced writes."""
        writes = []
        for job in jobs:
            t, n, record, release = job
            try:
                if t.epoch is None:
                    epoch = self._claim(t)
                    if epoch is None:
                        self._fence(t, "its claim was refused")
                        continue
                    t.epoch = epoch
                if release:
                    self.coord.release(t.session, self.node_id, t.epoch)
                elif record is not None:
                    data = record.with_epoch(t.epoch).to_json()
                    writes.append((job, data))
            except Exception as e:  # Redis unavailable: keep it for the next round
                self._retry_later(job, e)
        if not writes:
            return
        try:
            oks = self.coord.write_states(
                [(job[0].session, self.node_id, job[0].epoch, data) for job, data in writes]
            )
        except Exception as e:
            for job, _ in writes:
                self._retry_later(job, e)
            return
        for ((t, n, record, _), data), ok in zip(writes, oks, strict=True):
            if not ok:
                self._fence(t, f"taken over (epoch > {t.epoch})")
                continue
            self.num_published += 1
            self.num_bytes += len(data)
            t.acked_tokens, t.acked_at = max(t.acked_tokens, n), time.monotonic()
            self._after_publish(t, record)

    def _retry_later(self, job: tuple, e: Exception) -> None:
        self.num_errors += 1
        logger.warning("replication of session %s failed: %s", job[0].session, e)
        with self._lock:
            self._pending.setdefault(job[0].session, job)
        time.sleep(0.1)

    def _after_publish(self, t: _Tracked, record: SessionRecord) -> None:
        """Checkpoint (``--replicate-to s3``) and tell or feed the standby; best effort."""
        if self.checkpointer is not None:
            self.checkpointer.offer(t.session, record.with_epoch(t.epoch))
        standby = record.standby
        if standby and standby != self.node_id:
            try:  # the standby only starts colder if this fails
                if self.pusher is not None:
                    self.pusher.push(t.session, t.epoch, record)
                elif not record.finished:
                    self.coord.notify_standby(standby, t.session)
            except Exception as e:
                logger.debug("standby update for %s failed: %s", t.session, e)

    def _fence(self, t: _Tracked, why: str) -> None:
        """Another node owns ``t``'s session: its request here must stop — unless a newer
        request of the same session on this node moved the epoch (a later turn or a
        resume here), then only ``t``'s stale record is dropped."""
        current = self._tracked.get(t.session)
        if current is not None and current is not t:
            logger.info("session %s: a stale record (epoch %s) dropped", t.session, t.epoch)
            return
        logger.warning("session %s fenced on %s: %s", t.session, self.node_id, why)
        self.num_fenced += 1
        with self._lock:
            self._fenced.add(t.session)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued record was written (or refused); True if so."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if not self._pending and not self._inflight:
                    return True
            if time.monotonic() > deadline:
                return False
            self._wake.set()
            time.sleep(0.01)

    def close(self) -> None:
        self.flush(5.0)
        self._stop = True
        self._wake.set()
        self._thread.join(5.0)
        if self.pusher is not None:
            self.pusher.close()
