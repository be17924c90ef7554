"""An abandoned non-streaming request stops consuming the engine: a client that gives up
after a second on a 1,900-token completion — straight to a worker, or through the router
— leaves no request running and no KV blocks held within a bounded time, and the
completion is counted as aborted, not as finished by length. A SIGTERM ends what outlives
the grace period cleanly."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time
import urllib.request

import pytest

from kvserve.default_model import DEFAULT_MODEL_DIR
from kvserve.testing.cluster import cluster
from kvserve.testing.procs import ServerProcess, running_server, wait_until

LONG = 1900
ADMIN = "sk-admin"
FLAGS = ("--kv-cache-memory", "64MiB", "--max-model-len", "2048", "--admin-key", ADMIN)


def _abandon(url: str, path: str, body: dict, after: float = 1.0) -> None:
    """POST ``body`` and close the connection: a non-streaming request after ``after``
    seconds without an answer, a stream once its first event has arrived."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=after)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    if body["stream"]:
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
    else:
        with pytest.raises((socket.timeout, TimeoutError)):
            conn.getresponse()  # the answer would take seconds: the client gives up
    conn.close()


def _completion(stream: bool = False) -> dict:
    return {"prompt": "def main():", "max_tokens": LONG, "ignore_eos": True,
            "temperature": 0.0, "stream": stream}  # fmt: skip


def _idle(server) -> bool:
    return (
        server.metric("kvserve_num_requests_running") == 0
        and server.metric("kvserve_kv_cache_blocks", 'state="used"') == 0
    )


def _consistent(server) -> None:
    """The engine's KV bookkeeping after the aborts (``check_integrity``) is sound."""
    req = urllib.request.Request(
        server.url + "/admin/check_integrity", b"{}", {"Authorization": f"Bearer {ADMIN}"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        assert json.loads(r.read()) == {"ok": True}


def test_a_worker_aborts_an_abandoned_request(tmp_path):
    with running_server(DEFAULT_MODEL_DIR, *FLAGS, log=tmp_path / "s.log") as server:
        for stream in (False, True):
            _abandon(server.url, "/v1/completions", _completion(stream))
            wait_until(lambda: _idle(server), 10, "the abandoned request is gone")
            _consistent(server)
        assert server.metric("kvserve_request_success_total", 'finished_reason="length"') == 0
        assert server.metric("kvserve_request_success_total", 'finished_reason="abort"') >= 2
        assert server.metric("kvserve_generation_tokens_total") < LONG


def test_the_router_passes_a_disconnect_on(tmp_path):
    with cluster(DEFAULT_MODEL_DIR, tmp_path, nodes=("a",), worker_args=FLAGS) as c:
        worker, router = c.workers["a"], c.routers[0]
        for stream in (False, True):
            _abandon(router.url, "/v1/completions", _completion(stream))
            wait_until(lambda: _idle(worker), 10, "the abandoned request is gone")
            _consistent(worker)
        assert worker.metric("kvserve_request_success_total", 'finished_reason="length"') == 0
        assert worker.metric("kvserve_generation_tokens_total") < LONG


def test_sigterm_ends_what_outlives_the_grace_period_without_a_traceback(tmp_path):
    """Draining waits --graceful-timeout for running requests; the ones still running
    then end with a 503 (whole) or an error event (stream: a router resumes it) instead
    of being cancelled mid-flight with a traceback, and the server exits 0."""
    server = ServerProcess(DEFAULT_MODEL_DIR, "--kv-cache-memory", "64MiB", "--max-model-len",
                           "8192", "--graceful-timeout", "1", log=tmp_path / "s.log")  # fmt: skip
    body = {**_completion(True), "max_tokens": 8000}
    results: dict[str, object] = {}
    try:
        server.wait_ready()
        host, port = server.url.removeprefix("http://").split(":")
        stream = http.client.HTTPConnection(host, int(port), timeout=60)
        stream.request("POST", "/v1/completions", json.dumps(body),
                       {"Content-Type": "application/json"})  # fmt: skip
        resp = stream.getresponse()
        assert resp.readline().startswith(b"data: ")

        def whole() -> None:
            conn = http.client.HTTPConnection(host, int(port), timeout=60)
            conn.request("POST", "/v1/completions", json.dumps({**body, "stream": False}),
                         {"Content-Type": "application/json"})  # fmt: skip
            results["whole"] = conn.getresponse().status

        t = threading.Thread(target=whole)
        t.start()
        wait_until(lambda: server.metric("kvserve_num_requests_running") == 2, 30, "both run")
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        rest = resp.read().decode()  # the stream ends: an error event, then the connection
        t.join(30)
        assert '"error"' in rest and "shutting down" in rest
        assert results["whole"] == 503
        assert server.proc.wait(30) == 0
        assert time.monotonic() - start < 15
    finally:
        server.stop(signal.SIGKILL)
    log = (tmp_path / "s.log").read_text()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    assert "ended 2 running request(s)" in log
