"""``host://?capacity=8GiB``: a bounded in-process LRU of serialized blocks (the first
tier, always there). ``on_evict`` sees every value pushed out, so a write-back tiered
store can hand it to the tiers below before it is gone; ``events`` (optional) hears of
every key stored and removed, in the order the changes happen (``kv.events``)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvserve.kv.events import HOST, KVEventLog
from kvserve.store.base import Key, KVStore, count_leading


class HostStore(KVStore):
    name = "host"

    def __init__(
        self,
        capacity_bytes: int,
        on_evict: Callable[[Key, bytes], None] | None = None,
        events: KVEventLog | None = None,
    ):
        """``events``: the log of keys stored and removed (KV events), None when none is
        published."""
        if capacity_bytes <= 0:
            raise ValueError(f"host store capacity must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.on_evict = on_evict
        self.num_evictions = 0
        self.events = events
        self._data: OrderedDict[Key, bytes] = OrderedDict()
        self._lock = threading.Lock()  # the tiered store's writer thread shares it

    def contains(self, keys: Sequence[Key]) -> int:
        with self._lock:
            return count_leading(keys, self._data.__contains__)

    def get(self, keys: Sequence[Key]) -> list[bytes | None]:
        with self._lock:
            out = []
            for k in keys:
                v = self._data.get(k)
                if v is not None:
                    self._data.move_to_end(k)
                out.append(v)
            return out

    def put(self, items: Sequence[tuple[Key, bytes]]) -> None:
        evicted = []
        with self._lock:
            events = self.events
            for k, v in items:
                if len(v) > self.capacity_bytes:
                    continue  # could never fit
                old = self._data.pop(k, None)
                if old is not None:
                    self.used_bytes -= len(old)
                elif events is not None:
                    events.stored(HOST, (k,))
                self._data[k] = v
                self.used_bytes += len(v)
                while self.used_bytes > self.capacity_bytes:
                    ek, ev = self._data.popitem(last=False)
                    self.used_bytes -= len(ev)
                    self.num_evictions += 1
                    evicted.append((ek, ev))
                    if events is not None:
                        events.removed(HOST, (ek,))
        if self.on_evict is not None:
            for ek, ev in evicted:
                self.on_evict(ek, ev)

    def delete(self, keys: Sequence[Key]) -> None:
        with self._lock:
            for k in keys:
                v = self._data.pop(k, None)
                if v is not None:
                    self.used_bytes -= len(v)
                    if self.events is not None:
                        self.events.removed(HOST, (k,))

    def keys(self) -> list[Key]:
        """The keys held now."""
        with self._lock:
            return list(self._data)

    def __len__(self) -> int:
        return len(self._data)
