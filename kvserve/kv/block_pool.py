"""Fixed-size KV blocks with reference counts and a free list.

The pool only does bookkeeping on block ids; it never touches tensors. Allocation is
all-or-nothing. Blocks freed together are returned tail first, so the blocks most likely
to be re-used (a sequence's head) stay in the pool longest once caching lands.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class BlockPool:
    """Ref-counted block ids ``0 .. num_blocks-1``."""

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks (ref count 1 each), or return None and change nothing."""
        if n > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        """Add a reference to blocks that are in use (sharing a prefix, forking)."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is free; cannot share it")
            self._refs[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching zero become free."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"double free of block {b}")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def check_integrity(self) -> None:
        """Raise AssertionError unless free list and ref counts agree exactly."""
        free = list(self._free)
        if len(set(free)) != len(free):
            raise AssertionError("a block appears twice in the free list")
        free_set = set(free)
        for b, r in enumerate(self._refs):
            if r < 0:
                raise AssertionError(f"block {b} has negative ref count {r}")
            if (r == 0) != (b in free_set):
                raise AssertionError(f"block {b}: ref count {r} but free={b in free_set}")
