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
from kvserve.engine.stats import KVStats, StoreStats
from kvserve.server.metric_table import (
    ENGINE,
    REPLICATION,
    SNAPSHOT,
    STORE,
    TENANT,
    TIER,
    Stat,
)

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
    """Renders the engine's tables (``server.metric_table``) at scrape time."""

    def __init__(self, engine: AsyncLLM, model_name: str):
        self.engine = engine
        self.labels = {"model_name": model_name}
        self.snapshot: KVStats | None = None  # set by the /metrics handler

    def describe(self) -> list[Metric]:
        return []

    def _families(
        self, table: tuple[Stat, ...], rows: list[tuple[list[str], tuple]], label: str | None
    ) -> Iterator[Metric]:
        """One family per stat of ``table``: per row, the label values it adds (under
        ``label``) and the getter's arguments."""
        labels = [label] if label else []
        base = list(self.labels.values())
        for stat in table:
            family = self._labelled(stat.name, stat.help, *labels, counter=stat.counter)
            for extra, args in rows:
                family.add_metric([*base, *extra], stat.get(*args))
            yield family

    def _labelled(
        self, name: str, doc: str, *labels: str, counter: bool = False
    ) -> GaugeMetricFamily | CounterMetricFamily:
        """An empty family labelled with the model and ``labels``."""
        kind = CounterMetricFamily if counter else GaugeMetricFamily
        return kind(name, doc, labels=[*self.labels, *labels])

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        values = list(self.labels.values())
        yield from self._families(ENGINE, [([], (s,))], None)
        blocks = self._labelled("kvserve_kv_cache_blocks", "KV blocks by state.", "state")
        free = s.kv_blocks_total - s.kv_blocks_used
        blocks.add_metric([*values, "used"], s.kv_blocks_used)
        blocks.add_metric([*values, "cached_free"], s.kv_blocks_cached_free)
        blocks.add_metric([*values, "free"], free - s.kv_blocks_cached_free)
        yield blocks
        snap = self.snapshot
        if snap is None:
            return
        yield from self._families(SNAPSHOT, [([], (snap,))], None)
        pre = self._labelled(
            "kvserve_num_preemptions",
            "Requests preempted, by mode (swap|recompute), tenant and reason "
            "(pool|tenant_limit|reservation).",
            "mode",
            "tenant",
            "reason",
            counter=True,
        )
        for p in snap.preemptions:
            pre.add_metric([*values, p.mode, p.tenant, p.reason], p.count)
        yield pre
        peak = self._labelled(
            "kvserve_kv_cache_usage_peak_perc",
            "Peak fraction of KV blocks in use over a sliding window.",
            "window",
        )
        for window, v in snap.peak_usage.items():
            peak.add_metric([*values, window], v)
        yield peak
        tenants = [([t], (d, s.kv_blocks_total)) for t, d in snap.tenants.items()]
        yield from self._families(TENANT, tenants, "tenant")
        if snap.store is not None:
            yield from self._families(TIER, [([t.name], (t,)) for t in snap.store.tiers], "tier")
            yield self._latencies(snap.store)
            yield from self._families(STORE, [([], (snap.store,))], None)
        if snap.replication is not None:
            yield from self._families(REPLICATION, [([], (snap.replication,))], None)

    def _latencies(self, store: StoreStats) -> HistogramMetricFamily:
        from kvserve.store.tiered import LATENCY_BUCKETS

        values = list(self.labels.values())
        hist = HistogramMetricFamily(
            "kvserve_kv_store_operation_seconds",
            "Latency of store operations per tier.",
            labels=[*self.labels, "tier", "op"],
        )
        for t in store.tiers:
            st = t.stats
            for op, counts in sorted(st.latency_counts.items()):
                cumulative, buckets = 0, []
                for le, n in zip((*LATENCY_BUCKETS, float("inf")), counts, strict=True):
                    cumulative += n
                    buckets.append(("+Inf" if le == float("inf") else str(le), cumulative))
                hist.add_metric([*values, t.name, op], buckets, st.latency_sums[op])
        return hist


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
