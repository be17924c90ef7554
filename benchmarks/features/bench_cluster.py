"""A two-worker cluster for routing benchmarks: workers pinned to one core each, one
router, every wait bounded (used by ``kv_routing.py`` and ``disaggregated.py``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from kvserve.testing.bench import http_get, poll_until, wait_ready
from kvserve.testing.procs import free_port


def add_cluster_args(p: argparse.ArgumentParser, max_model_len: int, kv_cache_memory: str) -> None:
    """The flags every cluster benchmark takes (model, rounds, the workers' KV, --out)."""
    p.add_argument("--model", required=True, help="HF model directory (with a tokenizer)")
    p.add_argument("--served-model", default=None, help="model id (default: the dir's name)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=max_model_len)
    p.add_argument("--kv-cache-memory", default=kv_cache_memory)
    p.add_argument("--out", default=None)


def parse_cluster_args(p: argparse.ArgumentParser) -> argparse.Namespace:
    a = p.parse_args()
    a.served_model = a.served_model or Path(a.model).name
    return a


@dataclass
class BenchCluster:
    router: str  # the router's base URL
    workers: dict[str, str]  # node → base URL


def start_cluster(
    procs,
    model: str,
    redis_url: str,
    secret: str,
    worker_args: dict[str, list[str]],
    router_args: list[str],
) -> BenchCluster:
    """Start ``kvserve serve`` for each node of ``worker_args`` (node → extra flags; the
    i-th pinned to the i-th allowed CPU with ``taskset``, bf16, ``--cluster``) and one
    ``kvserve router`` (unpinned); return when the router routes to every worker and
    has indexed the KV of every one that publishes."""
    cpus = sorted(os.sched_getaffinity(0))
    urls = {}
    for i, (node, extra) in enumerate(worker_args.items()):
        port = free_port()
        urls[node] = f"http://127.0.0.1:{port}"
        procs.start(node, [
            "taskset", "-c", str(cpus[i % len(cpus)]), sys.executable, "-m", "kvserve.cli",
            "serve", "--model", model, "--port", str(port), "--node-id", node,
            "--cluster", redis_url, "--cluster-secret", secret, "--dtype", "bfloat16",
            *extra])  # fmt: skip
    for node, url in urls.items():
        wait_ready(url, procs.procs[node], 600, "/ready")
    rport = free_port()
    procs.start("router", [
        sys.executable, "-m", "kvserve.cli", "router", "--port", str(rport),
        "--cluster", redis_url, "--cluster-secret", secret, *router_args])  # fmt: skip
    base = f"http://127.0.0.1:{rport}"

    def ready() -> bool:
        status, body = http_get(base + "/router/workers")
        if status != 200:
            return False
        ws = json.loads(body)["workers"]
        synced = all(w["kv_index"] is None or w["kv_index"]["synced"] for w in ws)
        return sum(w["routable"] for w in ws) == len(urls) and synced

    poll_until("the router sees every worker", ready, 60, procs.procs["router"])
    return BenchCluster(base, urls)
