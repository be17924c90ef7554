"""Fixed-size KV blocks with reference counts, an LRU free list and a prefix-cache index.

The pool only does bookkeeping on block ids; it never touches tensors.

- A block is *used* while its ref count is positive, *free* otherwise. Free blocks sit in
  an LRU list (least recently freed first); allocation takes from its head.
- A full block can be *cached*: registered under its chained hash with its token ids. A
  cached block keeps its hash after its last reference is dropped (*cached-free*), so a
  later request with the same prefix can take it back (``touch``) instead of recomputing
  it. The hash is dropped lazily, only when allocation reuses the block for other data.
- Lookups compare token ids as well as the hash: a collision is counted, never served.
- ``events`` (optional): every hash registered or dropped, for the cluster's routers
  (``kv.events``).
- Pre-warmed blocks (``place_warm``): KV pushed from another worker (a primary's standby
  push, a prefill worker's hand-over) placed straight into free blocks as cached-free
  prefix blocks, at most ``warm_limit`` of them. They wait in their own LRU list and are
  evicted before any other cached block: allocation takes the free list's head while it
  is uncached, and a pre-warmed block rather than a cached head. A request that takes one
  (``touch``) makes it an ordinary cached block.
- Optional null block: with ``reserve_null_block`` block 0 is never handed out; block
  tables use it for positions whose K/V were freed (outside a sliding window).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvserve.kv.events import DEVICE, KVEventLog
from kvserve.kv.hashing import BlockHash

NULL_BLOCK = 0


class BlockPool:
    """Ref-counted block ids ``0 .. num_blocks-1`` with a hash → block prefix index."""

    def __init__(
        self,
        num_blocks: int,
        *,
        reserve_null_block: bool = False,
        warm_limit: int = 0,
        events: KVEventLog | None = None,
    ):
        """``warm_limit``: the most pre-warmed blocks (0: pre-warm off); ``events``: the
        log of hashes registered and dropped (KV events), None when none is published."""
        first = 1 if reserve_null_block else 0
        if num_blocks - first <= 0:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks - first}")
        self.num_blocks = num_blocks
        self.null_block: int | None = NULL_BLOCK if reserve_null_block else None
        self._refs = [0] * num_blocks
        if reserve_null_block:
            self._refs[NULL_BLOCK] = 1  # permanently in use
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(first, num_blocks))
        self._warm: OrderedDict[int, None] = OrderedDict()  # pre-warmed, oldest first
        self.warm_limit = warm_limit
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._tokens: dict[int, tuple[int, ...]] = {}
        self._index: dict[BlockHash, int] = {}
        self.num_evictions = 0
        self.num_collisions = 0
        self.on_evict: Callable[[int, BlockHash], None] | None = None
        self.events = events

    # ---- sizes ------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        """Blocks that can ever hold K/V (all but the null block)."""
        return self.num_blocks - (self.null_block is not None)

    @property
    def num_free(self) -> int:
        """Blocks with no reference, cached or not (all of them allocatable)."""
        return len(self._free) + len(self._warm)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    @property
    def num_warm(self) -> int:
        """Pre-warmed blocks no request has taken yet."""
        return len(self._warm)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix index (used or free)."""
        return len(self._index)

    def free_blocks(self) -> list[int]:
        """Ids of the free blocks (cached or not), least recently freed first, then the
        pre-warmed ones."""
        return [*self._free, *self._warm]

    @property
    def num_cached_free(self) -> int:
        return sum(1 for b in self._free if self._hash[b] is not None) + len(self._warm)

    # ---- allocation -------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks (ref count 1 each, least recently freed first), evicting
        their cached hashes; or return None and change nothing."""
        if n > self.num_free:
            return None
        blocks = []
        for _ in range(n):
            b = self._take()
            self._evict(b)
            self._refs[b] = 1
            blocks.append(b)
        return blocks

    def _take(self) -> int:
        """The next free block to reuse: the free list's head while it is uncached, else
        the oldest pre-warmed block, else the head (a cached block)."""
        if self._warm and (not self._free or self._hash[next(iter(self._free))] is not None):
            return self._warm.popitem(last=False)[0]
        return self._free.popitem(last=False)[0]

    def touch(self, blocks: Iterable[int]) -> None:
        """Add a reference to each block; a cached-free block leaves the free list.

        Raises ValueError for a free block that is not cached (its data is not valid).
        """
        for b in blocks:
            if self._refs[b] == 0:
                if self._hash[b] is None:
                    raise ValueError(f"block {b} is free and uncached; cannot share it")
                if b in self._warm:  # a pre-warmed block becomes an ordinary one
                    del self._warm[b]
                else:
                    del self._free[b]
            self._refs[b] += 1

    incref = touch

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free list's
        tail (cached ones stay findable until reused). Raises ValueError on a double free."""
        for b in blocks:
            if b == self.null_block:
                continue
            if self._refs[b] <= 0:
                raise ValueError(f"double free of block {b}")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def is_cached(self, block: int) -> bool:
        return self._hash[block] is not None

    # ---- prefix index -----------------------------------------------------------------
    def cache(self, block: int, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        """Register a used, full ``block`` under ``block_hash``. Returns False (and leaves
        the block uncached) when the block is already cached or another block holds the
        hash — the first copy stays canonical."""
        if self._hash[block] is not None or block_hash in self._index:
            return False
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is free; only used blocks can be cached")
        self._hash[block] = block_hash
        self._tokens[block] = tuple(token_ids)
        self._index[block_hash] = block
        if self.events is not None:
            self.events.stored(DEVICE, (block_hash,))
        return True

    def place_warm(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """A free block to hold a pre-warmed copy of ``block_hash``'s KV, registered at once
        as a cached-free block (the caller copies the KV in before the next step runs);
        None, changing nothing, when pre-warm is off or the hash is cached already. Takes
        the oldest pre-warmed block once ``warm_limit`` are placed, else the free list's
        head (dropping its hash if it had one)."""
        if self.warm_limit <= 0 or block_hash in self._index:
            return None
        if len(self._warm) >= self.warm_limit:
            b = self._warm.popitem(last=False)[0]
        elif self._free:
            b = self._free.popitem(last=False)[0]
        else:
            return None
        self._evict(b)
        self._hash[b] = block_hash
        self._tokens[b] = tuple(token_ids)
        self._index[block_hash] = b
        self._warm[b] = None
        if self.events is not None:
            self.events.stored(DEVICE, (block_hash,))
        return b

    def place_warm_pages(
        self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int]
    ) -> list[int] | None:
        """``place_warm`` for one logical block's page in each KV group (the hybrid layout:
        ``block_hashes`` the pages' names, ``hybrid_prefix.group_hash``): a block for
        every hash, or None, changing nothing, when pre-warm is off, any of them is cached
        already, or the pool cannot place them all (so no page is named without its KV)."""
        k = len(block_hashes)
        if self.warm_limit < k or any(h in self._index for h in block_hashes):
            return None
        if min(k, self.warm_limit - len(self._warm)) > len(self._free):
            return None  # each placement below the limit takes a free block
        placed = [self.place_warm(h, token_ids) for h in block_hashes]
        assert all(b is not None for b in placed), placed
        return placed  # type: ignore[return-value]

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash in the prefix index (used and cached-free blocks)."""
        return list(self._index)

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """The cached block holding exactly ``token_ids`` under ``block_hash``, or None.
        A hash match whose token ids differ is a collision: counted, returns None."""
        b = self._index.get(block_hash)
        if b is None:
            return None
        if self._tokens[b] != tuple(token_ids):
            self.num_collisions += 1
            return None
        return b

    def evict_cached(self) -> int:
        """Drop every cached-free block's hash (reset the prefix cache); returns how many."""
        n = 0
        for b in [*self._free, *self._warm]:
            if self._hash[b] is not None:
                self._evict(b)
                n += 1
        self._free.update(self._warm)  # uncached now: ordinary free blocks
        self._warm.clear()
        return n

    def _evict(self, b: int) -> None:
        h = self._hash[b]
        if h is None:
            return
        self._hash[b] = None
        del self._tokens[b]
        del self._index[h]
        self.num_evictions += 1
        if self.events is not None:
            self.events.removed(DEVICE, (h,))
        if self.on_evict is not None:
            self.on_evict(b, h)

    def check_integrity(self) -> None:
        """Raise AssertionError unless free list, ref counts and the index agree exactly."""
        for b, r in enumerate(self._refs):
            if r < 0:
                raise AssertionError(f"block {b} has negative ref count {r}")
            free = b in self._free or b in self._warm
            if (r == 0) != free or (b in self._free and b in self._warm):
                raise AssertionError(f"block {b}: ref count {r} but free={free}")
            if b in self._warm and self._hash[b] is None:
                raise AssertionError(f"pre-warmed block {b} has no hash")
        if len(self._warm) > max(self.warm_limit, 0):
            raise AssertionError(f"{len(self._warm)} pre-warmed blocks, limit {self.warm_limit}")
        if self.null_block is not None and self.null_block in self._free:
            raise AssertionError("the null block is in the free list")
        for h, b in self._index.items():
            if self._hash[b] != h:
                raise AssertionError(f"index names block {b} for a hash it does not carry")
        hashed = [b for b in range(self.num_blocks) if self._hash[b] is not None]
        if len(hashed) != len(self._index) or set(self._tokens) != set(hashed):
            raise AssertionError("cached blocks, index and token records disagree")
