"""The engine's side of the KV store: save full blocks, find and load stored prefixes.

- ``save(requests)`` (after each step): every block of those requests that became full is
  serialized (``store.serde``: header + checksum + token ids) and put into the tiered
  store — synchronously into the host tier, asynchronously below it. Blocks the host tier
  already holds are skipped (a shared prefix is stored once).
- ``lookup(request, start)``: how many blocks after the device-pool hits the store holds
  (leading, across tiers).
- ``start_load(request, blocks)``: fetch and decode those blocks on a loader thread; the
  request waits in the scheduler's loading set meanwhile, other requests keep running.
- ``poll()`` (engine thread, before scheduling): copies finished loads into their device
  blocks and returns how many leading blocks each request got. A block that is missing,
  corrupt, foreign or fails to load ends the run there (counted; the store drops it): the
  request computes the rest.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.kv.cache import block_tensors
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.quant import QuantizedKVCache
from kvserve.request import Request
from kvserve.store import serde
from kvserve.store.sessions import SessionStore
from kvserve.store.tiered import TieredStore

logger = logging.getLogger("kvserve")

_FETCH_CHUNK = 32  # blocks per store round trip when loading

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int8: "int8",
    torch.uint8: "uint8",
}


@dataclass
class _Load:
    request: Request
    blocks: list[int]  # device blocks to fill, in order
    future: Future


class KVOffloader:
    def __init__(
        self,
        store: TieredStore,
        caches: list,
        kv: KVCacheManager,
        model_fingerprint: str,
        kv_dtype: str,
        session_ttl: float = 86400.0,
    ):
        self.store = store
        self.sessions = SessionStore(store, session_ttl)
        self.kv = kv
        self.caches = caches
        self.block_size = kv.block_size
        self._views = block_tensors(caches, kv.block_size)
        parts_per_layer = len(self._views) // len(caches)
        parts = tuple(
            (_DTYPE_NAMES[v.dtype], (v.shape[0], *v.shape[2:]))
            for v in self._views[:parts_per_layer]
        )
        self._base = (model_fingerprint, kv_dtype, kv.block_size, len(caches), parts)
        self._saved: dict[str, int] = {}  # request id → leading blocks already offered
        self._loads: dict[str, _Load] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-loader")
        self.num_loaded_blocks = 0
        self.num_saved_blocks = 0
        self.num_load_failures = 0

    def block_format(self) -> serde.BlockFormat:
        """The format of this engine's blocks. Recomputed per use: fp8 scales may be
        calibrated after start."""
        digest = None
        if isinstance(self.caches[0], QuantizedKVCache) and self.caches[0].fmt.scale == "head":
            h = hashlib.blake2b(digest_size=8)
            for c in self.caches:
                h.update(c.scale.detach().cpu().numpy().tobytes())
            digest = h.hexdigest()
        return serde.BlockFormat(*self._base, scales_digest=digest)

    def _tokens(self, request: Request, i: int) -> list[int]:
        return request.token_slice(i * self.block_size, (i + 1) * self.block_size)

    # ---- saving ------------------------------------------------------------------------
    def save(self, requests: Sequence[Request]) -> None:
        """Offer the newly full blocks of ``requests`` (this step's) to the store: one
        gather per KV tensor and one store batch for all of them."""
        null = self.kv.pool.null_block
        host = self.store.tiers[0]
        todo: list[tuple[Request, int, bytes, int]] = []  # (request, index, hash, block)
        for request in requests:
            rid = request.request_id
            full = request.num_computed_tokens // self.block_size
            done = self._saved.get(rid, 0)
            if full <= done:
                continue
            table = self.kv.block_table(rid)
            hashes = self.kv.block_hashes(request, full)
            self._saved[rid] = full
            for i in range(done, full):
                if table[i] != null and not host.contains([hashes[i]]):
                    todo.append((request, i, hashes[i], table[i]))
        if not todo:
            return
        fmt = self.block_format()
        n = len(todo)
        idx = torch.tensor([t[3] for t in todo], device=self._views[0].device)
        # one row of payload bytes per block: every layer's parts, layer-major (serde.pack)
        rows = torch.cat(
            [
                v.index_select(1, idx).transpose(0, 1).contiguous().view(torch.uint8).reshape(n, -1)
                for v in self._views
            ],
            dim=1,
        ).cpu()
        items = [
            (key, serde.encode(fmt, key, rows[j], self._tokens(request, i)))
            for j, (request, i, key, _) in enumerate(todo)
        ]
        self.store.put(items)
        self.num_saved_blocks += len(items)

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
        """Fetch blocks ``start .. start + len(blocks)`` of the request into ``blocks``."""
        hashes = self.kv.block_hashes(request, start + len(blocks))[start:]
        tokens = [self._tokens(request, start + j) for j in range(len(blocks))]
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

    def poll(self, wait: bool = False) -> list[tuple[Request, int]]:
        """Finished loads: (request, leading blocks now in the device cache)."""
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
            n = rows.shape[0]
            if n < len(load.blocks):
                self.num_load_failures += 1
            if n:
                self._copy_in(load.blocks[:n], rows)
                self.num_loaded_blocks += n
            done.append((load.request, n))
        return done

    def _copy_in(self, blocks: list[int], rows: torch.Tensor) -> None:
        """Payload ``rows`` ([n, payload bytes]) into device ``blocks``."""
        n = len(blocks)
        idx = torch.tensor(blocks, device=self._views[0].device)
        offset = 0
        for view in self._views:
            shape = (n, 2, *view.shape[2:])
            size = view[:, :1].numel() * view.element_size()  # bytes of one block
            part = rows[:, offset : offset + size].contiguous().view(view.dtype).view(shape)
            view.index_copy_(1, idx, part.transpose(0, 1).to(view.device))
            offset += size

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.store.close()
