"""Failover between real worker processes sharing a real Redis: a client streams from
worker A, A is killed with SIGKILL mid-stream, worker B continues the stream through
``/internal/resume`` from the tokens and text the client already has — the joined stream
equals an uninterrupted run exactly (greedy and seeded sampling). The test plays the
router's part, so the endpoint's contract (authentication included) is checked on its own;
``test_router.py`` runs the same through ``kvserve router``."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request

import openai
import pytest
from helpers import random_prompts

from kvserve.ha.coordination import Coordinator
from kvserve.testing.procs import ServerProcess, wait_until
from kvserve.testing.redis_procs import redis_server

SECRET = "s3cret"
PROMPT = random_prompts([40], seed=12)[0]


@pytest.fixture
def cluster(llama_dir, tmp_path):
    tmp = tmp_path
    with redis_server(tmp) as server:
        url = f"redis://127.0.0.1:{server.port}/0"
        args = (
            "--kv-cache-memory", "16MiB", "--max-model-len", "256", "--cluster", url,
            "--kv-store", url, "--cluster-secret", SECRET, "--replicate-every", "16",
            "--dtype", "bfloat16",  # the serving default: exactness must hold in bf16
        )  # fmt: skip
        workers = {
            n: ServerProcess(llama_dir, *args, "--node-id", n, log=tmp / f"{n}.log")
            for n in ("a", "b")
        }
        try:
            for w in workers.values():
                w.wait_ready()
            coord = Coordinator.from_url(url)
            wait_until(lambda: set(coord.nodes()) == {"a", "b"}, 30, "both workers registered")
            yield url, workers
        finally:
            for w in workers.values():
                w.stop(signal.SIGKILL)


def _post(url: str, body: dict, headers: dict | None = None):
    """(status, response object or error body); the response is open for streaming."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        return 200, urllib.request.urlopen(req, timeout=60)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _sse(response) -> list[dict]:
    out = []
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_killed_workers_stream_continues_on_another(cluster, llama_dir, temperature):
    url, workers = cluster
    a, b = workers["a"], workers["b"]
    body = {
        "model": str(llama_dir),
        "prompt": PROMPT,
        "max_tokens": 60,
        "temperature": temperature,
        "seed": 7,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    status, resp = _post(b.url + "/v1/completions", body)
    assert status == 200
    ref = json.loads(resp.read())
    want_text, want_ids = ref["choices"][0]["text"], ref["choices"][0]["token_ids"]

    session = f"fo-{temperature}"
    client = openai.OpenAI(base_url=a.url + "/v1", api_key="x", max_retries=0)
    extra = {k: body[k] for k in ("ignore_eos", "return_token_ids")} | {"session_id": session}
    stream = client.completions.create(
        model=body["model"],
        prompt=PROMPT,
        max_tokens=60,
        temperature=temperature,
        seed=7,
        stream=True,
        extra_body=extra,
    )
    text, ids = "", []
    coord = Coordinator.from_url(url)
    for chunk in stream:
        text += chunk.choices[0].text
        ids += chunk.choices[0].token_ids
        if len(ids) >= 35:
            break

    def replicated() -> bool:
        own = coord.owner(session)
        return own is not None and own.state is not None

    wait_until(replicated, 30, "a record of the session in Redis")
    a.proc.send_signal(signal.SIGKILL)  # mid-stream
    a.proc.wait(10)

    resume = {
        "session_id": session,
        "delivered_token_ids": ids,
        "delivered_text_chars": len(text),
        "kind": "completion",
        "request": body | {"stream": True, "session_id": session},
    }
    status, _ = _post(b.url + "/internal/resume", resume)
    assert status == 401  # no cluster secret, even from loopback
    status, _ = _post(b.url + "/internal/resume", resume, {"X-Kvserve-Cluster-Secret": "nope"})
    assert status == 401
    status, r = _post(b.url + "/internal/resume", resume, {"X-Kvserve-Cluster-Secret": SECRET})
    assert status == 200, r
    with r:
        chunks = _sse(r)
    text += "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    ids += [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]]
    assert ids == want_ids  # nothing lost, nothing repeated
    assert text == want_text
    assert coord.owner(session).node == "b"
