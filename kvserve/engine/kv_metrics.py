"""KV-memory observations the engine reports for its metrics: peak usage (kept by
``engine.peak.PeakTracker``), fragmentation, per-tenant usage and queues, preemptions and
swap space, read from an engine's ``EngineParts``.

``snapshot`` is computed on the engine thread (the server asks for one per scrape), so it
reads a consistent state; nothing here is on the per-token path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvserve.engine.stats import (
    EngineStats,
    KVStats,
    PreemptionCount,
    ReplicationStats,
    StoreStats,
    TenantStats,
    TierState,
)

if TYPE_CHECKING:
    from kvserve.engine.parts import EngineParts

WINDOWS = {"1m": 60, "5m": 300, "1h": 3600}


def engine_stats(engine: EngineParts) -> EngineStats:
    """The cheap stats sent with every step's outputs."""
    kv, sched = engine.kv, engine.scheduler
    return EngineStats(
        running=len(sched.running),
        waiting=len(sched.waiting),
        kv_blocks_used=kv.pool.num_used,
        kv_blocks_total=kv.num_blocks,
        kv_blocks_cached_free=kv.pool.num_cached_free,
        kv_block_bytes=engine.kv_spec.bytes_per_block,
        prefix_cache_queries=kv.stats.queries,
        prefix_cache_hits=kv.stats.hits,
        num_preemptions=sched.num_preemptions,
        step_seconds=engine.step_seconds,
        forward_seconds=engine.forward_seconds,
        store_down=_store_down(engine),
    )


def _store_down(engine: EngineParts) -> list[str]:
    """The names of the KV store tiers whose circuit breaker is open now."""
    if engine.offloader is None:
        return []
    tiered = engine.offloader.store
    return [t.name for i, t in enumerate(tiered.tiers) if tiered.breaker_open(i)]


def engine_info(engine: EngineParts) -> dict[str, Any]:
    kv = engine.kv
    return {
        "bytes_per_token": engine.kv_spec.bytes_per_token,
        # hybrid: one block table per group of layers; a sliding group (its window in
        # tokens) holds only its window's blocks, a global one (None) every block
        "kv_layout": "hybrid" if kv.hybrid else "uniform",
        "kv_group_windows": list(kv.windows),
        "kv_layers_per_block": engine.kv_spec.block_layers,
        "num_blocks": kv.num_blocks,
        "block_size": kv.block_size,
        "max_model_len": engine.max_model_len,
        "kv_cache_dtype": engine.kv_format.name,
        "sliding_window": engine.window,
        "attention_sinks": engine.attention_sinks,
        "prefix_cache_queries": kv.stats.queries,
        "prefix_cache_hits": kv.stats.hits,
        "prefix_cache_hit_rate": kv.stats.hit_rate,
    }


def largest_free_run(free_blocks: list[int]) -> int:
    """Length of the longest run of consecutive block ids in ``free_blocks``."""
    best = run = 0
    prev = None
    for b in sorted(free_blocks):
        run = run + 1 if prev is not None and b == prev + 1 else 1
        best = max(best, run)
        prev = b
    return best


def snapshot(engine: EngineParts) -> KVStats:
    """Everything the KV metrics report, read on the engine thread."""
    kv, sched = engine.kv, engine.scheduler
    pool = kv.pool
    bs = kv.block_size
    engine.peak_usage.record(pool.num_used / kv.num_blocks)
    allocated = pool.num_used * bs
    unused = len(kv.windows) * sum(  # each group's last block is as full as group 0's
        max(len(kv.block_table(r.request_id)) * bs - r.num_computed_tokens, 0)
        for r in sched.running
    )
    free = pool.free_blocks()
    run = largest_free_run(free)
    ledger = kv.ledger
    queues = sched.queue_lengths()
    tenants = {}
    for t in sorted(set(ledger.usages()) | set(queues)):
        waiting, running = queues.get(t, (0, 0))
        tenants[t] = TenantStats(
            ledger.usage(t), ledger.limit(t), ledger.reservation(t), waiting, running
        )
    swap = engine.swap
    store = None
    if engine.offloader is not None:
        tiered = engine.offloader.store
        store = StoreStats(
            [
                TierState(t.name, not tiered.breaker_open(i), tiered.stats[i])
                for i, t in enumerate(tiered.tiers)
            ],
            tiered.queue_depth,
            engine.offloader.num_loaded_blocks,
            engine.offloader.num_saved_blocks,
            engine.offloader.num_load_failures,
        )
    return KVStats(
        peak_usage={name: engine.peak_usage.peak(sec) for name, sec in WINDOWS.items()},
        internal_fragmentation=unused / allocated if allocated else 0.0,
        free_fragmentation=len(free) / run if run else 1.0,
        tenants=tenants,
        preemptions=[
            PreemptionCount(mode, tenant, reason, n)
            for (mode, tenant, reason), n in sorted(sched.preemptions.items())
        ],
        swap_used_bytes=swap.used_bytes if swap else 0,
        swap_capacity_bytes=swap.capacity_bytes if swap else 0,
        prefix_cache_hit_rate=kv.stats.hit_rate,
        cost_rates=engine.cost_model.rates(),
        store=store,
        replication=_replication(engine),
    )


def _replication(engine: EngineParts) -> ReplicationStats | None:
    rep = engine.replicator
    if rep is None:
        return None
    lag = rep.lag().values()
    return ReplicationStats(
        sessions=len(lag),
        lag_tokens=max((n for n, _ in lag), default=0),
        lag_seconds=max((s for n, s in lag if n > 0), default=0.0),
        published=rep.num_published,
        bytes=rep.num_bytes,
        errors=rep.num_errors,
        fenced=rep.num_fenced,
        prewarmed_blocks=engine.prewarmer.num_blocks if engine.prewarmer else 0,
        pushed_blocks=rep.pusher.num_blocks if rep.pusher else 0,
        pushed_bytes=rep.pusher.num_bytes if rep.pusher else 0,
        push_errors=rep.pusher.num_errors if rep.pusher else 0,
        checkpoints=rep.checkpointer.num_written if rep.checkpointer else 0,
    )
