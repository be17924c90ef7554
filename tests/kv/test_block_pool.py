"""Block pool and KV manager bookkeeping, including a randomized integrity check."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.manager import KVCacheManager
from kvserve.request import Request
from kvserve.sampling import SamplingParams


def _req(rid: str, n_prompt: int) -> Request:
    return Request(rid, list(range(n_prompt)), SamplingParams(), seed=0, max_tokens=8)


def test_allocate_is_all_or_nothing():
    pool = BlockPool(4)
    assert pool.allocate(5) is None
    assert pool.num_free == 4
    got = pool.allocate(3)
    assert got is not None and len(got) == 3
    assert pool.allocate(2) is None
    assert pool.num_free == 1
    pool.check_integrity()


def test_ref_counts_and_double_free():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.incref([b])
    pool.free([b])
    assert pool.ref_count(b) == 1 and pool.num_free == 1
    pool.free([b])
    assert pool.num_free == 2
    with pytest.raises(ValueError, match="double free"):
        pool.free([b])
    with pytest.raises(ValueError, match="free"):
        pool.incref([b])


def test_manager_allocates_only_missing_blocks_and_frees_tail_first():
    kv = KVCacheManager(num_blocks=8, block_size=16)
    r = _req("a", 17)
    assert len(kv.allocate_slots(r, 17)) == 2
    r.num_computed_tokens = 17
    assert kv.allocate_slots(r, 1) == []  # slot 18 lives in block 2 of 2
    r.num_computed_tokens = 32
    assert len(kv.allocate_slots(r, 1)) == 1
    table = list(kv.block_table("a"))
    kv.free(r)
    assert kv.pool.num_free == 8
    # freed tail first: the head block, most likely to be shared, is evicted last
    assert list(kv.pool._free)[-3:] == table[::-1]
    kv.check_integrity()


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=16)
    r = _req("a", 40)
    assert kv.allocate_slots(r, 40) is None
    assert kv.pool.num_free == 2 and kv.num_requests() == 0
    kv.check_integrity()


ops = st.lists(
    st.tuples(st.sampled_from(["grow", "free", "fork"]), st.integers(0, 5), st.integers(1, 40)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_integrity_under_random_operations(seq):
    """Random grow/free/fork (shared blocks) keeps pool and tables consistent."""
    pool = BlockPool(16)
    tables: dict[int, list[int]] = {}
    for op, rid, n in seq:
        if op == "grow":
            got = pool.allocate(n % 5)
            if got is not None:
                tables.setdefault(rid, []).extend(got)
        elif op == "free" and rid in tables:
            pool.free(reversed(tables.pop(rid)))
        elif op == "fork" and rid in tables and (rid + 1) % 6 not in tables:
            pool.incref(tables[rid])
            tables[(rid + 1) % 6] = list(tables[rid])
        pool.check_integrity()
        held = sum(len(t) for t in tables.values())
        assert sum(pool.ref_count(b) for b in range(16)) == held
    for t in tables.values():
        pool.free(t)
    assert pool.num_free == 16
    pool.check_integrity()


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["alloc", "free", "cache", "warm", "take", "reset"]), st.integers(0, 30)
        ),
        max_size=60,
    )
)
def test_pre_warmed_blocks_are_evicted_before_any_other_cached_block(seq):
    """Random allocation, caching, pre-warm, prefix hits and resets keep the pool exact,
    pre-warmed blocks stay within ``warm_limit``, and an allocation never drops an
    ordinary cached block's hash while a pre-warmed one is left."""
    pool = BlockPool(12)
    pool.warm_limit = 3
    held: list[int] = []
    for op, k in seq:
        if op == "alloc":
            warm_before = pool.num_warm
            cached_before = pool.num_cached_free - warm_before
            got = pool.allocate(1)
            if got is not None:
                held += got
                if warm_before:  # an ordinary cached block survives while warm ones exist
                    assert pool.num_cached_free - pool.num_warm >= cached_before
        elif op == "free" and held:
            pool.free([held.pop(k % len(held))])
        elif op == "cache" and held:
            b = held[k % len(held)]
            pool.cache(b, bytes([k]) * 16, [k])
        elif op == "warm":
            b = pool.place_warm(bytes([100 + k]) * 16, [100 + k])
            if b is not None:
                assert pool.ref_count(b) == 0 and pool.lookup(bytes([100 + k]) * 16, [100 + k]) == b
        elif op == "take":  # a request's prefix hit on a pre-warmed block
            b = pool.lookup(bytes([100 + k]) * 16, [100 + k])
            if b is not None:
                pool.touch([b])
                held.append(b)
        elif op == "reset":
            pool.evict_cached()
            assert pool.num_warm == 0
        pool.check_integrity()
        assert pool.num_used == len(set(held))


def test_a_blocks_pages_are_prewarmed_all_or_none():
    """``place_warm_pages`` (one page per KV group): with room for fewer than all pages,
    or one of them named already, nothing is placed or named."""
    pool = BlockPool(6, warm_limit=4)
    held = pool.allocate(4)
    assert held is not None and pool.num_free == 2
    names = [bytes([1]) * 16, bytes([2]) * 16, bytes([3]) * 16]
    assert pool.place_warm_pages(names, [7]) is None  # 3 pages, 2 free blocks
    assert pool.num_warm == 0 and pool.lookup(names[0], [7]) is None
    pages = pool.place_warm_pages(names[:2], [7])
    assert pages is not None and len(set(pages)) == 2 and pool.num_warm == 2
    assert [pool.lookup(n, [7]) for n in names[:2]] == pages
    pool.free(held[:2])
    assert pool.place_warm_pages([names[2], names[0]], [7]) is None  # names[0] is placed
    assert pool.lookup(names[2], [7]) is None
    pool.check_integrity()
