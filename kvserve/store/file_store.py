"""``file:///path?capacity=100GiB``: a bounded on-disk LRU that survives restarts.

One file per block, ``<root>/<first key byte as hex>/<key hex>.kvb``, written to a
temporary name and renamed, so a crash never leaves a half-written block under a real
name (a torn file would still fail the block checksum and be a miss). At start the index
is rebuilt from the directory, oldest modification time first; a hit refreshes the file's
mtime, so recency survives a restart too. When the total passes ``capacity`` the least
recently used files are deleted. A full disk (``ENOSPC``, or a quota) drops the block
being written and lowers the capacity to what the disk held: a logged warning and later
misses, never an error to a request.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from kvserve.store.base import Key, KVStore, count_leading

_SUFFIX = ".kvb"
logger = logging.getLogger("kvserve")


class FileStore(KVStore):
    name = "file"

    def __init__(self, root: str | Path, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"file store capacity must be positive, got {capacity_bytes}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.num_evictions = 0
        self.num_dropped = 0  # blocks the disk had no room for
        self._lock = threading.Lock()
        self._index: OrderedDict[Key, int] = OrderedDict()  # key → size, LRU first
        self._load_index()

    def _path(self, key: Key) -> Path:
        h = key.hex()
        return self.root / h[:2] / (h + _SUFFIX)

    def _load_index(self) -> None:
        found = []
        for sub in self.root.iterdir():
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                if f.name.endswith(".tmp"):
                    f.unlink(missing_ok=True)  # an interrupted write
                    continue
                if not f.name.endswith(_SUFFIX):
                    continue
                try:
                    st = f.stat()
                    key = bytes.fromhex(f.name[: -len(_SUFFIX)])
                except (OSError, ValueError):
                    continue
                found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self.used_bytes += size
        self._evict()

    def contains(self, keys: Sequence[Key]) -> int:
        with self._lock:
            return count_leading(keys, self._index.__contains__)

    def get(self, keys: Sequence[Key]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for k in keys:
            with self._lock:
                present = k in self._index
                if present:
                    self._index.move_to_end(k)
            if not present:
                out.append(None)
                continue
            path = self._path(k)
            try:
                data = path.read_bytes()
                os.utime(path)
            except OSError:  # deleted behind our back: forget it
                with self._lock:
                    size = self._index.pop(k, None)
                    if size is not None:
                        self.used_bytes -= size
                data = None
            out.append(data)
        return out

    def put(self, items: Sequence[tuple[Key, bytes]]) -> None:
        for k, v in items:
            if len(v) > self.capacity_bytes:
                continue
            path = self._path(k)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            try:
                path.parent.mkdir(exist_ok=True)
                tmp.write_bytes(v)
                os.replace(tmp, path)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                self._disk_full(len(v))
                continue
            with self._lock:
                old = self._index.pop(k, None)
                if old is not None:
                    self.used_bytes -= old
                self._index[k] = len(v)
                self.used_bytes += len(v)
                self._evict()

    def _disk_full(self, size: int) -> None:
        """The disk (or quota) had no room for a block of ``size`` bytes: the block is
        dropped (a miss later, never an error, counted in ``num_dropped``) and the capacity
        is lowered to what the disk held less one such block (at least one block), so the
        tier goes on as an LRU of that size (until a restart)."""
        with self._lock:  # never below one block: other files may free the disk later
            lowered = max(self.used_bytes - size, size)
            if lowered < self.capacity_bytes:
                log = logger.debug if self.num_dropped else logger.warning  # once loud
                log(
                    "file KV store %s: the disk is full at %d bytes of blocks; capacity "
                    "lowered from %d to %d bytes (a restart restores it)",
                    self.root,
                    self.used_bytes,
                    self.capacity_bytes,
                    lowered,
                )
                self.capacity_bytes = lowered
                self._evict()
            self.num_dropped += 1

    def _evict(self) -> None:
        while self.used_bytes > self.capacity_bytes and self._index:
            k, size = self._index.popitem(last=False)
            self.used_bytes -= size
            self.num_evictions += 1
            self._path(k).unlink(missing_ok=True)

    def delete(self, keys: Sequence[Key]) -> None:
        for k in keys:
            with self._lock:
                size = self._index.pop(k, None)
                if size is None:
                    continue
                self.used_bytes -= size
            self._path(k).unlink(missing_ok=True)

    def __len__(self) -> int:
        return len(self._index)
