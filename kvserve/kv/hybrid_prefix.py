"""Prefix-cache hits in the hybrid KV layout (model/kv_groups.py): a group's page is named by
the block hash and the group, and a hit needs a global group's every page but a sliding
group's pages only where its window still sees them."""

from __future__ import annotations

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.hashing import BlockHash, hash_block
from kvserve.request import Request


def group_hash(block_hash: BlockHash, group: int) -> BlockHash:
    """The name of a block's page in ``group`` (group 0: the block hash itself)."""
    return block_hash if group == 0 else hash_block(block_hash, (-group,))


def find_hybrid_prefix(
    pool: BlockPool,
    windows: tuple[int | None, ...],
    request: Request,
    hashes: list[BlockHash],
    block_size: int,
) -> list[tuple[int, ...]]:
    """The longest prefix of ``hashes`` (the request's leading full blocks) that the pool
    holds for every group: a global group's every page, a sliding group's pages within its
    window of the prefix's end (the next query sits there). One tuple of pages per logical
    block; a sliding group's page it no longer needs is the null block."""
    null = pool.null_block
    assert null is not None, "the hybrid layout reserves the null block"
    found: list[dict[int, int | None]] = [{} for _ in windows]

    def page(g: int, i: int) -> int | None:
        if i not in found[g]:
            tokens = request.token_slice(i * block_size, (i + 1) * block_size)
            found[g][i] = pool.lookup(group_hash(hashes[i], g), tokens)
        return found[g][i]

    def first_seen(w: int | None, n: int) -> int:  # the first block a query at n*bs sees
        return 0 if w is None else max(0, (n * block_size - w + 1) // block_size)

    n = len(hashes)
    for g, w in enumerate(windows):
        if w is None:  # a global group: every page up to the first miss
            n = next((i for i in range(n) if page(g, i) is None), n)
    moved = True
    while moved and n:  # shrink to the last miss of any sliding group until none is left
        moved = False
        for g, w in enumerate(windows):
            if w is None:
                continue
            seen = range(n - 1, first_seen(w, n) - 1, -1)
            miss = next((i for i in seen if page(g, i) is None), None)
            if miss is not None:
                n, moved = miss, True
    return [
        tuple(
            page(g, i) if i >= first_seen(w, n) else null  # type: ignore[misc]
            for g, w in enumerate(windows)
        )
        for i in range(n)
    ]
