"""A real ``kvserve serve`` process driven by the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import openai
import pytest

from kvserve import LLM, SamplingParams
from kvserve.testing.procs import ServerProcess, running_server, wait_until

KEY = "sk-test-key"
ADMIN = "admin-secret"
ENGINE_FLAGS = ("--kv-cache-memory", "16MiB", "--max-model-len", "256")


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "serve.log"
    with running_server(
        llama_dir,
        *ENGINE_FLAGS,
        "--api-key",
        KEY,
        "--admin-key",
        ADMIN,
        "--served-model-name",
        "tiny",
        log=log,
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def offline(llama_dir):
    return LLM(str(llama_dir), kv_cache_memory="16MiB", max_model_len=256)


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _post(server, path: str, body: bytes | dict, key: str | None = KEY) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method="POST")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_completions_equal_offline_generate(server, offline):
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=16, n=2)
    want = [c.text for c in offline.generate(["def add(a, b):"], params, use_tqdm=False)[0].outputs]
    client = _client(server)
    got = client.completions.create(
        model="tiny", prompt="def add(a, b):", temperature=0.8, seed=7, max_tokens=16, n=2
    )
    assert [c.text for c in got.choices] == want
    assert got.usage.completion_tokens == 32 and got.usage.prompt_tokens > 0
    stream = client.completions.create(
        model="tiny",
        prompt="def add(a, b):",
        temperature=0.8,
        seed=7,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    assert text == want[0] and finish == "length" and usage.completion_tokens == 16


def test_chat_equal_offline_chat(server, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=12)
    want = offline.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    client = _client(server)
    got = client.chat.completions.create(
        model="tiny",
        messages=messages,
        temperature=0.7,
        seed=3,
        max_completion_tokens=12,
        logprobs=True,
        top_logprobs=2,
    )
    assert got.choices[0].message.content == want
    assert got.choices[0].message.role == "assistant"
    assert len(got.choices[0].logprobs.content) == 12
    assert all(len(t.top_logprobs) == 2 for t in got.choices[0].logprobs.content)
    parts = []
    for chunk in client.chat.completions.create(
        model="tiny", messages=messages, temperature=0.7, seed=3, max_tokens=12, stream=True
    ):
        parts += [c.delta.content or "" for c in chunk.choices]
    assert "".join(parts) == want


def test_models_health_ready(server):
    models = _client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    for path in ("/health", "/ready"):
        with urllib.request.urlopen(server.url + path, timeout=5) as r:
            assert r.status == 200


def test_32_concurrent_streams_and_aborts_free_kv(server):
    async def main() -> tuple[list[str], int]:
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120
        )

        async def one(i: int) -> str:
            stream = await client.completions.create(
                model="tiny",
                prompt=f"# request {i}\n",
                max_tokens=24,
                temperature=1.0,
                seed=i,
                stream=True,
            )
            out = ""
            async for chunk in stream:
                out += "".join(c.text for c in chunk.choices)
            return out

        async def abandoned(i: int) -> int:
            stream = await client.completions.create(
                model="tiny",
                prompt=f"# abandoned {i}\n" * 8,
                max_tokens=150,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            n = 0
            async for _chunk in stream:
                n += 1
                if n == 3:
                    break
            await stream.close()
            return n

        texts = await asyncio.gather(*(one(i) for i in range(32)))
        aborted = await asyncio.gather(*(abandoned(i) for i in range(4)))
        await client.close()
        return texts, sum(aborted)

    texts, chunks = asyncio.run(main())
    assert len(texts) == 32 and all(isinstance(t, str) for t in texts)
    assert chunks == 12
    wait_until(
        lambda: (
            server.metric('kvserve_kv_cache_blocks{model_name="tiny",state="used"}') == 0
            and server.metric("kvserve_num_requests_running") == 0
        ),
        30,
        "KV blocks freed after the streams",
    )
    assert server.metric('kvserve_kv_cache_blocks{model_name="tiny",state="used"}') == 0
    assert server.metric("kvserve_num_requests_running") == 0
    assert server.metric("kvserve_request_success_total") >= 32


@pytest.mark.parametrize(
    "body,status,fragment",
    [
        (b"{not json", 400, ""),
        ({"model": "tiny"}, 400, "prompt"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 10_000}, 400, "256"),
        ({"model": "tiny", "prompt": [99999], "max_tokens": 4}, 400, "vocabulary"),
        ({"model": "tiny", "prompt": ""}, 400, "empty"),
        ({"model": "nope", "prompt": "x"}, 404, "nope"),
        ({"model": "tiny", "prompt": "x", "stop_token_ids": [-(2**63) - 1]}, 400, "stop_token"),
        ({"model": "tiny", "prompt": "x", "top_k": 2**70}, 400, "top_k"),
        ({"model": "tiny", "prompt": "x", "priority": 2**70}, 400, "out of range"),
    ],
)
def test_errors_are_openai_shaped_and_server_survives(server, body, status, fragment):
    code, _, payload = _post(server, "/v1/completions", body)
    assert code == status
    assert set(payload["error"]) >= {"message", "type", "param", "code"}
    assert fragment in payload["error"]["message"]
    ok, _, _ = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert ok == 200


def test_auth_and_admin(server):
    code, _, payload = _post(server, "/v1/completions", {"prompt": "x"}, key="wrong")
    assert code == 401 and payload["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()
    code, _, _ = _post(server, "/admin/reset_prefix_cache", {}, key=KEY)
    assert code == 401
    code, _, payload = _post(server, "/admin/reset_prefix_cache", {}, key=ADMIN)
    assert code == 200 and "evicted_blocks" in payload
    bad = _post(server, "/v1/chat/completions", {"messages": [{"role": "nobody"}]})
    assert bad[0] == 400


def test_queue_full_429_and_graceful_drain(llama_dir, tmp_path):
    """One sequence at a time and a queue of one: a burst is refused with 429 and
    Retry-After; SIGTERM lets the running stream finish, refuses new work, exits 0."""
    proc = ServerProcess(
        llama_dir,
        "--kv-cache-memory",
        "16MiB",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "1",
        "--max-waiting-requests",
        "1",
        log=tmp_path / "serve.log",
    )
    try:
        proc.wait_ready()
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0, timeout=120)
        results: dict[str, object] = {}

        def long_stream(name: str) -> None:
            text = ""
            for chunk in client.completions.create(
                model=str(llama_dir),
                prompt="x",
                max_tokens=240,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                text += "".join(c.text for c in chunk.choices)
                results[name + "_started"] = True
            results[name] = text

        first = threading.Thread(target=long_stream, args=("first",))
        first.start()
        wait_until(lambda: results.get("first_started"), 30, "first stream started")
        # while "first" runs (~200 decode steps), five more arrive at once: one may wait,
        # the rest find the queue full
        codes: list[tuple[int, dict]] = []

        def post() -> None:
            body = {"prompt": "y", "max_tokens": 50, "ignore_eos": True}
            code, headers, _ = _post(proc, "/v1/completions", body, key=None)
            codes.append((code, headers))

        posts = [threading.Thread(target=post) for _ in range(5)]
        for t in posts:
            t.start()
        for t in posts:
            t.join(60)
        assert sorted(c for c, _ in codes)[-1] == 429, codes
        assert all(c in (200, 429) for c, _ in codes)
        # computed from the queue and the recent completion rate
        assert all(1 <= int(h.get("retry-after")) <= 60 for c, h in codes if c == 429)
        first.join(60)
        # graceful drain: a stream running at SIGTERM finishes, new work is refused, exit 0
        results.clear()
        second = threading.Thread(target=long_stream, args=("second",))
        second.start()
        wait_until(lambda: results.get("second_started"), 30, "second stream started")
        proc.proc.send_signal(signal.SIGTERM)
        try:
            late = _post(proc, "/v1/completions", {"prompt": "z"}, key=None)[0]
        except OSError:  # refused, or reset: a connect racing the listener's close
            late = "refused"
        assert late in (503, "refused")
        second.join(60)
        assert isinstance(results.get("second"), str) and len(results["second"]) > 0
        assert proc.proc.wait(60) == 0
    finally:
        proc.stop(signal.SIGKILL)


def _bench_serve(server, out, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "bench", "serve", "--url", server.url, *flags,
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize("client", ["http", "openai"])
def test_bench_serve_against_the_server(server, tmp_path, client):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    flags = ["--client", client, "--api-key", KEY, "--num-prompts", "12", "--concurrency", "4"]
    flags += ["--input-len", "16", "--output-len", "8", "--vocab", "512", "--plot", str(png)]
    proc = _bench_serve(server, out, *flags)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    s = result["summary"]
    assert s["completed"] == 12 and s["failed"] == 0
    assert s["total_output_tokens"] == 12 * 8
    assert s["p50_ttft_ms"] > 0 and s["output_throughput"] > 0
    assert all(1 <= len(r["itl"]) <= 7 for r in result["requests"])  # one per text chunk
    assert png.stat().st_size > 1000
    assert "HTTP Request:" not in proc.stderr + proc.stdout  # no log line per request
    assert result["summary"]["client"] == client


@pytest.mark.parametrize("client", ["http", "openai"])
def test_bench_serve_counts_refused_requests_as_failed(server, tmp_path, client):
    """A server that refuses (a wrong key) is a failed request each, and exit status 1."""
    out = tmp_path / "bench.json"
    flags = ["--client", client, "--api-key", "wrong", "--model", "m", "--num-prompts", "3"]
    proc = _bench_serve(server, out, *flags, "--vocab", "512", "--output-len", "4")
    assert proc.returncode == 1, proc.stderr[-2000:]
    records = json.loads(out.read_text())["requests"]
    assert [r["ok"] for r in records] == [False] * 3
    assert all("401" in r["error"] for r in records), records[0]["error"]
