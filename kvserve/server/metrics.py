"""Prometheus metrics of one server, in a registry of its own (no global state).

Request metrics are observed by the HTTP handlers; engine and KV state is read at scrape
time from ``AsyncLLMEngine.stats()``. Names are vLLM's with the ``kvserve_`` prefix
(``vllm:time_to_first_token_seconds`` → ``kvserve_time_to_first_token_seconds``).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvserve.engine.async_engine import AsyncLLMEngine

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
    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.engine = engine
        self.labels = {"model_name": model_name}

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

        yield gauge("kvserve_num_requests_running", "Requests in the running batch.", s["running"])
        yield gauge(
            "kvserve_num_requests_waiting", "Requests waiting to be scheduled.", s["waiting"]
        )
        total = max(s["kv_blocks_total"], 1)
        yield gauge(
            "kvserve_kv_cache_usage_perc",
            "Fraction of KV blocks in use (0-1).",
            s["kv_blocks_used"] / total,
        )
        yield gauge(
            "kvserve_kv_cache_used_bytes",
            "Bytes of KV in used blocks (the demand kvserve plan --prometheus reads).",
            s["kv_blocks_used"] * s["kv_block_bytes"],
        )
        yield gauge(
            "kvserve_kv_cache_capacity_bytes",
            "Bytes of the KV pool.",
            s["kv_blocks_total"] * s["kv_block_bytes"],
        )
        blocks = GaugeMetricFamily(
            "kvserve_kv_cache_blocks", "KV blocks by state.", labels=[*names, "state"]
        )
        free = s["kv_blocks_total"] - s["kv_blocks_used"]
        blocks.add_metric([*values, "used"], s["kv_blocks_used"])
        blocks.add_metric([*values, "cached_free"], s["kv_blocks_cached_free"])
        blocks.add_metric([*values, "free"], free - s["kv_blocks_cached_free"])
        yield blocks
        yield counter(
            "kvserve_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s["prefix_cache_queries"],
        )
        yield counter(
            "kvserve_prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            s["prefix_cache_hits"],
        )
        yield counter(
            "kvserve_num_preemptions", "Requests preempted (recompute).", s["num_preemptions"]
        )


class ServerMetrics:
    """The server's registry and the request-level instruments."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
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
