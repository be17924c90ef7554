"""A cluster with no standby: the only worker is killed mid-stream. The router does not
hang: within ``--failover-timeout`` the stream ends with an error event that says no
standby could resume it, the failure is counted, and a new request is refused at once
(503, OpenAI-shaped) while no worker is routable."""

from __future__ import annotations

import signal
import threading
import time

import openai
import pytest
from router_client import router_client, session_spec, stream_via
from test_router import _router_metric

from kvserve.testing.cluster import cluster
from kvserve.testing.procs import wait_until


def test_with_no_standby_the_stream_ends_with_an_error_not_a_hang(llama_dir, tmp_path):
    args = ("--failover-timeout", "2")
    with cluster(llama_dir, tmp_path, nodes=("a",), router_args=args) as c:
        router = c.routers[0]
        client = router_client(router)
        spec = session_spec(1, str(llama_dir), "alone", 200)
        progress, result = [0], {}

        def run() -> None:
            try:
                result["r"] = stream_via(client, spec, progress)
            except openai.APIError as e:
                result["error"], result["at"] = e, time.monotonic()

        t = threading.Thread(target=run)
        t.start()
        wait_until(lambda: progress[0] >= 10, 60, "stream under way")
        killed = time.monotonic()
        c.workers["a"].proc.send_signal(signal.SIGKILL)
        t.join(30)
        assert not t.is_alive(), "the stream hung"
        assert "no standby could resume" in str(result["error"])
        assert result["at"] - killed <= 2 + 3  # the failover timeout plus detection
        assert _router_metric(router, "kvserve_router_failover_failures_total") == 1
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=str(llama_dir), prompt="anyone?", max_tokens=2)
        assert e.value.status_code == 503
