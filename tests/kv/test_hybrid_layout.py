"""The hybrid KV layout's bookkeeping: layer groups, one block table per group over one
pool, sliding groups freeing what their window passed, and prefix hits per group."""

from __future__ import annotations

import torch

from kvserve.kv.manager import KVCacheManager
from kvserve.model.kv_cache import KVCacheSpec
from kvserve.model.kv_groups import KVGroups
from kvserve.model.kv_quant import kv_format
from kvserve.request import Request
from kvserve.sampling import SamplingParams
from kvserve.utils import cdiv

BS = 16
GEMMA3_270M = (512, 512, 512, 512, 512, 0) * 3  # 18 layers, 5 sliding : 1 global


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), seed=0, max_tokens=8)


def test_groups_of_equal_size_global_first():
    g = KVGroups.for_layer_windows(GEMMA3_270M)
    assert g.group_size == 3 and g.windows == (None, 512, 512, 512, 512, 512)
    assert [g.layer_group[i] for i in (5, 11, 17)] == [0, 0, 0]  # the global layers
    assert [g.layer_slot[i] for i in (5, 11, 17)] == [0, 1, 2]
    assert g.layer_group[:5] == (1, 1, 1, 2, 2)  # sliding layers fill groups in order
    for grp in range(g.num_groups):  # every group holds each slot once
        slots = sorted(s for s, x in zip(g.layer_slot, g.layer_group, strict=True) if x == grp)
        assert slots == [0, 1, 2]
    # Qwen-style: 8 sliding layers then 4 global ones (max_window_layers); two windows
    q = KVGroups.for_layer_windows((64,) * 8 + (0,) * 4)
    assert q.group_size == 4 and q.windows == (None, 64, 64)
    mixed = KVGroups.for_layer_windows((0, 32, 128, 32, 0, 128))
    assert mixed.group_size == 2 and mixed.windows == (None, 32, 128)
    assert not KVGroups.uniform(4).hybrid and KVGroups.uniform(4).group_size == 4


def test_a_block_holds_one_group_and_layers_share_tensors_by_slot():
    groups = KVGroups.for_layer_windows((8, 8, 0) * 2)  # 4 sliding, 2 global → pairs
    uniform = KVCacheSpec(6, 2, 16, torch.float32, BS)
    hybrid = KVCacheSpec(6, 2, 16, torch.float32, BS, groups=groups)
    assert hybrid.bytes_per_block * 3 == uniform.bytes_per_block
    assert hybrid.bytes_per_token == uniform.bytes_per_token  # a token in every layer
    caches = hybrid.allocate(4, torch.device("cpu"))
    assert len(caches) == 6
    for i in range(6):
        for j in range(6):
            same = groups.layer_slot[i] == groups.layer_slot[j]
            assert (caches[i].data_ptr() == caches[j].data_ptr()) == same
    fmt = kv_format("int8", torch.float32, "auto")
    q = KVCacheSpec.for_format(6, 2, 16, fmt, BS, groups=groups).allocate(
        4, torch.device("cpu"), fmt
    )
    a, b = (i for i in range(6) if groups.layer_slot[i] == 0 and i in (0, 2))
    assert q[a] is not q[b] and q[a].data is q[b].data  # own wrapper, shared codes


def _manager(num_blocks: int, windows: tuple[int, ...], caching: bool = False, step: int = 64):
    return KVCacheManager(
        num_blocks,
        BS,
        enable_caching=caching,
        reserve_null_block=True,
        groups=KVGroups.for_layer_windows(windows),
        max_step_tokens=step,
    )


def _run(kv: KVCacheManager, req: Request, chunk: int) -> list[int]:
    """Compute the request's prompt in chunks as the engine does; live blocks after each."""
    held = []
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
        kv.cache_full_blocks(req)
        kv.free_outside_windows(req)
        kv.check_integrity()
        held.append(kv.num_live_blocks(req.request_id))
    return held


def test_sliding_groups_hold_their_window_global_groups_everything():
    window = 64
    kv = _manager(400, (window, 0))
    req = _req("a", list(range(1000)))
    held = _run(kv, req, 100)
    for h, c in zip(held, range(100, 1001, 100), strict=True):
        sliding = cdiv(c, BS) - max(0, (c - window + 1) // BS)
        assert h == cdiv(c, BS) + sliding
        assert sliding <= cdiv(window, BS) + 1
    tables = kv.block_tables("a")
    assert len(tables) == 2 and len(tables[0]) == len(tables[1]) == cdiv(1000, BS)
    assert kv.pool.null_block not in tables[0]
    kv.free(req)
    kv.check_integrity()
    assert kv.pool.num_free == kv.num_blocks


def test_blocks_needed_bounds_what_a_sequence_takes():
    kv = _manager(10_000, (64, 64, 0), step=100)
    for n in (1, 63, 64, 65, 500, 1000):
        req = _req(f"r{n}", list(range(n)))
        peak = max(_run(kv, req, 100))
        assert peak <= kv.blocks_needed(n)
        kv.free(req)
    assert kv.capacity_tokens > kv.num_blocks // 3 * BS  # the window is not counted per token
    assert kv.can_ever_fit(kv.capacity_tokens) and not kv.can_ever_fit(kv.capacity_tokens + BS)


def test_prefix_hit_needs_every_global_page_and_the_window_of_sliding_ones():
    window = 40
    kv = _manager(400, (window, 0), caching=True)
    tokens = list(range(300))
    first = _req("a", tokens)
    _run(kv, first, 64)
    kv.free(first)
    again = _req("b", tokens)
    hit = kv.find_cached_prefix(again)
    n = (len(tokens) - 1) // BS  # 18 full blocks before the last token
    assert len(hit) == n
    null = kv.pool.null_block
    seen_from = (n * BS - window + 1) // BS
    assert all(h[0] != null for h in hit)
    assert [h[1] == null for h in hit] == [i < seen_from for i in range(n)]
    assert kv.allocate_slots(again, len(tokens) - n * BS, hit) is not None
    assert kv.stats.hits == n * BS
    kv.check_integrity()
    kv.free(again)
    # a sliding page inside that window reused for other data: the hit ends before it
    kv.pool._evict(hit[n - 2][1])  # what allocating that page for other data does
    short = kv.find_cached_prefix(_req("c", tokens))
    assert len(short) == n - 2
    assert kv.find_cached_prefix(_req("f", [7, *tokens[1:]])) == []


def test_swap_round_trip_rebuilds_every_group_table():
    """A swapped request's pages go out as one list, group after group (null entries
    left out), and come back into fresh pages in the same places of each group's table."""
    kv = _manager(200, (32, 0))
    req = _req("a", list(range(100)))
    _run(kv, req, 40)
    before = [list(t) for t in kv.block_tables("a")]
    flat = kv.swap_table("a")
    assert flat == [b for t in before for b in t]
    live = [b != kv.pool.null_block for b in flat]
    kv.free(req)
    fresh = kv.allocate_restored(req, live, 1)
    assert fresh is not None and len(fresh) == sum(live)  # 100 tokens + 1 fit 7 blocks
    after = kv.block_tables("a")
    assert [[b == kv.pool.null_block for b in t] for t in after] == [
        [b == kv.pool.null_block for b in t] for t in before
    ]
    assert [b for t in after for b in t if b != kv.pool.null_block] == fresh  # copy order
    kv.check_integrity()
    kv.free(req)
    more = kv.allocate_restored(req, live, 40)  # 140 tokens: two more blocks per group
    assert more is not None and len(more) == sum(live) + 2 * 2
    assert all(len(t) == 9 for t in kv.block_tables("a"))
    kv.check_integrity()
