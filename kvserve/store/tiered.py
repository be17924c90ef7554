"""An ordered stack of KV stores: host RAM → local disk → Redis → S3.

- **Reads** go tier by tier. ``lookup(keys)`` returns how many leading blocks exist
  anywhere: each tier extends the run the tiers above it found. ``get(keys)`` fetches
  every key from the first tier that has it and promotes hits into the tiers above.
- **Writes** go to the first tier synchronously and to the lower tiers through one bounded
  queue drained by a writer thread: ``write-through`` queues every put for every lower
  tier; ``write-back`` queues a block only when the first tier evicts it. When the queue is
  full the write is dropped and counted — decoding never waits for a slow tier.
- **Faults**: a tier raising ``StoreUnavailable`` (or anything else: a backend bug must
  not fail requests either) opens its circuit breaker: it is skipped (reads miss, writes
  are dropped, both counted) until a probe succeeds. Probes run on the writer thread —
  its next write to the tier, or a one-key lookup (a one-key write when a write had
  failed) when there is none — once per backoff
  that doubles on each consecutive failure (0.5 s → 2 s), so only the one call that
  found a tier down ever waits on it (its timeout); recovery follows within a backoff.
- **Metrics** per tier come from this wrapper, not from the backends: hits, misses, bytes
  read/written, errors, latency histograms, dropped writes, corrupt blocks (reported by
  the reader through ``record_corrupt``), queue depth.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.store.base import Key, KVStore, StoreUnavailable
from kvserve.store.host import HostStore

logger = logging.getLogger("kvserve")

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
WRITE_POLICIES = ("write-through", "write-back")
_SKIPPED = object()  # a tier call that did not happen or failed
_PROBE_KEY = b"kvserve-probe"  # looked up (or written empty) to see whether a tier is back


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0
    dropped_writes: int = 0
    corrupt: int = 0
    latency_counts: dict[str, list[int]] = field(default_factory=dict)  # op → bucket counts
    latency_sums: dict[str, float] = field(default_factory=dict)

    def observe(self, op: str, seconds: float) -> None:
        counts = self.latency_counts.setdefault(op, [0] * (len(LATENCY_BUCKETS) + 1))
        i = next((i for i, b in enumerate(LATENCY_BUCKETS) if seconds <= b), len(LATENCY_BUCKETS))
        counts[i] += 1
        self.latency_sums[op] = self.latency_sums.get(op, 0.0) + seconds


class _Breaker:
    """A tier's circuit: closed while it works; opened by a failure, after which only a
    probe may call the tier, once per backoff (doubling per consecutive failure, up to
    ``cap``); a probe's success closes it."""

    def __init__(self, base: float = 0.5, cap: float = 2.0):
        self.base, self.cap = base, cap
        self.failures = 0
        self.open_until = 0.0
        self.writes_failed = False  # since it opened

    @property
    def is_open(self) -> bool:
        return self.failures > 0

    def probe_due(self) -> bool:
        return self.failures > 0 and time.monotonic() >= self.open_until

    def failed(self, write: bool) -> None:
        """A call failed; ``write``: it was a write (then probes write too: a tier that
        answers reads but refuses writes must not be closed by a read)."""
        self.writes_failed = self.writes_failed or write
        self.failures += 1
        self.open_until = time.monotonic() + min(self.base * 2 ** (self.failures - 1), self.cap)

    def succeeded(self) -> None:
        self.failures = 0
        self.open_until = 0.0
        self.writes_failed = False


class TieredStore:
    """Tiers in order, fastest first. Thread-safe for one reader plus its writer thread."""

    def __init__(
        self,
        tiers: Sequence[KVStore],
        *,
        write_policy: str = "write-through",
        queue_size: int = 1024,
        linger_s: float = 0.05,
    ):
        """``linger_s``: how long the writer waits after a first queued job for more, to
        write them together (lower tiers see a write that much later)."""
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        self.tiers = list(tiers)
        self.write_policy = write_policy
        self.linger_s = linger_s
        self.stats = [TierStats() for _ in self.tiers]
        self._breakers = [_Breaker() for _ in self.tiers]
        # (tier indices, items) jobs for the writer thread
        self._queue: queue.Queue[tuple[tuple[int, ...], list[tuple[Key, bytes]]] | None] = (
            queue.Queue(queue_size)
        )
        self._closed = False
        self._writer: threading.Thread | None = None
        if len(self.tiers) > 1:
            if write_policy == "write-back":
                top = self.tiers[0]
                if not isinstance(top, HostStore):
                    raise ValueError("write-back needs a host:// first tier")
                top.on_evict = lambda k, v: self._enqueue(self._below(0), [(k, v)])
            self._writer = threading.Thread(target=self._drain, name="kvstore-writer", daemon=True)
            self._writer.start()

    # ---- one tier, guarded --------------------------------------------------------------
    def _call(self, i: int, op: str, fn, *args, probe: bool = False):
        """Run ``fn`` on tier ``i`` unless its breaker is open; ``_SKIPPED`` on failure/skip.
        While it is open only a due probe runs: ``probe`` (the writer thread's calls) —
        or any call when there is no writer thread — so requests never wait on a tier
        known to be down, only the call that found it down does."""
        br = self._breakers[i]
        if br.is_open and not (br.probe_due() and (probe or self._writer is None)):
            return _SKIPPED
        t0 = time.perf_counter()
        try:
            result = fn(*args)
        except Exception as e:  # any tier failure degrades to "not there", never further
            self.stats[i].errors += 1
            was_open = br.failures > 0
            br.failed(write=op in ("put", "delete", "probe-put"))
            if not was_open and self._writer is not None:
                with contextlib.suppress(queue.Full):  # wake the writer: it probes
                    self._queue.put_nowait(((), []))
            if not was_open:
                if isinstance(e, StoreUnavailable):
                    logger.warning("KV store tier %s unavailable: %s", self.tiers[i].name, e)
                else:
                    logger.exception("KV store tier %s failed", self.tiers[i].name)
            return _SKIPPED
        self.stats[i].observe(op, time.perf_counter() - t0)
        if br.failures:
            logger.info("KV store tier %s is back", self.tiers[i].name)
        br.succeeded()
        return result

    # ---- reads --------------------------------------------------------------------------
    def lookup(self, keys: Sequence[Key]) -> int:
        """How many leading ``keys`` some tier holds (tiers below extend the run)."""
        found = 0
        for i, tier in enumerate(self.tiers):
            if found == len(keys):
                break
            n = self._call(i, "contains", tier.contains, keys[found:])
            found += 0 if n is _SKIPPED else n
        return found

    def get(self, keys: Sequence[Key], promote: bool = True) -> list[bytes | None]:
        """Values of ``keys`` from the first tier holding each; hits below the first tier
        are written into the tiers above them (promotion) — unless ``promote`` is False
        (a record another node may delete: a copy here would outlive it)."""
        out: list[bytes | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        for i, tier in enumerate(self.tiers):
            if not missing:
                break
            values = self._call(i, "get", tier.get, [keys[j] for j in missing])
            if values is _SKIPPED:
                continue
            still = []
            promote_items = []
            for j, v in zip(missing, values, strict=True):
                if v is None:
                    still.append(j)
                    continue
                out[j] = v
                self.stats[i].hits += 1
                self.stats[i].bytes_read += len(v)
                promote_items.append((keys[j], v))
            self.stats[i].misses += len(still)
            if promote and promote_items and i > 0:
                for up in range(i):
                    if up == 0:
                        self._put_first(promote_items)
                    else:
                        self._enqueue((up,), promote_items)
            missing = still
        return out

    def get_each(self, key: Key) -> list[bytes]:
        """``key``'s value in every tier holding it, first tier first, nothing promoted:
        for a record that changes (a session's), whose copy in a node's own tier may be
        older than the shared one — the reader picks the newest."""
        out = []
        for i, tier in enumerate(self.tiers):
            values = self._call(i, "get", tier.get, [key])
            if values is not _SKIPPED and values[0] is not None:
                out.append(values[0])
        return out

    def record_corrupt(self, key: Key) -> None:
        """The reader found ``key``'s value unusable: count it and drop it everywhere."""
        self.stats[0].corrupt += 1
        for i, tier in enumerate(self.tiers):
            self._call(i, "delete", tier.delete, [key])

    # ---- writes -------------------------------------------------------------------------
    def put(self, items: Sequence[tuple[Key, bytes]]) -> None:
        """First tier now; lower tiers through the queue (write-through) or on eviction
        from the first tier (write-back). Never blocks on a lower tier."""
        items = list(items)
        self._put_first(items)
        if self.write_policy == "write-through" and len(self.tiers) > 1:
            self._enqueue(self._below(0), items)

    def put_now(self, items: Sequence[tuple[Key, bytes]]) -> None:
        """Every tier, synchronously (small records another node must read at once, not
        blocks): a tier that fails or is skipped drops them (counted), as the queue would."""
        items = list(items)
        self._put_first(items)
        for i in self._below(0):
            if self._call(i, "put", self.tiers[i].put, items) is _SKIPPED:
                self.stats[i].dropped_writes += len(items)
            else:
                self.stats[i].bytes_written += sum(len(v) for _, v in items)

    def _put_first(self, items: list[tuple[Key, bytes]]) -> None:
        if self._call(0, "put", self.tiers[0].put, items) is _SKIPPED:
            self.stats[0].dropped_writes += len(items)
        else:
            self.stats[0].bytes_written += sum(len(v) for _, v in items)

    def _below(self, tier: int) -> tuple[int, ...]:
        return tuple(range(tier + 1, len(self.tiers)))

    def put_to(self, tier: int, items: Sequence[tuple[Key, bytes]]) -> None:
        """Queue ``items`` for the lower tier ``tier`` only (the writer thread writes them);
        a full queue drops them (counted)."""
        self._enqueue((tier,), list(items))

    def _enqueue(self, targets: tuple[int, ...], items: list[tuple[Key, bytes]]) -> None:
        """Queue ``items`` for tiers ``targets``; a full queue drops them (counted)."""
        if self._writer is None or self._closed or not targets:
            return
        try:
            self._queue.put_nowait((targets, items))
        except queue.Full:
            for i in targets:
                self.stats[i].dropped_writes += len(items)

    def _drain(self) -> None:
        """Writer thread. Takes every job queued by now and writes them as one batch per
        tier: fewer, larger round trips (each costs a few GIL hand-offs with the engine
        thread, which matter more than the bytes), within ``linger_s`` of the first."""
        while True:
            try:  # while a tier is down, wake up to probe it even without writes
                wait = 0.1 if any(b.is_open for b in self._breakers) else None
                jobs = [self._queue.get(timeout=wait)]
            except queue.Empty:
                self._probe()
                continue
            if jobs[0] is not None and self.linger_s:
                time.sleep(self.linger_s)
            while jobs[-1] is not None:
                try:
                    jobs.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                # one value per key and tier, the newest: a batch's puts may run in
                # parallel (S3), so two writes of one key must not race each other
                batches: dict[int, dict[Key, bytes]] = {}
                for job in jobs:
                    if job is not None:
                        for i in job[0]:
                            batches.setdefault(i, {}).update(job[1])
                for i, newest in sorted(batches.items()):
                    items = list(newest.items())
                    if self._call(i, "put", self.tiers[i].put, items, probe=True) is _SKIPPED:
                        self.stats[i].dropped_writes += len(items)
                    else:
                        self.stats[i].bytes_written += sum(len(v) for _, v in items)
            finally:
                for _ in jobs:
                    self._queue.task_done()
            if jobs[-1] is None:
                return

    def _probe(self) -> None:
        """Writer thread: call each open tier whose probe is due — a one-key lookup, or a
        one-key write of an empty value when a write failed; a success closes its
        breaker."""
        for i, tier in enumerate(self.tiers):
            br = self._breakers[i]
            if not br.probe_due():
                continue
            if br.writes_failed:
                self._call(i, "probe-put", tier.put, [(_PROBE_KEY, b"")], probe=True)
            else:
                self._call(i, "probe", tier.contains, [_PROBE_KEY], probe=True)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait (at most ``timeout`` s) until queued writes are done; True if they are."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    # ---- other --------------------------------------------------------------------------
    def delete(self, keys: Sequence[Key]) -> None:
        for i, tier in enumerate(self.tiers):
            self._call(i, "delete", tier.delete, list(keys))

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def breaker_open(self, tier: int) -> bool:
        return self._breakers[tier].is_open

    def close(self) -> None:
        """Finish queued writes (bounded), stop the writer, close every tier."""
        if self._closed:
            return
        self.flush(10.0)
        self._closed = True
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(10.0)
        for t in self.tiers:
            t.close()
