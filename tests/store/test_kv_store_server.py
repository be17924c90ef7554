"""The KV store through the OpenAI server: a second server process sharing a file tier
restores the first one's prefix (reported in ``usage.prompt_tokens_details``), per-tier
metrics, and the session endpoints."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
from helpers import random_prompts

from kvserve.testing.procs import running_server

PROMPT = random_prompts([100], seed=5)[0]


def _http(method: str, url: str) -> tuple[int, dict]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _complete(server, llama_dir):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    return client.completions.create(
        model=str(llama_dir),
        prompt=PROMPT,
        max_tokens=8,
        temperature=0.0,
        extra_body={"ignore_eos": True, "session_id": "s1"},
    )


def test_a_second_server_restores_the_prefix_and_sessions_can_be_deleted(llama_dir, tmp_path):
    store = f"file://{tmp_path / 'kv'}?capacity=64MiB"
    args = ("--kv-cache-memory", "16MiB", "--max-model-len", "256", "--kv-store", store)
    with running_server(llama_dir, *args, log=tmp_path / "a.log") as a:
        first = _complete(a, llama_dir)
        status, session = _http("GET", a.url + "/v1/sessions/s1")
        assert status == 200 and session["num_tokens"] == 108 and session["num_blocks"] == 6
    with running_server(llama_dir, *args, log=tmp_path / "b.log") as b:
        second = _complete(b, llama_dir)
        assert second.choices[0].text == first.choices[0].text
        assert second.usage.prompt_tokens_details.cached_tokens == 96
        assert b.metric("kvserve_kv_store_hits_total") >= 6
        assert b.metric("kvserve_kv_store_loaded_blocks_total") == 6
        assert _http("DELETE", b.url + "/v1/sessions/s1")[0] == 200
        status, body = _http("GET", b.url + "/v1/sessions/s1")
        assert status == 404 and "s1" in body["error"]["message"]
        assert _http("DELETE", b.url + "/v1/sessions/s1")[0] == 404
    assert not list((tmp_path / "kv").rglob("*.kvb"))  # the session's blocks went with it


def test_sessions_need_a_store(llama_dir, tmp_path):
    with running_server(llama_dir, "--kv-cache-memory", "8MiB", log=tmp_path / "s.log") as s:
        status, body = _http("GET", s.url + "/v1/sessions/x")
        assert status == 404 and body["error"]["code"] == "no_kv_store"
