"""Prometheus metrics of one server, in a registry of its own (no global state).

Request metrics are observed by the HTTP handlers; engine and KV state is read at scrape
time from ``AsyncLLM.stats()`` (the engine core's newest ``EngineStats``) and from the
``KVStats`` snapshot the ``/metrics`` handler asks the engine core for just before rendering.
Names are vLLM's with the ``kvserve_`` prefix (``vllm:time_to_first_token_seconds`` →
``kvserve_time_to_first_token_seconds``).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kvserve.engine.async_llm import AsyncLLM
from kvserve.engine.stats import KVStats, ReplicationStats, StoreStats

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class _EngineCollector:
    def __init__(self, engine: AsyncLLM, model_name: str):
        self.engine = engine
        self.labels = {"model_name": model_name}
        self.snapshot: KVStats | None = None  # set by the /metrics handler

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        names = list(self.labels)
        values = list(self.labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("kvserve_num_requests_running", "Requests in the running batch.", s.running)
        yield gauge("kvserve_num_requests_waiting", "Requests waiting to be scheduled.", s.waiting)
        total = max(s.kv_blocks_total, 1)
        yield gauge(
            "kvserve_kv_cache_usage_perc",
            "Fraction of KV blocks in use (0-1).",
            s.kv_blocks_used / total,
        )
        yield gauge(
            "kvserve_kv_cache_used_bytes",
            "Bytes of KV in used blocks (the demand kvserve plan --prometheus reads).",
            s.kv_blocks_used * s.kv_block_bytes,
        )
        yield gauge(
            "kvserve_kv_cache_capacity_bytes",
            "Bytes of the KV pool.",
            s.kv_blocks_total * s.kv_block_bytes,
        )
        blocks = GaugeMetricFamily(
            "kvserve_kv_cache_blocks", "KV blocks by state.", labels=[*names, "state"]
        )
        free = s.kv_blocks_total - s.kv_blocks_used
        blocks.add_metric([*values, "used"], s.kv_blocks_used)
        blocks.add_metric([*values, "cached_free"], s.kv_blocks_cached_free)
        blocks.add_metric([*values, "free"], free - s.kv_blocks_cached_free)
        yield blocks
        yield counter(
            "kvserve_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries,
        )
        yield counter(
            "kvserve_prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            s.prefix_cache_hits,
        )
        for name, doc, value in (
            (
                "kvserve_engine_loop_busy_seconds",
                "Engine-core loop time in iterations that ran a step (inputs, step, outputs).",
                s.loop_seconds,
            ),
            ("kvserve_engine_step_seconds", "Time inside engine steps.", s.step_seconds),
            (
                "kvserve_engine_forward_seconds",
                "Time in the model runner (forward pass and sampling).",
                s.forward_seconds,
            ),
        ):
            yield counter(name, doc, value)
        snap = self.snapshot
        if snap is None:
            return
        yield gauge(
            "kvserve_prefix_cache_hit_rate",
            "Prompt tokens found in the prefix cache / looked up, since start.",
            snap.prefix_cache_hit_rate,
        )
        pre = CounterMetricFamily(
            "kvserve_num_preemptions",
            "Requests preempted, by mode (swap|recompute), tenant and reason "
            "(pool|tenant_limit|reservation).",
            labels=[*names, "mode", "tenant", "reason"],
        )
        for p in snap.preemptions:
            pre.add_metric([*values, p.mode, p.tenant, p.reason], p.count)
        yield pre
        peak = GaugeMetricFamily(
            "kvserve_kv_cache_usage_peak_perc",
            "Peak fraction of KV blocks in use over a sliding window.",
            labels=[*names, "window"],
        )
        for window, v in snap.peak_usage.items():
            peak.add_metric([*values, window], v)
        yield peak
        yield gauge(
            "kvserve_kv_cache_internal_fragmentation_ratio",
            "Unused token slots in allocated blocks / allocated slots.",
            snap.internal_fragmentation,
        )
        yield gauge(
            "kvserve_kv_cache_free_fragmentation_ratio",
            "Free blocks / the longest run of consecutive free blocks (1 = one run).",
            snap.free_fragmentation,
        )
        yield gauge(
            "kvserve_swap_space_used_bytes",
            "Host swap space holding swapped-out requests' K/V.",
            snap.swap_used_bytes,
        )
        yield gauge(
            "kvserve_swap_space_capacity_bytes",
            "Host swap space bound (--swap-space; 0 when swapping is off).",
            snap.swap_capacity_bytes,
        )
        per_tenant = {
            "kvserve_tenant_kv_blocks": ("KV blocks charged to the tenant.", "blocks"),
            "kvserve_tenant_kv_limit_blocks": ("The tenant's KV limit in blocks.", "limit"),
            "kvserve_tenant_kv_reservation_blocks": (
                "The tenant's KV reservation in blocks.",
                "reservation",
            ),
            "kvserve_tenant_num_requests_waiting": ("The tenant's waiting requests.", "waiting"),
            "kvserve_tenant_num_requests_running": ("The tenant's running requests.", "running"),
        }
        tenants = snap.tenants
        for name, (doc, key) in per_tenant.items():
            g = GaugeMetricFamily(name, doc, labels=[*names, "tenant"])
            for t, d in tenants.items():
                g.add_metric([*values, t], getattr(d, key))
            yield g
        usage = GaugeMetricFamily(
            "kvserve_tenant_kv_cache_usage_perc",
            "KV blocks charged to the tenant / blocks in the pool.",
            labels=[*names, "tenant"],
        )
        of_limit = GaugeMetricFamily(
            "kvserve_tenant_kv_limit_usage_perc",
            "KV blocks charged to the tenant / its limit.",
            labels=[*names, "tenant"],
        )
        for t, d in tenants.items():
            usage.add_metric([*values, t], d.blocks / total)
            of_limit.add_metric([*values, t], d.blocks / max(d.limit, 1))
        yield usage
        yield of_limit
        if snap.store is not None:
            yield from self._store_metrics(snap.store, names, values)
        if snap.replication is not None:
            yield from self._replication_metrics(snap.replication, names, values)

    def _replication_metrics(
        self, rep: ReplicationStats, names: list[str], values: list[str]
    ) -> Iterator[Metric]:
        gauges = {
            "kvserve_replication_sessions": ("Sessions this node replicates now.", "sessions"),
            "kvserve_replication_lag_tokens": (
                "Most tokens any session generated that Redis has not acknowledged.",
                "lag_tokens",
            ),
            "kvserve_replication_lag_seconds": (
                "Longest time a lagging session waited since its last acknowledged publish.",
                "lag_seconds",
            ),
        }
        for name, (doc, key) in gauges.items():
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, getattr(rep, key))
            yield g
        counters = {
            "kvserve_replication_records": ("Session records written (fenced).", "published"),
            "kvserve_replication_record_bytes": ("Bytes of session records written.", "bytes"),
            "kvserve_replication_errors": ("Publishes that failed (Redis away).", "errors"),
            "kvserve_replication_fenced": (
                "Sessions this node lost to a takeover (its writes refused).",
                "fenced",
            ),
            "kvserve_replication_prewarmed_blocks": (
                "Blocks of sessions this node is standby for, copied into its host tier.",
                "prewarmed_blocks",
            ),
            "kvserve_replication_pushed_blocks": (
                "Blocks pushed straight to standbys (--replicate-to standby).",
                "pushed_blocks",
            ),
            "kvserve_replication_pushed_bytes": (
                "Bytes pushed straight to standbys (blocks and records).",
                "pushed_bytes",
            ),
            "kvserve_replication_push_errors": ("Pushes to standbys that failed.", "push_errors"),
            "kvserve_replication_checkpoints": (
                "Session checkpoints queued for the S3 tier (--replicate-to s3).",
                "checkpoints",
            ),
        }
        for name, (doc, key) in counters.items():
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, getattr(rep, key))
            yield c

    def _store_metrics(
        self, store: StoreStats, names: list[str], values: list[str]
    ) -> Iterator[Metric]:
        from kvserve.store.tiered import LATENCY_BUCKETS

        counters = {
            "kvserve_kv_store_hits": ("Blocks found in the tier.", "hits"),
            "kvserve_kv_store_misses": ("Blocks looked for in the tier and not found.", "misses"),
            "kvserve_kv_store_read_bytes": ("Bytes read from the tier.", "bytes_read"),
            "kvserve_kv_store_written_bytes": ("Bytes written to the tier.", "bytes_written"),
            "kvserve_kv_store_errors": ("Operations that failed (tier unavailable).", "errors"),
            "kvserve_kv_store_dropped_writes": (
                "Blocks not written to the tier (queue full or tier down).",
                "dropped_writes",
            ),
            "kvserve_kv_store_corrupt_blocks": (
                "Stored blocks refused on load (corrupt, truncated, foreign).",
                "corrupt",
            ),
        }
        labels = [*names, "tier"]
        for name, (doc, field_name) in counters.items():
            c = CounterMetricFamily(name, doc, labels=labels)
            for t in store.tiers:
                c.add_metric([*values, t.name], getattr(t.stats, field_name))
            yield c
        up = GaugeMetricFamily(
            "kvserve_kv_store_up", "1 while the tier's circuit breaker is closed.", labels=labels
        )
        hist = HistogramMetricFamily(
            "kvserve_kv_store_operation_seconds",
            "Latency of store operations per tier.",
            labels=[*labels, "op"],
        )
        for t in store.tiers:
            up.add_metric([*values, t.name], 1.0 if t.up else 0.0)
            st = t.stats
            for op, counts in sorted(st.latency_counts.items()):
                cumulative, buckets = 0, []
                for le, n in zip((*LATENCY_BUCKETS, float("inf")), counts, strict=True):
                    cumulative += n
                    buckets.append(("+Inf" if le == float("inf") else str(le), cumulative))
                hist.add_metric([*values, t.name, op], buckets, st.latency_sums[op])
        yield up
        yield hist
        for name, doc, key in (
            ("kvserve_kv_store_loaded_blocks", "Blocks restored from the store.", "loaded_blocks"),
            ("kvserve_kv_store_saved_blocks", "Blocks offered to the store.", "saved_blocks"),
        ):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, getattr(store, key))
            yield c
        g = GaugeMetricFamily(
            "kvserve_kv_store_queue_depth", "Write batches queued for lower tiers.", labels=names
        )
        g.add_metric(values, store.queue_depth)
        yield g


class ServerMetrics:
    """The server's registry and the request-level instruments."""

    def set_snapshot(self, snapshot: KVStats | None) -> None:
        """The KV snapshot the next collection renders (None: only the basic gauges)."""
        self._engine_collector.snapshot = snapshot

    def __init__(self, engine: AsyncLLM, model_name: str):
        self.registry = CollectorRegistry()
        self._engine_collector = _EngineCollector(engine, model_name)
        self.registry.register(self._engine_collector)
        labels = ["model_name"]
        self.model_name = model_name
        r = self.registry
        self.ttft = Histogram(
            "kvserve_time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kvserve_inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvserve_e2e_request_latency_seconds",
            "Request latency, arrival to last token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvserve_prompt_tokens", "Prompt tokens processed.", labels, registry=r
        )
        self.generation_tokens = Counter(
            "kvserve_generation_tokens", "Tokens generated.", labels, registry=r
        )
        self.request_success = Counter(
            "kvserve_request_success",
            "Finished requests by finish reason.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.http_errors = Counter(
            "kvserve_http_errors", "Error responses by status.", [*labels, "status"], registry=r
        )
        self.pushed_blocks = Counter(
            "kvserve_replication_received_blocks",
            "Blocks primaries pushed to this standby, by verdict (accepted into the host "
            "tier, or refused: wrong key, tokens, format or checksum).",
            [*labels, "verdict"],
            registry=r,
        )
        self.prewarmed_blocks = Counter(
            "kvserve_replication_device_prewarmed_blocks",
            "Accepted pushed blocks also placed into the device pool as pre-warmed prefix "
            "blocks (--prewarm-device-fraction).",
            labels,
            registry=r,
        )
