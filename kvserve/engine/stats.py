"""Typed engine statistics: what the engine core reports and ``/metrics`` renders.

``EngineStats`` is small and rides on every output frame of the engine core (queue
lengths, pool occupancy, prefix-cache counters). ``KVStats`` is the full KV snapshot
(watermarks, fragmentation, tenants, preemptions, swap, store tiers, replication),
computed by ``engine.kv_metrics.snapshot`` on the engine core's loop when a scrape asks
for it. Both are msgspec Structs, so they cross the process boundary typed.
"""

from __future__ import annotations

import msgspec

from kvserve.store.tiered import TierStats


class EngineStats(msgspec.Struct, array_like=True):
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 1
    kv_blocks_cached_free: int = 0
    kv_block_bytes: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # seconds since start: in steps, in the model runner (forward + sampling), and in the
    # engine-core loop's busy iterations (steps + messages + sending outputs)
    step_seconds: float = 0.0
    forward_seconds: float = 0.0
    loop_seconds: float = 0.0
    # KV store tiers skipped now (their circuit breaker is open): reads miss, writes drop
    store_down: list[str] = []


class TenantStats(msgspec.Struct):
    blocks: int
    limit: int
    reservation: int
    waiting: int
    running: int


class PreemptionCount(msgspec.Struct):
    mode: str  # swap | recompute
    tenant: str
    reason: str  # pool | tenant_limit | reservation
    count: int


class TierState(msgspec.Struct):
    name: str
    up: bool
    stats: TierStats


class StoreStats(msgspec.Struct):
    tiers: list[TierState]
    queue_depth: int
    loaded_blocks: int
    saved_blocks: int
    load_failures: int


class ReplicationStats(msgspec.Struct):
    sessions: int
    lag_tokens: int
    lag_seconds: float
    published: int
    bytes: int
    errors: int
    fenced: int
    prewarmed_blocks: int
    pushed_blocks: int
    pushed_bytes: int
    push_errors: int
    checkpoints: int


class KVStats(msgspec.Struct):
    peak_usage: dict[str, float]  # window (1m|5m|1h) → peak fraction of blocks in use
    internal_fragmentation: float
    free_fragmentation: float
    tenants: dict[str, TenantStats]
    preemptions: list[PreemptionCount]
    swap_used_bytes: int
    swap_capacity_bytes: int
    prefix_cache_hit_rate: float
    cost_rates: dict[str, float]
    store: StoreStats | None = None
    replication: ReplicationStats | None = None
