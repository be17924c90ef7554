"""Per-request block tables on top of the block pool, with automatic prefix caching.

The scheduler asks ``allocate_slots(request, n)`` before running ``n`` new tokens of a
request and gets the new block ids, or None when the pool cannot supply them (the caller
then preempts someone). The manager never touches KV tensors.

Prefix caching: before a request's first step the scheduler calls ``find_cached_prefix``,
which returns the leading blocks whose K/V already sit in the pool (in use by another
request, or cached-free), and passes them to ``allocate_slots``, which takes a reference on
each — full blocks are shared, never written again, so no copy-on-write is needed. After
each step ``cache_full_blocks`` registers blocks that became full. At least one token is
always left to compute, because the step that computes it produces the next token's logits.

Sliding windows: ``free_outside_window`` returns blocks no future query can attend to
(except attention-sink blocks) and puts the pool's null block in their table slots.

Tenants: every block a request takes is charged to its tenant in the ``TenantLedger``
(see there for the rule); ``allocate_slots`` refuses what would push a tenant past its
limit. After a refusal ``shortage`` says why: ``POOL`` (not enough free blocks) or
``TENANT_LIMIT``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.hashing import BlockHash, hash_blocks, root_hash
from kvserve.kv.tenant_ledger import TenantLedger
from kvserve.request import Request
from kvserve.utils import cdiv

POOL = "pool"
TENANT_LIMIT = "tenant_limit"


@dataclass
class PrefixCacheStats:
    """Token counts, like vLLM's ``prefix_cache_queries``/``prefix_cache_hits``."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Maps request ids to the blocks that hold their K/V.

    ``cache_keys`` (model fingerprint, KV dtype, …) enter every block hash, so blocks are
    only shared between requests whose K/V bytes are interchangeable; a request's
    ``cache_salt`` further restricts sharing (per tenant, per user).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = False,
        cache_keys: tuple[str, ...] = (),
        reserve_null_block: bool = False,
    ):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.cache_keys = (*cache_keys, f"block_size={block_size}")
        self.pool = BlockPool(num_blocks, reserve_null_block=reserve_null_block)
        self.stats = PrefixCacheStats()
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks already in the index
        self._roots: dict[str | None, BlockHash] = {}
        self._tenant: dict[str, str] = {}  # request id → tenant charged for its blocks
        self.ledger = TenantLedger(self.pool.num_usable)
        self.shortage: str | None = None  # why the last allocate_slots returned None

    @property
    def num_blocks(self) -> int:
        """Blocks that can hold K/V."""
        return self.pool.num_usable

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` fits in the whole pool."""
        return self.blocks_needed(num_tokens) <= self.num_blocks

    # ---- hashing ------------------------------------------------------------------------
    def _root(self, salt: str | None) -> BlockHash:
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = root_hash(*self.cache_keys, salt)
        return root

    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Hashes of the request's first ``num_blocks`` full blocks (computed once each)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        if len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else self._root(request.cache_salt)
            bs = self.block_size
            tokens = request.token_slice(len(hashes) * bs, num_blocks * bs)
            hashes += hash_blocks(parent, tokens, bs)
        return hashes[:num_blocks]

    def hashes_for(self, tokens: Sequence[int], salt: str | None) -> list[BlockHash]:
        """Hashes of the full blocks of ``tokens`` under ``salt`` (a request's cache_salt)."""
        return hash_blocks(self._root(salt), list(tokens), self.block_size)

    def compute_block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Like ``block_hashes`` but not remembered (for a request that left the pool)."""
        tokens = request.token_slice(0, num_blocks * self.block_size)
        return hash_blocks(self._root(request.cache_salt), tokens, self.block_size)

    # ---- prefix lookup and allocation ---------------------------------------------------
    def find_cached_prefix(self, request: Request) -> list[int]:
        """Leading blocks of ``request`` already in the pool (empty when caching is off, the
        request has computed tokens or wants prompt logprobs). Changes nothing; the hit
        statistics are counted when ``allocate_slots`` admits the request."""
        if (
            not self.enable_caching
            or request.num_computed_tokens
            or request.params.prompt_logprobs is not None
        ):
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        return self._cached_run(request, self.block_hashes(request, max_blocks))

    def _cached_run(
        self, request: Request, hashes: list[BlockHash], live: list[bool] | None = None
    ) -> list[int]:
        """The pool blocks holding the request's leading blocks (by hash and tokens), up to
        the first miss or the first entry ``live`` marks dead."""
        hits: list[int] = []
        bs = self.block_size
        for i, h in enumerate(hashes):
            if live is not None and not live[i]:
                break
            b = self.pool.lookup(h, request.token_slice(i * bs, (i + 1) * bs))
            if b is None:
                break
            hits.append(b)
        return hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Ensure blocks for the request's computed tokens (plus ``cached_blocks``' tokens)
        and ``num_new_tokens`` more. ``cached_blocks`` (from ``find_cached_prefix``, first
        call only) are shared, not allocated.

        Returns the newly allocated block ids (possibly empty), or None — changing nothing
        and setting ``shortage`` — when the pool is short or the tenant would pass its limit.
        """
        cached = cached_blocks or []
        table = self._tables.get(request.request_id, [])
        computed = request.num_computed_tokens + len(cached) * self.block_size
        need = max(self.blocks_needed(computed + num_new_tokens) - len(table) - len(cached), 0)
        if not self._admissible(request.tenant, need, cached):
            return None
        if self.enable_caching and request.num_computed_tokens == 0 and not table:
            self.stats.queries += request.num_tokens  # counted once per admission
            self.stats.hits += len(cached) * self.block_size
        table = self._tables.setdefault(request.request_id, [])
        self._tenant[request.request_id] = request.tenant
        if cached:
            self.pool.touch(cached)
            table.extend(cached)
            self._num_cached[request.request_id] = len(cached)
        new = self.pool.allocate(need) or []
        table.extend(new)
        self.ledger.charge(request.tenant, [*cached, *new])
        return new

    def _admissible(self, tenant: str, need: int, cached: list[int]) -> bool:
        """Whether ``need`` new blocks plus sharing ``cached`` fit the pool and the tenant's
        limit; sets ``shortage`` when not."""
        revived = sum(1 for b in cached if self.pool.ref_count(b) == 0)
        charges = need + self.ledger.new_charges(tenant, cached)
        if charges and charges > self.ledger.headroom(tenant):
            self.shortage = TENANT_LIMIT
            return False
        if need > self.pool.num_free - revived:
            self.shortage = POOL
            return False
        self.shortage = None
        return True

    def shared_prefix_for_restore(self, request: Request, live: list[bool]) -> list[int]:
        """For a request coming back from swap: its leading full blocks that the pool
        still holds under the same hash and tokens (another request's, or cached-free), to
        be shared instead of copied back. Stops at the first missing or null entry."""
        if not self.enable_caching:
            return []
        full = min(request.num_computed_tokens // self.block_size, len(live))
        return self._cached_run(request, self.compute_block_hashes(request, full), live)

    def allocate_restored(
        self,
        request: Request,
        live: list[bool],
        num_new_tokens: int,
        shared: list[int] | None = None,
    ) -> list[int] | None:
        """Blocks for a request coming back from swap: a table whose first entries are the
        ``shared`` blocks (``shared_prefix_for_restore``, referenced, not copied), then a
        fresh block where ``live[i]`` (the caller copies the K/V in) and the null block
        elsewhere, plus room for ``num_new_tokens`` more. Returns the fresh blocks in table
        order, or None (setting ``shortage``, changing nothing)."""
        if request.request_id in self._tables:
            raise ValueError(f"request {request.request_id!r} already holds blocks")
        shared = shared or []
        extra = max(self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(live), 0)
        need = sum(live) - len(shared) + extra
        if not self._admissible(request.tenant, need, shared):
            return None
        self.pool.touch(shared)
        fresh = self.pool.allocate(need) or []
        it = iter(fresh)
        rest = live[len(shared) :]
        table = [*shared, *(next(it) if alive else self.pool.null_block for alive in rest)]
        table.extend(it)
        self._tables[request.request_id] = table  # type: ignore[assignment]
        self._tenant[request.request_id] = request.tenant
        self._num_cached[request.request_id] = len(shared)
        self.ledger.charge(request.tenant, [*shared, *fresh])
        return fresh

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that are now full of computed tokens."""
        if not self.enable_caching:
            return
        rid = request.request_id
        table = self._tables.get(rid)
        if not table:
            return
        full = min(request.num_computed_tokens // self.block_size, len(table))
        done = self._num_cached.get(rid, 0)
        if full <= done:
            return
        bs = self.block_size
        hashes = self.block_hashes(request, full)
        for i in range(done, full):
            b = table[i]
            if b != self.pool.null_block:
                self.pool.cache(b, hashes[i], request.token_slice(i * bs, (i + 1) * bs))
        self._num_cached[rid] = full

    def free_outside_window(self, request: Request, window: int, sinks: int = 0) -> int:
        """Release blocks whose positions all lie before the window of every future query
        (the next query sits at ``num_computed_tokens``) and past the ``sinks`` first
        tokens. Their table slots become the null block. Returns how many were freed."""
        table = self._tables.get(request.request_id)
        null = self.pool.null_block
        if not table or null is None:
            return 0
        dead_end = request.num_computed_tokens - window + 1  # positions < this are dead
        first = cdiv(sinks, self.block_size)
        freed = []
        for i in range(first, min(dead_end // self.block_size, len(table))):
            if table[i] != null:
                freed.append(table[i])
                table[i] = null
        self.pool.free(reversed(freed))
        self.ledger.release(self._tenant[request.request_id], freed)
        return len(freed)

    def free(self, request: Request) -> None:
        """Release every block of ``request`` (tail first, so a prefix outlives its tail in
        the LRU). No-op if it holds none."""
        rid = request.request_id
        self._hashes.pop(rid, None)
        self._num_cached.pop(rid, None)
        table = self._tables.pop(rid, None)
        tenant = self._tenant.pop(rid, None)
        if table:
            self.pool.free(reversed(table))
            null = self.pool.null_block
            self.ledger.release(tenant or request.tenant, [b for b in table if b != null])

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_live_blocks(self, request_id: str) -> int:
        """Blocks a request holds, not counting null-block placeholders."""
        null = self.pool.null_block
        return sum(1 for b in self._tables.get(request_id, ()) if b != null)

    def num_exclusive_blocks(self, request_id: str) -> int:
        """Blocks only this request references: what freeing it gives back to the pool."""
        null = self.pool.null_block
        refs = self.pool.ref_count
        return sum(1 for b in self._tables.get(request_id, ()) if b != null and refs(b) == 1)

    def num_shared_prefix_blocks(self, request_id: str) -> int:
        """Leading blocks of the request that are in the prefix index and referenced by
        someone else too: they survive the request's preemption and a recompute finds them
        (0 without prefix caching)."""
        if not self.enable_caching:
            return 0
        n = 0
        for b in self._tables.get(request_id, ()):
            if (
                b == self.pool.null_block
                or self.pool.ref_count(b) < 2
                or not self.pool.is_cached(b)
            ):
                break
            n += 1
        return n

    def num_requests(self) -> int:
        return len(self._tables)

    def reset_prefix_cache(self) -> int:
        """Forget every cached-free block (e.g. after a weight reload); returns how many."""
        return self.pool.evict_cached()

    def check_integrity(self) -> None:
        """Pool invariants hold and every used block is owned by exactly its ref count."""
        self.pool.check_integrity()
        owners: dict[int, int] = {}
        null = self.pool.null_block
        for table in self._tables.values():
            for b in table:
                if b != null:
                    owners[b] = owners.get(b, 0) + 1
        for b in range(self.pool.num_blocks):
            if b == null:
                continue
            if owners.get(b, 0) != self.pool.ref_count(b):
                raise AssertionError(
                    f"block {b}: {owners.get(b, 0)} owners but ref count {self.pool.ref_count(b)}"
                )
        charged: dict[str, dict[int, int]] = {}
        for rid, table in self._tables.items():
            refs = charged.setdefault(self._tenant[rid], {})
            for b in table:
                if b != null:
                    refs[b] = refs.get(b, 0) + 1
        for tenant in set(charged) | set(self.ledger.usages()):
            if self.ledger.references(tenant) != charged.get(tenant, {}):
                raise AssertionError(f"tenant {tenant!r}: ledger and block tables disagree")
        if sum(self.ledger.usages().values()) < self.pool.num_used:
            raise AssertionError("tenants are charged for fewer blocks than the pool uses")
