"""The router's Prometheus series (``kvserve_router_*``), in one registry per router app.

Gauges read the live objects through the view callables given (the worker pool, the
tokenizers), so they are exact at scrape time; counters are incremented by the relay,
the KV sync and the tokenizer fetches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvserve.router.flow import Flow


class RouterMetrics:
    def __init__(
        self, pool_view: Callable[[], Any], tokenizers_view: Callable[[], Any] | None = None
    ):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvserve_router_requests", "Client requests routed", ["endpoint"], registry=r
        )
        self.shed = Counter(
            "kvserve_router_shed_requests",
            "Requests refused with 429 because every worker's queue was full.",
            registry=r,
        )
        self.failovers = Counter(
            "kvserve_router_failovers", "Streams continued on a standby", registry=r
        )
        self.failovers_detected = Counter(
            "kvserve_router_worker_failures",
            "Worker failures seen mid-request, by how they showed",
            ["how"],
            registry=r,
        )
        self.failover_failures = Counter(
            "kvserve_router_failover_failures",
            "Requests that failed because no standby could continue them",
            registry=r,
        )
        self.failover_seconds = Histogram(
            "kvserve_router_failover_seconds",
            "From detecting a failure to the standby's answer",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10),
            registry=r,
        )
        workers = Gauge("kvserve_router_workers", "Workers by state", ["state"], registry=r)
        workers.labels("known").set_function(lambda: len(pool_view().workers))
        workers.labels("routable").set_function(lambda: len(pool_view().routable()))
        self.decisions = Counter(
            "kvserve_router_decisions",
            "Placements by reason: affinity (the session's owner), prefix (the cheapest "
            "worker holds part of the prompt), load (no worker holds any), least_loaded, "
            "round_robin",
            ["reason"],
            registry=r,
        )
        self.cached_tokens = Counter(
            "kvserve_router_cached_tokens",
            "Prompt tokens served from cache on placed requests: predicted by the prefix "
            "index vs actual (the worker's usage)",
            ["kind"],
            registry=r,
        )
        self.placed_prompt_tokens = Counter(
            "kvserve_router_placed_prompt_tokens",
            "Prompt tokens of the requests placed by prefix routing",
            registry=r,
        )
        self.handoffs = Counter(
            "kvserve_router_handoffs",
            "Disaggregated requests handed from their prefill worker to a decode worker",
            registry=r,
        )
        self.handoff_seconds = Histogram(
            "kvserve_router_handoff_seconds",
            "From the prefill worker's first token to the decode worker's answer",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5),
            registry=r,
        )
        self.decision_seconds = Histogram(
            "kvserve_router_decision_seconds",
            "From a client request's arrival to its worker chosen (body parsing, "
            "tokenization, session owner look-up, placement)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1),
            registry=r,
        )
        self.kv_batches = Counter(
            "kvserve_router_kv_event_batches", "KV event batches applied", registry=r
        )
        self.tokenizer_fetches = Counter(
            "kvserve_router_tokenizer_fetches",
            "Tokenizers fetched from workers (prefix placement without --tokenizer), by "
            "outcome: ok, failed (unreachable, HTTP error), refused (did not rebuild to "
            "the worker's fingerprint)",
            ["outcome"],
            registry=r,
        )
        if tokenizers_view is not None:
            held = Gauge(
                "kvserve_router_tokenizers",
                "Tokenizers the router holds, by source: flag (--tokenizer), worker",
                ["source"],
                registry=r,
            )
            for source in ("flag", "worker"):
                held.labels(source).set_function(
                    lambda s=source: tokenizers_view().count(s) if tokenizers_view() else 0
                )
        self.kv_snapshots = Counter(
            "kvserve_router_kv_snapshots",
            "KV snapshots read (a worker joined, restarted or lost events)",
            registry=r,
        )

    def observe_cached(self, flow: Flow) -> None:
        """Count a placed request's predicted and actual cached tokens once it ended
        (with the worker's usage; a request that never got one is left out)."""
        if flow.predicted_cached is None or flow.cached_tokens is None:
            return
        self.cached_tokens.labels("predicted").inc(flow.predicted_cached)
        self.cached_tokens.labels("actual").inc(flow.cached_tokens)
        self.placed_prompt_tokens.inc(flow.placed_prompt_tokens)
        flow.predicted_cached = None
