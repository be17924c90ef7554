"""The router's prefix index: which block hashes each worker holds, from its KV events.

One ``WorkerKV`` per worker that publishes events (``server.kv_events``): the hashes of
its device pool and host tier, the publisher ``instance`` and the ``seq`` of the last
batch applied. It is *synced* after a snapshot; batches then apply in order. A batch
whose ``seq`` skips one, a new ``instance`` or a lossy clear marks the worker unsynced:
the caller fetches a snapshot (``KVSync``), batches arriving meanwhile are kept and the
ones after the snapshot's ``seq`` applied on top of it. An unsynced worker matches
nothing — the router then places by load alone, never on a guess.

``match`` walks a request's chained block hashes (computed here from its token ids with
the worker's own root keys, ``kv.hashing``) and counts the leading blocks the worker can
serve: first from its device pool, then from its host tier (a prefix is only useful up to
its first miss).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.kv.events import DEVICE, HOST, TIERS, apply
from kvserve.server.kv_events import KVEventBatch, KVSnapshot

_MAX_PENDING = 10_000  # batches kept while a snapshot is on its way


@dataclass
class WorkerKV:
    instance: str | None = None
    seq: int = 0
    synced: bool = False
    held: dict[str, set[bytes]] = field(default_factory=lambda: {t: set() for t in TIERS})
    pending: list[KVEventBatch] = field(default_factory=list)


@dataclass(frozen=True)
class Match:
    """Leading blocks of a request a worker holds: ``device`` in its pool, then ``host``
    more in its host tier."""

    device: int = 0
    host: int = 0


class PrefixIndex:
    def __init__(self) -> None:
        self.workers: dict[str, WorkerKV] = {}
        self.num_resyncs = 0

    def on_batch(self, batch: KVEventBatch) -> bool:
        """Apply one batch (changes the index). Returns True when the worker needs a
        snapshot (unknown, restarted, a batch was lost, detail was lost)."""
        w = self.workers.setdefault(batch.node, WorkerKV())
        if not w.synced:  # a snapshot is needed (or on its way): keep the batch for it
            if batch.events and len(w.pending) < _MAX_PENDING:
                w.pending.append(batch)
            return True
        if batch.instance != w.instance:  # the worker restarted
            return self._lost(w, batch)
        if not batch.events:  # a keepalive: it names the publisher's last seq
            return self._lost(w, None) if batch.seq > w.seq else False
        if batch.seq <= w.seq:  # the snapshot already had it
            return False
        if batch.seq != w.seq + 1:
            return self._lost(w, batch)
        w.seq = batch.seq
        if not apply(w.held, batch.events):
            return self._lost(w, None)
        return False

    def _lost(self, w: WorkerKV, batch: KVEventBatch | None) -> bool:
        w.synced = False
        w.pending = [batch] if batch is not None and batch.events else []
        self.num_resyncs += 1
        return True

    def mark_unsynced(self, node: str) -> None:
        """Forget what is known of ``node`` until its next snapshot."""
        w = self.workers.setdefault(node, WorkerKV())
        w.synced, w.pending = False, []

    def load_snapshot(self, snap: KVSnapshot) -> bool:
        """Replace what is known of ``snap.node`` with ``snap`` and the batches kept since
        that follow it. Returns False (still unsynced) when those batches have a gap."""
        w = self.workers.setdefault(snap.node, WorkerKV())
        w.instance, w.seq = snap.instance, snap.seq
        w.held = {t: set(snap.tiers.get(t, ())) for t in TIERS}
        later = sorted(
            (b for b in w.pending if b.instance == snap.instance and b.seq > snap.seq),
            key=lambda b: b.seq,
        )
        w.pending, w.synced = [], True
        return all(not self.on_batch(b) for b in later)  # (stops at the first gap)

    def forget(self, node: str) -> None:
        self.workers.pop(node, None)

    def is_synced(self, node: str) -> bool:
        w = self.workers.get(node)
        return w is not None and w.synced

    def match(self, node: str, hashes: Sequence[bytes]) -> Match:
        """How many leading ``hashes`` ``node`` serves from its pool, then its host tier
        (nothing for a worker that is not synced)."""
        w = self.workers.get(node)
        if w is None or not w.synced:
            return Match()
        device, host = w.held[DEVICE], w.held[HOST]
        d = 0
        while d < len(hashes) and hashes[d] in device:
            d += 1
        h = d
        while h < len(hashes) and (hashes[h] in host or hashes[h] in device):
            h += 1
        return Match(d, h - d)

    def sizes(self, node: str) -> dict[str, int]:
        w = self.workers.get(node)
        return {t: len(w.held[t]) if w else 0 for t in TIERS}
