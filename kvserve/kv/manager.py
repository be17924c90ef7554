"""Per-request block tables on top of the block pool.

The scheduler asks ``allocate_slots(request, n)`` before running ``n`` new tokens of a
request and gets the new block ids, or None when the pool cannot supply them (the caller
then preempts someone). The manager never touches KV tensors.
"""

from __future__ import annotations

from kvserve.kv.block_pool import BlockPool
from kvserve.request import Request
from kvserve.utils import cdiv


class KVCacheManager:
    """Maps request ids to the blocks that hold their K/V."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` fits in the whole pool."""
        return self.blocks_needed(num_tokens) <= self.pool.num_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Ensure blocks for ``num_computed_tokens + num_new_tokens`` tokens.

        Returns the newly allocated block ids (possibly empty), or None — changing
        nothing — when the pool is short.
        """
        table = self._tables.setdefault(request.request_id, [])
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(table)
        if need <= 0:
            return []
        new = self.pool.allocate(need)
        if new is None:
            if not table:
                del self._tables[request.request_id]
            return None
        table.extend(new)
        return new

    def free(self, request: Request) -> None:
        """Release every block of ``request`` (tail first). No-op if it holds none."""
        table = self._tables.pop(request.request_id, None)
        if table:
            self.pool.free(reversed(table))

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_requests(self) -> int:
        return len(self._tables)

    def check_integrity(self) -> None:
        """Pool invariants hold and every used block is owned by exactly its ref count."""
        self.pool.check_integrity()
        owners: dict[int, int] = {}
        for table in self._tables.values():
            for b in table:
                owners[b] = owners.get(b, 0) + 1
        for b in range(self.pool.num_blocks):
            if owners.get(b, 0) != self.pool.ref_count(b):
                raise AssertionError(
                    f"block {b}: {owners.get(b, 0)} owners but ref count {self.pool.ref_count(b)}"
                )
