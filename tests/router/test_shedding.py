"""The router sheds before forwarding when every routable worker reported a full queue
(``WorkerPool.overload``): a 429 whose ``Retry-After`` is the excess at the workers'
completion rates; a worker with room, or one that reports no bound, lets requests in."""

from __future__ import annotations

from kvserve.ha.coordination import secret_fingerprint
from kvserve.router.config import RouterConfig
from kvserve.router.workers import Worker, WorkerPool


def _pool(*infos: dict) -> WorkerPool:
    pool = WorkerPool(None, RouterConfig(cluster="redis://127.0.0.1:1/0", cluster_secret="s"))  # type: ignore[arg-type]
    pool.registry_ok = True
    for i, info in enumerate(infos):
        w = Worker(f"w{i}", f"http://w{i}", {"secret_fp": secret_fingerprint("s"), **info})
        w.healthy = True
        pool.workers[w.node_id] = w
    return pool


def test_shed_only_when_every_worker_is_full():
    full = {"waiting": 4, "max_waiting": 4, "completion_rate": 0.5}
    assert _pool(full, full).overload() == 2  # 1 + 1 beyond the bounds at 0.5 + 0.5 per s
    assert _pool(full, {**full, "waiting": 3}).overload() is None  # one has room
    assert _pool(full, {"waiting": 99}).overload() is None  # an older worker: no bound
    assert _pool({**full, "completion_rate": 0.0}).overload() == 5  # nothing finished lately
    assert _pool({**full, "waiting": 400, "completion_rate": 1.0}).overload() == 60
    assert _pool().overload() is None  # no worker: the relay answers 503
