"""Overload with tenants: each tenant queues against its own bound
(``--max-waiting-requests``), so one tenant's flood gets 429s with a ``Retry-After`` while
another tenant is still admitted. One sequence runs at a time here (``--max-num-seqs 1``):
while a long stream runs, the others of its tenant wait without output (queued)."""

from __future__ import annotations

import openai
import pytest
from agent_server import BUNDLED, MODEL, tenants_file
from server_proc import running_server, wait_until

ACME, BETA = "sk-acme", "sk-beta"


def _client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_one_tenants_flood_is_refused_without_refusing_the_others(tmp_path):
    tenants = tenants_file(tmp_path / "tenants.json", {"acme": ACME, "beta": BETA})
    args = ("--kv-cache-memory", "64MiB", "--max-model-len", "2048", "--max-num-seqs", "1",
            "--max-waiting-requests", "2", "--tenants", str(tenants))  # fmt: skip
    with running_server(BUNDLED, *args, log=tmp_path / "s.log") as s:
        acme, beta = _client(s, ACME), _client(s, BETA)
        long = {"model": MODEL, "prompt": "go", "max_tokens": 1900, "stream": True,
                "extra_body": {"ignore_eos": True}}  # fmt: skip
        running = acme.completions.create(**long)
        next(iter(running))  # it runs (its first token is out): the only sequence
        queued = [acme.completions.create(**long) for _ in range(2)]  # added, no output
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
