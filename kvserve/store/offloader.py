"""The engine's side of the KV store: which blocks to save, find and fetch stored prefixes.
It touches no KV tensor: block bytes move in and out of the cache in the worker
(``worker.offload.KVTransfer``).

- ``saves_for(requests)`` (after each step): the blocks of those requests that became
  full, as ``KVSave`` items for the worker to serialize and store. Blocks the host tier
  already holds are skipped (a shared prefix is stored once).
- ``lookup(request, start)``: how many blocks after the device-pool hits the store holds
  (leading, across tiers).
- ``start_load(request, blocks)``: fetch and check those blocks on a loader thread (bytes
  only); the request waits in the scheduler's loading set meanwhile, other requests keep
  running.
- ``poll()`` (before scheduling): finished fetches as ``KVLoad`` items — the payload rows
  of the leading blocks that checked out. A block that is missing, corrupt, foreign or
  fails to load ends the run there (counted; the store drops it): the request computes
  the rest. The worker copies the rows into the device blocks before the step runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.kv.hybrid_prefix import group_hash
from kvserve.kv.manager import KVCacheManager
from kvserve.request import Request
from kvserve.store import serde
from kvserve.store.host import HostStore
from kvserve.store.sessions import SessionStore
from kvserve.store.tiered import TieredStore

logger = logging.getLogger("kvserve")

_FETCH_CHUNK = 32  # blocks per store round trip when loading


@dataclass(frozen=True)
class KVSave:
    """A full block to store: its key (chained hash), its device page in each KV group
    (one block when uniform: model/kv_groups.py) and token ids. Stored blocks hold every layer
    in layer order whatever the layout, so either layout reads them."""

    key: bytes
    pages: tuple[int, ...]
    tokens: list[int]


@dataclass(frozen=True)
class KVLoad:
    """Fetched payload ``rows`` ([n, payload bytes], uint8, host) for the first n of a
    request's logical ``blocks``; with ``groups`` > 1 (the hybrid layout) ``blocks`` holds
    each group's pages in turn, ``len(blocks) // groups`` a group."""

    request_id: str
    blocks: list[int]
    rows: torch.Tensor
    groups: int = 1


@dataclass
class _Load:
    request: Request
    blocks: list[int]  # device blocks to fill, in order (each group's in turn)
    future: Future


class KVOffloader:
    def __init__(
        self,
        store: TieredStore,
        kv: KVCacheManager,
        block_format: Callable[[], serde.BlockFormat],
        session_ttl: float = 86400.0,
    ):
        self.store = store
        self.sessions = SessionStore(store, session_ttl)
        self.kv = kv
        self.block_size = kv.block_size
        self.block_format = block_format  # the worker's (KVTransfer.block_format)
        self._saved: dict[str, int] = {}  # request id → leading blocks already offered
        self._loads: dict[str, _Load] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-loader")
        self.num_loaded_blocks = 0
        self.num_saved_blocks = 0
        self.num_load_failures = 0

    @property
    def host(self) -> HostStore:
        """The first tier, in host memory (``open_tiered`` always puts one there)."""
        host = self.store.tiers[0]
        assert isinstance(host, HostStore), "the first KV store tier is host://"
        return host

    def _tokens(self, request: Request, i: int) -> list[int]:
        return request.token_slice(i * self.block_size, (i + 1) * self.block_size)

    # ---- saving ------------------------------------------------------------------------
    def saves_for(self, requests: Sequence[Request]) -> list[KVSave]:
        """The newly full blocks of ``requests`` (this step's) not in the host tier yet;
        they count as offered from now on."""
        null = self.kv.pool.null_block
        host = self.host
        todo: list[KVSave] = []
        for request in requests:
            rid = request.request_id
            full = request.num_computed_tokens // self.block_size
            done = self._saved.get(rid, 0)
            if full <= done:
                continue
            tables = self.kv.block_tables(rid)
            hashes = self.kv.block_hashes(request, full)
            self._saved[rid] = full
            for i in range(done, full):
                pages = tuple(t[i] for t in tables)
                if null not in pages and not host.contains([hashes[i]]):
                    todo.append(KVSave(hashes[i], pages, self._tokens(request, i)))
        self.num_saved_blocks += len(todo)
        return todo

    def record_session(self, request: Request) -> None:
        """Record a finished turn of ``request.session_id`` (its tokens and blocks)."""
        if request.session_id is None:
            return
        n = request.num_computed_tokens // self.block_size
        self.sessions.record(
            request.tenant,
            request.session_id,
            request.token_slice(0, request.num_tokens),
            self.kv.compute_block_hashes(request, n),
        )

    def forget(self, request: Request) -> None:
        """The request left the engine; drop its bookkeeping (a pending load is ignored)."""
        self._saved.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)

    # ---- loading -----------------------------------------------------------------------
    def lookup(self, request: Request, start: int) -> int:
        """Stored blocks after the request's first ``start`` blocks (at least one token is
        always left to compute)."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks <= start:
            return 0
        hashes = self.kv.block_hashes(request, max_blocks)
        return self.store.lookup(hashes[start:])

    def start_load(self, request: Request, start: int, blocks: list[int]) -> None:
        """Fetch blocks ``start …`` of the request into ``blocks`` (in the hybrid layout
        each group's new pages in turn, as ``allocate_slots`` returns them)."""
        n = len(blocks) // len(self.kv.windows)
        hashes = self.kv.block_hashes(request, start + n)[start:]
        tokens = [self._tokens(request, start + j) for j in range(n)]
        fut = self._pool.submit(self._fetch, self.block_format(), hashes, tokens)
        self._loads[request.request_id] = _Load(request, blocks, fut)

    def _fetch(self, fmt, hashes, tokens) -> torch.Tensor:
        """Loader thread: payload rows of the leading blocks that check out, fetched in
        chunks (a smaller reply at a time reads faster) and copied once, into one buffer;
        stops at the first block that is missing or does not check out."""
        rows = torch.empty(len(hashes), fmt.payload_bytes, dtype=torch.uint8)
        n = 0
        for start in range(0, len(hashes), _FETCH_CHUNK):
            keys = hashes[start : start + _FETCH_CHUNK]
            for key, value in zip(keys, self.store.get(keys), strict=True):
                if value is None:
                    return rows[:n]
                payload = serde.check(fmt, key, value, tokens[n])
                if isinstance(payload, str):
                    logger.warning("KV block %s unusable (%s): recomputing", key.hex(), payload)
                    self.store.record_corrupt(key)
                    return rows[:n]
                rows[n].numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
                n += 1
        return rows[:n]

    def poll(self, wait: bool = False) -> list[tuple[Request, KVLoad]]:
        """Finished fetches: (request, its load — ``rows`` leading blocks checked out)."""
        done = []
        for rid, load in list(self._loads.items()):
            if not (wait or load.future.done()):
                continue
            del self._loads[rid]
            try:
                rows = load.future.result()
            except Exception:  # a store bug must not kill the engine: recompute instead
                logger.exception("KV store load failed; recomputing")
                rows = torch.empty(0, 0, dtype=torch.uint8)
            n, groups = rows.shape[0], len(self.kv.windows)
            if n < len(load.blocks) // groups:
                self.num_load_failures += 1
            self.num_loaded_blocks += n
            done.append((load.request, KVLoad(rid, load.blocks, rows, groups)))
        return done

    # ---- pre-warm ------------------------------------------------------------------------
    def place_warm(self, items: Sequence[tuple[bytes, list[int], memoryview]]) -> KVLoad | None:
        """Verified blocks (hash, token ids, payload) pushed from another worker, placed
        into free device blocks as pre-warmed prefix blocks (``BlockPool.place_warm``; in
        the hybrid layout a page in each group, named as prefix caching names it): the
        copy of their rows into those blocks, for the next step (None: none placed —
        pre-warm off, already cached, or no room)."""
        groups = len(self.kv.windows)
        pages: list[list[int]] = [[] for _ in range(groups)]
        payloads = []
        for key, tokens, payload in items:
            names = [group_hash(key, g) for g in range(groups)]
            placed = self.kv.pool.place_warm_pages(names, tokens)
            if placed is not None:
                for group, b in zip(pages, placed, strict=True):
                    group.append(b)
                payloads.append(np.frombuffer(payload, dtype=np.uint8))
        if not payloads:
            return None
        blocks = [b for group in pages for b in group]  # each group's pages in turn
        return KVLoad("pre-warm", blocks, torch.from_numpy(np.stack(payloads)), groups)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.store.close()
