"""What ``/metrics`` reports about the engine, as tables of (name, help, getter).

Each ``Stat`` is one metric family: a gauge, or a counter (``counter=True``) that only
grows. The getter reads the engine's state as it arrives at scrape time: ``EngineStats``
(every frame), ``KVStats`` (the snapshot taken per scrape), a tenant's ``TenantStats``
with the pool's block count, a tier's ``TierState``, ``StoreStats``, ``ReplicationStats``.
Families that are not one number per label set (blocks by state, preemptions, peaks,
latency histograms) are rendered by ``server.metrics`` itself. Names follow vLLM's with
the ``kvserve_`` prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Stat:
    """One metric family and how to read its value."""

    name: str
    help: str
    get: Callable[..., float]
    counter: bool = False


ENGINE = (  # EngineStats
    Stat("kvserve_num_requests_running", "Requests in the running batch.", lambda s: s.running),
    Stat("kvserve_num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.waiting),
    Stat("kvserve_kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).",
         lambda s: s.kv_blocks_used / max(s.kv_blocks_total, 1)),
    Stat("kvserve_kv_cache_used_bytes",
         "Bytes of KV in used blocks (the demand kvserve plan --prometheus reads).",
         lambda s: s.kv_blocks_used * s.kv_block_bytes),
    Stat("kvserve_kv_cache_capacity_bytes", "Bytes of the KV pool.",
         lambda s: s.kv_blocks_total * s.kv_block_bytes),
    Stat("kvserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
         lambda s: s.prefix_cache_queries, counter=True),
    Stat("kvserve_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
         lambda s: s.prefix_cache_hits, counter=True),
    Stat("kvserve_engine_loop_busy_seconds",
         "Engine-core loop time in iterations that ran a step (inputs, step, outputs).",
         lambda s: s.loop_seconds, counter=True),
    Stat("kvserve_engine_step_seconds", "Time inside engine steps.",
         lambda s: s.step_seconds, counter=True),
    Stat("kvserve_engine_forward_seconds", "Time in the model runner (forward pass and sampling).",
         lambda s: s.forward_seconds, counter=True),
)  # fmt: skip

SNAPSHOT = (  # KVStats
    Stat("kvserve_prefix_cache_hit_rate",
         "Prompt tokens found in the prefix cache / looked up, since start.",
         lambda k: k.prefix_cache_hit_rate),
    Stat("kvserve_kv_cache_internal_fragmentation_ratio",
         "Unused token slots in allocated blocks / allocated slots.",
         lambda k: k.internal_fragmentation),
    Stat("kvserve_kv_cache_free_fragmentation_ratio",
         "Free blocks / the longest run of consecutive free blocks (1 = one run).",
         lambda k: k.free_fragmentation),
    Stat("kvserve_swap_space_used_bytes", "Host swap space holding swapped-out requests' K/V.",
         lambda k: k.swap_used_bytes),
    Stat("kvserve_swap_space_capacity_bytes",
         "Host swap space bound (--swap-space; 0 when swapping is off).",
         lambda k: k.swap_capacity_bytes),
)  # fmt: skip

TENANT = (  # (TenantStats, blocks in the pool), label tenant
    Stat("kvserve_tenant_kv_blocks", "KV blocks charged to the tenant.", lambda d, _: d.blocks),
    Stat("kvserve_tenant_kv_limit_blocks", "The tenant's KV limit in blocks.",
         lambda d, _: d.limit),
    Stat("kvserve_tenant_kv_reservation_blocks", "The tenant's KV reservation in blocks.",
         lambda d, _: d.reservation),
    Stat("kvserve_tenant_num_requests_waiting", "The tenant's waiting requests.",
         lambda d, _: d.waiting),
    Stat("kvserve_tenant_num_requests_running", "The tenant's running requests.",
         lambda d, _: d.running),
    Stat("kvserve_tenant_kv_cache_usage_perc",
         "KV blocks charged to the tenant / blocks in the pool.",
         lambda d, pool: d.blocks / max(pool, 1)),
    Stat("kvserve_tenant_kv_limit_usage_perc", "KV blocks charged to the tenant / its limit.",
         lambda d, _: d.blocks / max(d.limit, 1)),
)  # fmt: skip

TIER = (  # TierState, label tier
    Stat("kvserve_kv_store_hits", "Blocks found in the tier.", lambda t: t.stats.hits, True),
    Stat("kvserve_kv_store_misses", "Blocks looked for in the tier and not found.",
         lambda t: t.stats.misses, True),
    Stat("kvserve_kv_store_read_bytes", "Bytes read from the tier.",
         lambda t: t.stats.bytes_read, True),
    Stat("kvserve_kv_store_written_bytes", "Bytes written to the tier.",
         lambda t: t.stats.bytes_written, True),
    Stat("kvserve_kv_store_errors", "Operations that failed (tier unavailable).",
         lambda t: t.stats.errors, True),
    Stat("kvserve_kv_store_dropped_writes",
         "Blocks not written to the tier (queue full or tier down).",
         lambda t: t.stats.dropped_writes, True),
    Stat("kvserve_kv_store_corrupt_blocks",
         "Stored blocks refused on load (corrupt, truncated, foreign).",
         lambda t: t.stats.corrupt, True),
    Stat("kvserve_kv_store_up", "1 while the tier's circuit breaker is closed.",
         lambda t: 1.0 if t.up else 0.0),
)  # fmt: skip

STORE = (  # StoreStats
    Stat("kvserve_kv_store_loaded_blocks", "Blocks restored from the store.",
         lambda s: s.loaded_blocks, True),
    Stat("kvserve_kv_store_saved_blocks", "Blocks offered to the store.",
         lambda s: s.saved_blocks, True),
    Stat("kvserve_kv_store_queue_depth", "Write batches queued for lower tiers.",
         lambda s: s.queue_depth),
)  # fmt: skip

REPLICATION = (  # ReplicationStats
    Stat("kvserve_replication_sessions", "Sessions this node replicates now.",
         lambda r: r.sessions),
    Stat("kvserve_replication_lag_tokens",
         "Most tokens any session generated that Redis has not acknowledged.",
         lambda r: r.lag_tokens),
    Stat("kvserve_replication_lag_seconds",
         "Longest time a lagging session waited since its last acknowledged publish.",
         lambda r: r.lag_seconds),
    Stat("kvserve_replication_records", "Session records written (fenced).",
         lambda r: r.published, True),
    Stat("kvserve_replication_record_bytes", "Bytes of session records written.",
         lambda r: r.bytes, True),
    Stat("kvserve_replication_errors", "Publishes that failed (Redis away).",
         lambda r: r.errors, True),
    Stat("kvserve_replication_fenced",
         "Sessions this node lost to a takeover (its writes refused).",
         lambda r: r.fenced, True),
    Stat("kvserve_replication_prewarmed_blocks",
         "Blocks of sessions this node is standby for, copied into its host tier.",
         lambda r: r.prewarmed_blocks, True),
    Stat("kvserve_replication_pushed_blocks",
         "Blocks pushed straight to standbys (--replicate-to standby).",
         lambda r: r.pushed_blocks, True),
    Stat("kvserve_replication_pushed_bytes",
         "Bytes pushed straight to standbys (blocks and records).",
         lambda r: r.pushed_bytes, True),
    Stat("kvserve_replication_push_errors", "Pushes to standbys that failed.",
         lambda r: r.push_errors, True),
    Stat("kvserve_replication_checkpoints",
         "Session checkpoints queued for the S3 tier (--replicate-to s3).",
         lambda r: r.checkpoints, True),
)  # fmt: skip
