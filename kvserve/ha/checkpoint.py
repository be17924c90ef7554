"""Session checkpoints in the S3 tier (``--replicate-to s3``), for setups that span sites.

The coordinator's Redis is one site's system of record; another site has its own. With
``--replicate-to s3`` the primary also writes each session's record — at most every
``--checkpoint-interval`` seconds while it runs, and when it finishes — to the KV store's
S3 tier, next to the session's blocks (which reach S3 through the tier's write-through).
A worker anywhere that reads the same bucket can then continue the session from S3: when
its own Redis has no record, ``/internal/resume`` falls back to the checkpoint (slower
recovery: S3 round trips, and up to one interval of tokens recomputed).

Checkpoints are written through the tiered store's bounded writer queue, never on the
engine's step path. The object key is derived from the session id (a 16-byte BLAKE2b of
it, in the tier's own key layout); the value is the record's JSON.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict

from kvserve.ha.record import SessionRecord
from kvserve.store.tiered import TieredStore


def checkpoint_key(session_id: str) -> bytes:
    name = f"kvserve-session-checkpoint|{session_id}".encode()
    return hashlib.blake2b(name, digest_size=16).digest()


class Checkpointer:
    def __init__(self, store: TieredStore, interval: float):
        names = [t.name for t in store.tiers]
        if "s3" not in names:
            raise ValueError("--replicate-to s3 needs an s3:// --kv-store tier")
        if interval < 0:
            raise ValueError(f"checkpoint_interval must be >= 0, got {interval}")
        self.store = store
        self.tier = names.index("s3")
        self.interval = interval
        self._last: OrderedDict[str, float] = OrderedDict()  # session → last write
        self.num_written = 0

    def offer(self, session: str, record: SessionRecord) -> bool:
        """Queue ``record`` as the session's checkpoint if one is due (interval elapsed,
        or the turn finished); True if queued."""
        now = time.monotonic()
        last = self._last.get(session)
        if not record.finished and last is not None and now - last < self.interval:
            return False
        self._last[session] = now
        self._last.move_to_end(session)
        while len(self._last) > 65536:
            self._last.popitem(last=False)
        data = record.to_json()
        self.store.put_to(self.tier, [(checkpoint_key(session), data)])
        self.num_written += 1
        return True

    def read(self, session: str) -> SessionRecord | None:
        """The session's last checkpoint in S3, or None (none, unreadable, or S3 down)."""
        try:
            [data] = self.store.tiers[self.tier].get([checkpoint_key(session)])
        except Exception:
            return None
        if data is None:
            return None
        try:
            record = SessionRecord.from_json(data)
        except ValueError:  # foreign or corrupt: a miss
            return None
        return record if record.session_id == session else None
