"""A cluster misconfigured without (or with mismatched) cluster secrets is refused when it
starts, not discovered at the first failover (issue 17): ``kvserve serve --cluster`` and
``kvserve router`` exit before loading anything, and a router marks a worker whose secret
differs unroutable at once."""

from __future__ import annotations

import os
import subprocess
import sys

import openai
import pytest

from kvserve.testing.cluster import cluster, router_view
from kvserve.testing.procs import ServerProcess, wait_until


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KVSERVE_CLUSTER_SECRET"}
    return subprocess.run(
        [sys.executable, "-m", "kvserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.mark.parametrize("command", ["serve", "router"])
def test_cluster_without_a_secret_refuses_to_start(llama_dir, command):
    args = ["--model", str(llama_dir)] if command == "serve" else []
    # nothing listens on port 1: a check that waited for Redis (or weights) would show
    out = _run_cli(command, *args, "--cluster", "redis://127.0.0.1:1/0")
    assert out.returncode != 0
    assert "needs a cluster secret" in out.stderr
    assert "KVSERVE_CLUSTER_SECRET" in out.stderr
    assert "Loading weights" not in out.stderr + out.stdout  # refused before any work
    assert "Traceback" not in out.stderr


def test_a_worker_with_another_secret_is_unroutable_at_once(llama_dir, tmp_path):
    with cluster(llama_dir, tmp_path, nodes=("a",)) as c:
        other = ServerProcess(
            None,
            "--cluster",
            c.url,
            "--cluster-secret",
            "not-the-workers-secret",
            log=tmp_path / "other-router.log",
            command="router",
        )
        c.routers.append(other)  # stopped with the cluster

        def probed() -> bool:
            try:
                workers = router_view(other)["workers"]
            except OSError:  # not listening yet
                return False
            return len(workers) == 1 and workers[0]["healthy"]

        wait_until(probed, 60, "the second router probed the worker")
        view = router_view(other)["workers"][0]
        assert view["healthy"] and not view["secret_ok"] and not view["routable"]
        assert router_view(c.routers[0])["workers"][0]["routable"]  # the right secret
        client = openai.OpenAI(base_url=other.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=llama_dir.name, prompt="x", max_tokens=2)
        assert e.value.status_code == 503
        assert "different cluster secret" in other.log.read_text()
