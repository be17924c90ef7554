"""Overload with tenants: each tenant queues against its own bound
(``--max-waiting-requests``), so one tenant's flood gets 429s with a ``Retry-After`` while
another tenant is still admitted. One sequence runs at a time here (``--max-num-seqs 1``):
while a long stream runs, the others of its tenant wait without output (queued)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

import openai
import pytest
from agent_server import BUNDLED, MODEL, tenants_file

from kvserve.testing.procs import running_server, wait_until

ACME, BETA = "sk-acme", "sk-beta"


# one sequence runs, two may wait (per tenant); a stream long enough to hold the seat
ONE_SEAT = ("--kv-cache-memory", "64MiB", "--max-model-len", "2048", "--max-num-seqs", "1",
            "--max-waiting-requests", "2")  # fmt: skip
LONG = {"model": MODEL, "prompt": "go", "max_tokens": 1900, "stream": True,
        "extra_body": {"ignore_eos": True}}  # fmt: skip


def _client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_one_tenants_flood_is_refused_without_refusing_the_others(tmp_path):
    tenants = tenants_file(tmp_path / "tenants.json", {"acme": ACME, "beta": BETA})
    with running_server(BUNDLED, *ONE_SEAT, "--tenants", str(tenants), log=tmp_path / "s.log") as s:
        acme, beta = _client(s, ACME), _client(s, BETA)
        running = acme.completions.create(**LONG)
        next(iter(running))  # it runs (its first token is out): the only sequence
        queued = [acme.completions.create(**LONG) for _ in range(2)]  # added, no output
        with pytest.raises(openai.RateLimitError) as e:
            acme.completions.create(model=MODEL, prompt="one more", max_tokens=4)
        assert "tenant 'acme'" in e.value.message
        assert 1 <= int(e.value.response.headers["retry-after"]) <= 60
        # the other tenant is admitted meanwhile (a stream: answered once it is queued)
        other = beta.completions.create(model=MODEL, prompt="meanwhile", max_tokens=4,
                                        stream=True)  # fmt: skip
        for stream in (running, *queued):  # the flood gives up: its requests are aborted
            stream.close()
        assert [c.choices[0].finish_reason for c in other][-1] == "length"


def test_a_tenant_s_own_queue_bound_from_the_tenants_file(tmp_path):
    """``acme`` may queue one request (its ``max_waiting_requests``), ``beta`` the
    server's two: behind one long stream, acme's second request is refused, beta's is
    not."""
    keys = {"acme": ACME, "beta": BETA}
    tenants = tenants_file(tmp_path / "t.json", keys, {"acme": {"max_waiting_requests": 1}})
    with running_server(BUNDLED, *ONE_SEAT, "--tenants", str(tenants), log=tmp_path / "s.log") as s:
        acme, beta = _client(s, ACME), _client(s, BETA)
        running = beta.completions.create(**LONG)
        next(iter(running))  # the only seat
        queued = [acme.completions.create(**LONG), beta.completions.create(**LONG)]
        with pytest.raises(openai.RateLimitError) as e:
            acme.completions.create(model=MODEL, prompt="one more", max_tokens=4)
        assert "tenant 'acme'" in e.value.message
        queued.append(beta.completions.create(**LONG))  # beta's second place
        for stream in (running, *queued):
            stream.close()


def test_a_request_without_output_past_the_queue_timeout_is_refused(tmp_path):
    args = ("--kv-cache-memory", "64MiB", "--max-model-len", "2048", "--max-num-seqs", "1",
            "--queue-timeout", "0.3")  # fmt: skip
    with running_server(BUNDLED, *args, log=tmp_path / "s.log") as s:
        client = _client(s, "x")
        running = client.completions.create(
            model=MODEL, prompt="go", max_tokens=2000, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(running))  # the only sequence, for its 2000 tokens (~2 s here)
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt="waits", max_tokens=4)
        assert e.value.code == "queue_timeout"
        assert 1 <= int(e.value.response.headers["retry-after"]) <= 60
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "waits"}], max_tokens=4,
            stream=True,
        )  # fmt: skip
        with pytest.raises(openai.APIError) as e:
            list(stream)
        assert "queue-timeout" in str(e.value)
        running.close()
        # the refused requests left the engine's queue (aborted, not left to run later)
        wait_until(lambda: s.metric("kvserve_num_requests_waiting") == 0, 10, "queue empty")
        assert s.metric("kvserve_request_success_total", 'finished_reason="abort"') >= 2


def _timed(server, key: str, body: dict) -> tuple[float, int, dict[str, str]]:
    """(seconds, status, headers) of one raw POST /v1/completions."""
    req = urllib.request.Request(
        server.url + "/v1/completions",
        data=json.dumps({"model": MODEL, **body}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
            status, headers = r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        e.read()
        status, headers = e.code, dict(e.headers)
    return time.perf_counter() - t0, status, {k.lower(): v for k, v in headers.items()}


def test_a_reserved_tenant_keeps_its_latency_under_a_10x_burst_of_two_others(tmp_path):
    """Four seats; ``gold`` (priority 10, a 25 % reservation) asks one-token questions of
    ~200 tokens one after another — its TTFT — alone, then while ``beta`` and ``gamma``
    burst 40 long completions at once (10× the seats). The burst gets 200s and 429s
    with ``Retry-After``, no 5xx; while the admitted ones hold every seat and queue place,
    gold's p99 TTFT stays within 2× its unloaded p99 (it takes a seat from the flood
    instead of waiting for one to finish)."""
    keys = {"gold": "sk-gold", "beta": "sk-beta", "gamma": "sk-gamma"}
    gold = {"priority": 10, "reservation": "25%"}
    tenants = tenants_file(tmp_path / "tenants.json", keys, {"gold": gold})
    args = ("--kv-cache-memory", "64MiB", "--max-model-len", "2048", "--max-num-seqs", "4",
            "--max-waiting-requests", "4", "--tenants", str(tenants))  # fmt: skip
    question = "what about the weather " * 40

    def gold_p99(n: int = 200) -> float:
        times = []
        for i in range(n):
            seconds, status, _ = _timed(
                s, "sk-gold", {"prompt": f"{i} {question}", "max_tokens": 1}
            )
            assert status == 200
            times.append(seconds)
        return sorted(times)[int(0.99 * n) - 1]

    def trial() -> tuple[float, float]:
        """(gold's p99 TTFT alone, under the burst); checks the burst's answers."""
        unloaded = gold_p99()
        burst: list[tuple[float, int, dict[str, str]]] = []
        flood = {"prompt": "flood " * 20, "max_tokens": 600, "ignore_eos": True}
        threads = [
            threading.Thread(target=lambda k=k: burst.append(_timed(s, k, flood)))
            for _ in range(20)
            for k in ("sk-beta", "sk-gamma")
        ]
        for t in threads:
            t.start()

        def settled() -> bool:  # every burst request refused, or holding a seat or a place
            held = s.metric("kvserve_num_requests_running") + s.metric(
                "kvserve_num_requests_waiting"
            )
            return len(burst) + held == len(threads)

        wait_until(settled, 30, "the burst admitted or refused")
        loaded = gold_p99()
        assert sum(t.is_alive() for t in threads) >= 8, "the burst ended before gold did"
        for t in threads:
            t.join(120)
        codes = Counter(status for _, status, _ in burst)
        assert set(codes) == {200, 429} and codes[200] >= 8, codes  # 4 queued per tenant
        assert all(1 <= int(h["retry-after"]) <= 60 for _, c, h in burst if c == 429)
        return unloaded, loaded

    with running_server(BUNDLED, *args, log=tmp_path / "s.log") as s:
        gold_p99(10)  # warm
        # a p99 of 200 requests on 2 shared cores is noisy both ways (an unloaded p99 of
        # 2× its median happens): a second trial where the first missed. Without the seat
        # rule gold waits for a flood request to end: ~100× its unloaded p99, every trial.
        unloaded, loaded = trial()
        if loaded > 2 * unloaded:
            unloaded, loaded = trial()
        assert loaded <= 2 * unloaded, f"gold p99 TTFT {loaded:.4f}s vs {unloaded:.4f}s alone"
        assert s.metric("kvserve_num_preemptions_total", 'reason="reservation"') >= 1
