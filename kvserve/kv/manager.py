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

Sliding windows: ``free_outside_windows`` returns blocks no future query can attend to
(except attention-sink blocks) and puts the pool's null block in their table slots.

Hybrid layout (``groups``, model/kv_groups.py): a request has one block table per group over the
one pool, all of the same length (a logical block ``i`` has one page in each group). A
sliding group's pages leave as its window passes (``free_outside_windows``); a global
group keeps them. Prefix caching names a group's page by the block hash and the group
(group 0 keeps the plain hash), and a hit (``find_cached_prefix``: one tuple of pages per
logical block) needs a global group's every page but a sliding group's pages only within
its window of the hit's end. Swap moves a request's pages as one list, group after group
(``swap_table``; a restore rebuilds the groups' tables from it); the KV store stores a
logical block's pages as one block of every layer (store/offloader.py).

Tenants: every block a request takes is charged to its tenant in the ``TenantLedger``
(see there for the rule); ``allocate_slots`` refuses what would push a tenant past its
limit. After a refusal ``shortage`` says why: ``POOL`` (not enough free blocks) or
``TENANT_LIMIT``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.events import KVEventLog
from kvserve.kv.hashing import BlockHash, hash_blocks, root_hash
from kvserve.kv.hybrid_prefix import find_hybrid_prefix, group_hash
from kvserve.kv.tenant_ledger import TenantLedger
from kvserve.model.kv_groups import KVGroups
from kvserve.request import Request
from kvserve.utils import cdiv

POOL = "pool"
TENANT_LIMIT = "tenant_limit"
# a prefix-cache hit: one logical block's page, or its page in each group (hybrid layout)
CachedBlock = int | tuple[int, ...]


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
        groups: KVGroups | None = None,
        max_step_tokens: int = 0,
        warm_limit: int = 0,
        events: KVEventLog | None = None,
    ):
        """``groups``: the hybrid layout (None or one group: one table per request);
        ``max_step_tokens``: the most tokens one step computes for a request (sizes a
        sliding group's peak in ``blocks_needed``); ``warm_limit`` and ``events``: the
        block pool's (pre-warmed blocks at most, the KV event log)."""
        self.block_size = block_size
        self.groups = groups if groups is not None and groups.hybrid else None
        # per group: its window (None: keeps every block); one group when uniform
        self.windows: tuple[int | None, ...] = (
            self.groups.windows if self.groups is not None else (None,)
        )
        self.max_step_tokens = max_step_tokens
        self.enable_caching = enable_caching
        self.cache_keys = (*cache_keys, f"block_size={block_size}")
        self.pool = BlockPool(
            num_blocks, reserve_null_block=reserve_null_block, warm_limit=warm_limit, events=events
        )
        self.stats = PrefixCacheStats()
        self._tables: dict[str, list[list[int]]] = {}  # request id → a table per group
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
    def hybrid(self) -> bool:
        return self.groups is not None

    @property
    def capacity_tokens(self) -> int:
        """The longest sequence the whole pool holds."""
        if self.groups is None:
            return self.num_blocks * self.block_size
        lo, hi = 0, self.num_blocks * self.block_size
        while lo < hi:  # blocks_needed grows with the tokens
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.blocks_needed(mid) <= self.num_blocks else (lo, mid - 1)
        return lo

    def blocks_needed(self, num_tokens: int) -> int:
        """Pool blocks a sequence of ``num_tokens`` holds at most (hybrid: with a step's
        worth of new tokens in each sliding group beside its window)."""
        if self.groups is None:
            return cdiv(num_tokens, self.block_size)
        step = min(self.max_step_tokens, num_tokens)
        return self.groups.blocks_held(num_tokens - step, self.block_size, step)

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
    def find_cached_prefix(self, request: Request) -> list[CachedBlock]:
        """Leading blocks of ``request`` already in the pool (empty when caching is off, the
        request has computed tokens or wants prompt logprobs), at most its
        ``restore_limit``'s. Block ids, or in the hybrid layout one tuple of pages per
        logical block (``find_hybrid_prefix``). Changes nothing; the hit statistics are
        counted when ``allocate_slots`` admits the request."""
        if (
            not self.enable_caching
            or request.num_computed_tokens
            or request.params.prompt_logprobs is not None
        ):
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        if request.restore_limit is not None:
            max_blocks = min(max_blocks, request.restore_limit // self.block_size)
        hashes = self.block_hashes(request, max_blocks)
        if self.groups is not None:
            return find_hybrid_prefix(self.pool, self.windows, request, hashes, self.block_size)
        return list(self._cached_run(request, hashes))

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

    def _per_group(self, cached: list[CachedBlock]) -> list[list[int]]:
        """``cached`` as one list of pages per group."""
        if self.groups is None:
            return [list(cached)]  # type: ignore[arg-type]
        return [[c[g] for c in cached] for g in range(len(self.windows))]  # type: ignore[index]

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_blocks: list[CachedBlock] | None = None
    ) -> list[int] | None:
        """Ensure blocks for the request's computed tokens (plus ``cached_blocks``' tokens)
        and ``num_new_tokens`` more, in every group. ``cached_blocks`` (from
        ``find_cached_prefix``, first call only) are shared, not allocated.

        Returns the newly allocated block ids (possibly empty; every group's, group by
        group), or None — changing nothing and setting ``shortage`` — when the pool is short
        or the tenant would pass its limit.
        """
        cached = self._per_group(cached_blocks or [])
        null = self.pool.null_block
        shared = [b for group in cached for b in group if b != null]
        tables = self._tables.get(request.request_id) or [[] for _ in self.windows]
        n_cached = len(cached[0])
        computed = request.num_computed_tokens + n_cached * self.block_size
        blocks = cdiv(computed + num_new_tokens, self.block_size)  # table entries
        need = [max(blocks - len(t) - n_cached, 0) for t in tables]
        if not self._admissible(request.tenant, sum(need), shared):
            return None
        if self.enable_caching and request.num_computed_tokens == 0 and not tables[0]:
            self.stats.queries += request.num_tokens  # counted once per admission
            self.stats.hits += n_cached * self.block_size
        self._tables[request.request_id] = tables
        self._tenant[request.request_id] = request.tenant
        if n_cached:
            self.pool.touch(shared)
            for table, group in zip(tables, cached, strict=True):
                table.extend(group)
            self._num_cached[request.request_id] = n_cached
        new = self.pool.allocate(sum(need)) or []
        it = iter(new)
        for table, n in zip(tables, need, strict=True):
            table.extend(next(it) for _ in range(n))
        self.ledger.charge(request.tenant, [*shared, *new])
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
        be shared instead of copied back. Stops at the first missing or null entry.
        Empty in the hybrid layout (every live page is copied back)."""
        if not self.enable_caching or self.groups is not None:
            return []
        full = min(request.num_computed_tokens // self.block_size, len(live))
        return self._cached_run(request, self.compute_block_hashes(request, full), live)

    def swap_table(self, request_id: str) -> list[int]:
        """What swap copies of a request: its table, or in the hybrid layout every group's
        table, group after group (null entries are not copied)."""
        return [b for t in self._tables.get(request_id, ()) for b in t]

    def allocate_restored(
        self,
        request: Request,
        live: list[bool],
        num_new_tokens: int,
        shared: list[int] | None = None,
    ) -> list[int] | None:
        """Blocks for a request coming back from swap (``live``: which entries of its
        ``swap_table`` were copied out): a table whose first entries are the ``shared``
        blocks (``shared_prefix_for_restore``, referenced, not copied), then a fresh block
        where ``live[i]`` (the caller copies the K/V in) and the null block elsewhere, plus
        room for ``num_new_tokens`` more; in the hybrid layout so for each group's part of
        ``live``. Returns the fresh blocks, those to copy into first (in ``live`` order),
        or None (setting ``shortage``, changing nothing)."""
        if request.request_id in self._tables:
            raise ValueError(f"request {request.request_id!r} already holds blocks")
        shared = shared or []
        groups = len(self.windows)
        per_group = len(live) // groups
        blocks = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        extra = max(blocks - per_group, 0)
        to_copy = sum(live) - len(shared)
        if not self._admissible(request.tenant, to_copy + extra * groups, shared):
            return None
        self.pool.touch(shared)
        fresh = self.pool.allocate(to_copy + extra * groups) or []
        copied, extras = iter(fresh[:to_copy]), iter(fresh[to_copy:])
        null = self.pool.null_block
        tables = []
        for g in range(groups):
            part = live[g * per_group : (g + 1) * per_group]
            kept = list(shared) if g == 0 else []
            table = [*kept, *(next(copied) if alive else null for alive in part[len(kept) :])]
            table.extend(next(extras) for _ in range(extra))
            tables.append(table)
        self._tables[request.request_id] = tables  # type: ignore[assignment]
        self._tenant[request.request_id] = request.tenant
        self._num_cached[request.request_id] = len(shared)
        self.ledger.charge(request.tenant, [*shared, *fresh])
        return fresh

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks (every group's pages) that are now full of
        computed tokens."""
        if not self.enable_caching:
            return
        rid = request.request_id
        tables = self._tables.get(rid)
        if not tables or not tables[0]:
            return
        full = min(request.num_computed_tokens // self.block_size, len(tables[0]))
        done = self._num_cached.get(rid, 0)
        if full <= done:
            return
        bs = self.block_size
        hashes = self.block_hashes(request, full)
        null = self.pool.null_block
        for g, table in enumerate(tables):
            for i in range(done, full):
                b = table[i]
                if b != null:
                    tokens = request.token_slice(i * bs, (i + 1) * bs)
                    self.pool.cache(b, group_hash(hashes[i], g), tokens)
        self._num_cached[rid] = full

    def free_outside_windows(
        self, request: Request, window: int | None = None, sinks: int = 0
    ) -> int:
        """Release blocks whose positions all lie before the window of every future query
        (the next query sits at ``num_computed_tokens``) and past the ``sinks`` first
        tokens; their table slots become the null block. In the hybrid layout each sliding
        group over its own window (no sinks), else the one table over ``window`` (a no-op
        when None). Returns how many blocks were freed."""
        if self.groups is None:
            return 0 if window is None else self._free_before(request, 0, window, sinks)
        return sum(
            self._free_before(request, g, w) for g, w in enumerate(self.windows) if w is not None
        )

    def _free_before(self, request: Request, group: int, window: int, sinks: int = 0) -> int:
        tables = self._tables.get(request.request_id)
        null = self.pool.null_block
        if not tables or null is None:
            return 0
        table = tables[group]
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
        tables = self._tables.pop(rid, None)
        tenant = self._tenant.pop(rid, None)
        null = self.pool.null_block
        for table in tables or ():
            self.pool.free(reversed(table))
            self.ledger.release(tenant or request.tenant, [b for b in table if b != null])

    def block_table(self, request_id: str) -> list[int]:
        """The request's table (group 0's in the hybrid layout); empty when it holds none."""
        tables = self._tables.get(request_id)
        return tables[0] if tables else []

    def block_tables(self, request_id: str) -> list[list[int]]:
        """One table per group (a single one when uniform); empty when it holds none."""
        return self._tables.get(request_id, [])

    def _blocks(self, request_id: str) -> list[int]:
        null = self.pool.null_block
        return [b for t in self._tables.get(request_id, ()) for b in t if b != null]

    def num_live_blocks(self, request_id: str) -> int:
        """Blocks a request holds (every group's), not counting null-block placeholders."""
        return len(self._blocks(request_id))

    def num_exclusive_blocks(self, request_id: str) -> int:
        """Blocks only this request references: what freeing it gives back to the pool."""
        refs = self.pool.ref_count
        return sum(1 for b in self._blocks(request_id) if refs(b) == 1)

    def num_shared_prefix_blocks(self, request_id: str) -> int:
        """Leading blocks of the request (group 0's) that are in the prefix index and
        referenced by someone else too: they survive the request's preemption and a
        recompute finds them (0 without prefix caching)."""
        if not self.enable_caching:
            return 0
        n = 0
        for b in self.block_table(request_id):
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
        """Pool invariants hold, every used block is owned by exactly its ref count, every
        request's group tables have one length, and the tenants' charges match."""
        self.pool.check_integrity()
        owners: dict[int, int] = {}
        charged: dict[str, dict[int, int]] = {}
        for rid, tables in self._tables.items():
            if len(tables) != len(self.windows) or len({len(t) for t in tables}) > 1:
                raise AssertionError(f"request {rid!r}: group tables of unequal lengths")
            refs = charged.setdefault(self._tenant[rid], {})
            for b in self._blocks(rid):
                owners[b] = owners.get(b, 0) + 1
                refs[b] = refs.get(b, 0) + 1
        null = self.pool.null_block
        for b in range(self.pool.num_blocks):
            if b == null:
                continue
            if owners.get(b, 0) != self.pool.ref_count(b):
                raise AssertionError(
                    f"block {b}: {owners.get(b, 0)} owners but ref count {self.pool.ref_count(b)}"
                )
        for tenant in set(charged) | set(self.ledger.usages()):
            if self.ledger.references(tenant) != charged.get(tenant, {}):
                raise AssertionError(f"tenant {tenant!r}: ledger and block tables disagree")
        if sum(self.ledger.usages().values()) < self.pool.num_used:
            raise AssertionError("tenants are charged for fewer blocks than the pool uses")
