"""`kvserve plan --prometheus` against a real Prometheus scraping a running kvserve."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.parse
import urllib.request

import numpy as np
import openai
import pytest

from kvserve.planner.prometheus import load_prometheus, parse_duration
from kvserve.planner.usage import analyze, load_usage
from kvserve.testing.procs import free_port, running_server, wait_until


@pytest.fixture
def prometheus(tmp_path):
    """Start Prometheus; returns (url, set_target) — the scrape target file is written by
    the test once the kvserve port is known (file_sd, refreshed every second)."""
    targets = tmp_path / "targets.json"
    targets.write_text("[]")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: kvserve\n"
        "    file_sd_configs: [{files: ['" + str(targets) + "'], refresh_interval: 1s}]\n"
    )
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            with urllib.request.urlopen(url + "/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        wait_until(ready, 60, "prometheus ready")
        yield url, lambda target: targets.write_text(json.dumps([{"targets": [target]}]))
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _raw_samples(url: str, seconds: int) -> list[float]:
    q = urllib.parse.urlencode({"query": f"sum(kvserve_kv_cache_used_bytes)[{seconds}s:1s]"})
    with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=10) as r:
        result = json.loads(r.read())["data"]["result"]
    return [float(v) for _, v in result[0]["values"]] if result else []


def test_plan_from_prometheus_matches_the_engine(llama_dir, tmp_path, prometheus):
    prom_url, set_target = prometheus
    usage_log = tmp_path / "usage.jsonl"
    with running_server(
        llama_dir,
        "--kv-cache-memory",
        "4MiB",
        "--max-model-len",
        "256",
        "--kv-usage-log",
        str(usage_log),
        "--kv-usage-interval",
        "0.05",
        log=tmp_path / "serve.log",
    ) as server:
        set_target(f"127.0.0.1:{server.port}")
        wait_until(lambda: len(_raw_samples(prom_url, 60)) >= 2, 60, "first scrapes")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        stop = threading.Event()

        def load() -> None:
            i = 0
            while not stop.is_set():
                client.completions.create(
                    model=str(llama_dir),
                    prompt=f"# {i}\n" * 20,
                    max_tokens=150,
                    extra_body={"ignore_eos": True},
                )
                i += 1

        workers = [threading.Thread(target=load) for _ in range(4)]
        for w in workers:
            w.start()
        try:
            wait_until(
                lambda: sum(v > 0 for v in _raw_samples(prom_url, 120)) >= 5,
                90,
                "scrapes under load",
            )
        finally:
            stop.set()
            for w in workers:
                w.join(60)
        cmd = [
            sys.executable,
            "-m",
            "kvserve.cli",
            "plan",
            "--prometheus",
            prom_url,
            "--range",
            "3m",
            "--step",
            "1s",
            "--json",
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        capacity = server.metric("kvserve_kv_cache_capacity_bytes")
        peak = server.metric("kvserve_kv_cache_usage_peak_perc", 'window="1h"') * capacity
    # the route computes exactly what the analysis of the same series gives
    ts, used = load_prometheus(prom_url, parse_duration("3m"), 1.0)
    direct = analyze(ts, used)
    assert report["max"] == direct.max > 0  # the peak lies inside both reads' windows
    assert report["samples"] == pytest.approx(direct.samples, abs=2)
    assert report["max"] <= capacity
    assert any("14 are needed" in w for w in direct.warnings)
    # and it agrees with the engine's own record: Prometheus samples a subset of instants,
    # so its peak cannot exceed the watermark the engine keeps from every step (the usage
    # log is itself a sample at other instants, so it bounds nothing); both saw real load
    _, file_used = load_usage(usage_log)
    assert 0 < report["max"] <= peak + 1e-6 * capacity
    assert file_used.max() <= peak + 1e-6 * capacity
    bytes_per_block = json.loads(usage_log.read_text().splitlines()[0])["bytes_per_block"]
    assert np.all(np.mod(used, bytes_per_block) == 0)  # whole blocks


def test_range_is_read_in_windows_of_at_most_10000_points(prometheus):
    url, _ = prometheus
    ts, used = load_prometheus(url, 1800.0, 0.1, query="vector(7)")
    assert len(ts) == 18001 and np.all(np.diff(ts) > 0) and np.all(used == 7)
    with pytest.raises(ValueError, match="duration"):
        parse_duration("fortnight")
