"""A dependency that stalls: the Redis tier SIGSTOPped under a real server. Requests keep
being served (the tier's circuit breaker turns its reads into misses and drops its
writes), ``/ready`` stays 200 and names what is degraded, and once Redis is back the
breaker closes by itself and ``/ready`` says so."""

from __future__ import annotations

import itertools
import json
import signal
import threading
import time
import urllib.request

from agent_server import BUNDLED, MODEL, post
from tmpfs import small_disk

from kvserve.testing.procs import running_server, wait_until
from kvserve.testing.redis_procs import redis_server


def _ready(server) -> dict:
    with urllib.request.urlopen(server.url + "/ready", timeout=10) as r:
        assert r.status == 200
        return json.loads(r.read())


def test_a_stalled_redis_tier_is_reported_and_serving_goes_on(tmp_path):
    n = itertools.count()

    def served() -> bool:  # a new prompt: its lookup and its saves reach every tier
        i = next(n)
        body = {"model": MODEL, "prompt": f"def f{i}(x):\n" * 12, "max_tokens": 4}
        status, out = post(server, "/v1/completions", body)
        assert status == 200, out  # never a failed request because of the store
        return True

    with redis_server(tmp_path) as redis:
        store = f"redis://127.0.0.1:{redis.port}/0?timeout=0.5"
        args = ("--kv-cache-memory", "64MiB", "--max-model-len", "512", "--kv-store", store)
        with running_server(BUNDLED, *args, log=tmp_path / "s.log") as server:
            assert served() and _ready(server)["degraded"] == []
            redis.proc.send_signal(signal.SIGSTOP)
            try:
                wait_until(
                    lambda: served() and _ready(server)["degraded"] == ["kv_store:redis"],
                    30,
                    "the stalled tier reported",
                )
                assert _ready(server)["status"] == "degraded"
            finally:
                redis.proc.send_signal(signal.SIGCONT)
            wait_until(
                lambda: served() and _ready(server)["degraded"] == [], 60, "the tier is back"
            )
            assert server.metric("kvserve_kv_store_up", 'tier="redis"') == 1


def test_a_full_disk_under_the_file_tier_is_a_logged_miss(tmp_path):
    """The file tier on a real 128 KiB filesystem, told it may use 1 GiB: once the disk is
    full every request is still served (the blocks that did not fit are misses), the log
    says so once, and ``/ready`` stays ready."""
    with small_disk(tmp_path / "disk", "128k") as disk:
        store = f"file://{disk}?capacity=1GiB"
        args = ("--kv-cache-memory", "64MiB", "--max-model-len", "512", "--kv-store", store)
        log = tmp_path / "s.log"
        with running_server(BUNDLED, *args, log=log) as server:
            for i in range(12):
                body = {"model": MODEL, "prompt": f"def g{i}(x):\n" * 40, "max_tokens": 4}
                status, out = post(server, "/v1/completions", body)
                assert status == 200, out
            wait_until(lambda: "the disk is full" in log.read_text(), 30, "the full disk logged")
            assert _ready(server)["status"] == "ready"
        assert log.read_text().count("the disk is full") == 1
        assert "Traceback" not in log.read_text()


def test_redis_stalled_for_10s_under_session_load_costs_one_timeout(tmp_path):
    """A worker of a cluster whose coordinator and KV tier are one Redis, serving three
    clients' session requests (replicated every 8 tokens): Redis is SIGSTOPped for 10 s.
    No request fails, none waits longer than the store timeout (0.5 s) plus a step —
    only the call that finds Redis stalled waits, later ones skip the tier (a timeout
    is not retried) — and after SIGCONT the tier is back by itself."""
    timeout = 0.5
    with redis_server(tmp_path) as redis:
        url = f"redis://127.0.0.1:{redis.port}/0"
        args = ("--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--cluster", url,
                "--cluster-secret", "s", "--node-id", "a", "--replicate-every", "8",
                "--kv-store", f"{url}?timeout={timeout}")  # fmt: skip
        with running_server(BUNDLED, *args, log=tmp_path / "s.log") as server:
            phase = "before"
            seen: list[tuple[str, int, float]] = []
            stop = threading.Event()

            def client(c: int) -> None:
                for i in itertools.count():
                    if stop.is_set():
                        return
                    body = {"model": MODEL, "prompt": f"client {c} turn {i} " * 10,
                            "max_tokens": 24, "session_id": f"s{c}-{i % 3}"}  # fmt: skip
                    now, t0 = phase, time.perf_counter()
                    status, _ = post(server, "/v1/completions", body)
                    seen.append((now, status, time.perf_counter() - t0))

            threads = [threading.Thread(target=client, args=(c,)) for c in range(3)]
            for t in threads:
                t.start()
            try:
                wait_until(lambda: len(seen) >= 60, 60, "serving before the stall")
                phase = "stalled"
                redis.proc.send_signal(signal.SIGSTOP)
                stalled_at = time.monotonic()
                try:  # the stall: 10 s of it, with requests served all along
                    wait_until(
                        lambda: (
                            time.monotonic() - stalled_at >= 10
                            and sum(p == "stalled" for p, _, _ in seen) >= 30
                        ),
                        60,
                        "10 s of serving with Redis stopped",
                    )
                finally:
                    redis.proc.send_signal(signal.SIGCONT)
                phase = "after"
                wait_until(lambda: _ready(server)["degraded"] == [], 15, "the tier is back")
            finally:
                stop.set()
                for t in threads:
                    t.join(60)
        assert {status for _, status, _ in seen} == {200}
        before = max(s for p, _, s in seen if p == "before")
        stalled = [s for p, _, s in seen if p == "stalled"]
        assert len(stalled) >= 30, "serving stopped during the stall"
        assert max(stalled) <= timeout + 2 * before + 0.2, (max(stalled), before)
