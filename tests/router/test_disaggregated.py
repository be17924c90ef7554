"""Disaggregated prefill/decode on real processes (issue 18): a ``--role prefill`` worker,
two ``--role decode`` workers, one ``redis-server``, a router, the official ``openai``
client, workers in bf16.

Streams through the router (greedy and seeded, completion and chat) start on the prefill
worker, are handed to a decode worker after their first token, and are identical to the
same requests streamed on one worker alone. SIGKILL of the prefill worker with a long
prompt sent to it (before its first token), and of the decode worker mid-stream, still
yield the identical text."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import openai
from router_client import router_client, stream_via

from kvserve.testing.cluster import cluster, router_view
from kvserve.testing.procs import wait_until

WORDS = ["amber", "falcon", "meadow", "copper", "lantern", "harbor", "willow", "summit"]
LONG = " ".join(WORDS[(k * 5) % len(WORDS)] + str(k % 11) for k in range(150))


def _spec(i: int, model: str, prompt: str | None = None, max_tokens: int = 48) -> dict:
    """Stream ``i``: completion (even) or chat (odd), greedy (i % 4 < 2) or seeded; the
    prompt spans several full KV blocks (the decode worker restores them)."""
    text = prompt or " ".join(f"{WORDS[(i + k) % len(WORDS)]}{k % 7}" for k in range(24 + i))
    spec: dict = {"model": model, "max_tokens": max_tokens, "extra_body": {"ignore_eos": True}}
    if i % 4 >= 2:
        spec |= {"temperature": 0.9, "seed": 1000 + i}
    else:
        spec["temperature"] = 0.0
    if i % 2:
        spec["messages"] = [{"role": "user", "content": text}]
    else:
        spec["prompt"] = text
    return spec


def _alone(worker, spec: dict) -> str:
    """The text of ``spec`` streamed on ``worker`` itself (no router)."""
    client = openai.OpenAI(base_url=worker.url + "/v1", api_key="x", max_retries=0, timeout=60)
    chat = "messages" in spec
    api = client.chat.completions if chat else client.completions
    text = ""
    for chunk in api.create(stream=True, **spec):
        if chunk.choices:
            text += (chunk.choices[0].delta.content if chat else chunk.choices[0].text) or ""
    return text


def _via_router(client, spec: dict) -> tuple[str, str, int]:
    """(first worker, text, cached prompt tokens on the worker that finished it)."""
    chat = "messages" in spec
    api = client.chat.completions if chat else client.completions
    raw = api.with_raw_response.create(stream=True, stream_options={"include_usage": True}, **spec)
    text, cached = "", -1
    for chunk in raw.parse():
        if chunk.choices:
            text += (chunk.choices[0].delta.content if chat else chunk.choices[0].text) or ""
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return raw.headers["x-kvserve-worker"], text, cached


def _inflight(router, node: str) -> int:
    return next(w["inflight"] for w in router_view(router)["workers"] if w["id"] == node)


def _running(worker) -> float:
    try:
        return worker.metric("kvserve_num_requests_running")
    except OSError:
        return 0.0


def test_prefill_then_decode_streams_what_one_worker_streams(llama_dir, tmp_path):
    roles = {"p": ("--role", "prefill"), "d1": ("--role", "decode"), "d2": ("--role", "decode")}
    with cluster(
        llama_dir,
        tmp_path,
        nodes=("p", "d1", "d2"),
        worker_args=("--max-model-len", "1024"),
        node_args=roles,
    ) as c:
        router = c.routers[0]
        assert {w["id"]: w["role"] for w in router_view(router)["workers"]} == {
            "p": "prefill", "d1": "decode", "d2": "decode"
        }  # fmt: skip
        model = str(llama_dir)
        specs = [_spec(i, model) for i in range(4)]
        want = [_alone(c.workers["d1"], s) for s in specs]  # one worker alone
        client = router_client(router)
        restored = 0
        for i, s in enumerate(specs):
            first, text, cached = _via_router(client, s)
            assert first == "p", f"stream {i} started on {first}"
            assert text == want[i], f"stream {i} differs after the hand-over"
            restored += cached
        assert restored >= 16  # the decode workers restored prompt blocks, not only computed
        assert router.metric("kvserve_router_handoffs_total") == 4
        assert router.metric("kvserve_router_failovers_total") == 0

        # the prefill worker dies with a long prompt sent to it, before its first token: it
        # is stopped first, so the kill cannot come too late
        long_spec = _spec(0, model, LONG, max_tokens=24)
        long_want = _alone(c.workers["d2"], long_spec)
        got: list = [None]

        def run() -> None:
            try:
                got[0] = stream_via(client, long_spec)
            except Exception as e:  # reported by the assertion below
                got[0] = ("error", repr(e))

        c.workers["p"].proc.send_signal(signal.SIGSTOP)
        t = threading.Thread(target=run)
        t.start()
        wait_until(lambda: _inflight(router, "p") >= 1, 30, "the long prompt sent to p")
        c.workers["p"].proc.send_signal(signal.SIGKILL)
        t.join(120)
        assert got[0] is not None and got[0][1] == long_want, got[0]
        assert router.metric("kvserve_router_failovers_total") >= 1

        # a decode worker dies mid-stream (p is gone: the other one takes whole requests)
        spec = _spec(3, model, max_tokens=160)
        want3 = _alone(c.workers["d2"], spec)
        progress = [0]
        res: list = [None]

        def run2() -> None:
            try:
                res[0] = stream_via(client, spec, progress)
            except Exception as e:
                res[0] = ("error", repr(e))

        t = threading.Thread(target=run2)
        t.start()
        wait_until(lambda: progress[0] >= 16, 60, "the stream under way")
        serving = max(("d1", "d2"), key=lambda n: _running(c.workers[n]))
        c.workers[serving].proc.send_signal(signal.SIGKILL)
        t.join(120)
        assert res[0] is not None and res[0][1] == want3, res[0]


def test_role_needs_a_cluster(llama_dir):
    out = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(llama_dir), "--role",
         "prefill"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode != 0 and "--role prefill|decode needs --cluster" in out.stderr
