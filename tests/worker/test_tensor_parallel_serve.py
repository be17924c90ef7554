"""``kvserve serve --tensor-parallel-size 2``: the official openai client gets the text one
rank gives; a SIGKILLed rank fails the stream in flight, /health answers 503 and the
server exits non-zero, all within bounded times (nothing hangs in a collective)."""

from __future__ import annotations

import os
import signal
import threading
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from router_client import router_client, stream_via, workload_spec

from kvserve import LLM, SamplingParams
from kvserve.testing.cluster import cluster
from kvserve.testing.procs import ServerProcess, tp_ranks, wait_until

FLAGS = ("--dtype", "float32", "--kv-cache-memory", "8MiB", "--max-model-len", "256")


def _alive(pid: int) -> bool:
    """Running (not exited, not a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return -1  # the server is gone


@pytest.mark.parametrize("victim", [0, 1])
def test_serve_tp2_answers_and_fails_fast_on_a_dead_rank(llama_dir, tmp_path, victim):
    messages = [{"role": "user", "content": "tell me about caches"}]
    offline = LLM(str(llama_dir), dtype="float32", kv_cache_memory="8MiB", max_model_len=256)
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    offline.close()
    proc = ServerProcess(llama_dir, *FLAGS, "--tensor-parallel-size", "2", log=tmp_path / "s.log")
    try:
        proc.wait_ready(180)
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0, timeout=60)
        got = client.chat.completions.create(
            model=str(llama_dir), messages=messages, temperature=0, max_tokens=24
        )
        assert got.choices[0].message.content == want[0].outputs[0].text
        ranks = tp_ranks(proc.proc.pid)
        assert len(ranks) == 2, ranks
        # a long stream in flight when the rank dies ends with an error, not a hang
        outcome: dict[str, object] = {}
        first = threading.Event()

        def stream() -> None:
            try:
                s = client.chat.completions.create(
                    model=str(llama_dir), messages=messages, max_tokens=240, stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                for _ in s:
                    first.set()
                outcome["end"] = "finished"
            except Exception as e:  # the server's error event or a closed connection
                outcome["end"] = type(e).__name__
            first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(60)
        os.kill(sorted(ranks)[victim], signal.SIGKILL)
        t.join(60)
        assert not t.is_alive() and outcome["end"] != "finished"
        wait_until(lambda: _health(proc.url) != 200, 30, "unhealthy after a rank died")
        assert proc.proc.wait(60) != 0
        wait_until(lambda: not any(map(_alive, ranks)), 30, "no rank left behind")
    finally:
        proc.stop(timeout=10)


def test_streams_survive_kill_9_of_a_tp_worker(llama_dir, tmp_path):
    """Two TP=2 workers behind the router, sharing Redis (session records and the KV
    store, whose blocks hold both ranks' shards): the streams of a SIGKILLed worker go on
    on the other with the exact text of uninterrupted runs (bf16)."""
    with cluster(llama_dir, tmp_path, worker_args=("--tensor-parallel-size", "2")) as c:
        client = router_client(c.routers[0])
        specs = [workload_spec(i, str(llama_dir)) for i in range(4)]
        want = [stream_via(client, s)[1] for s in specs]
        progress = [[0] for _ in specs]
        results: list = [None] * len(specs)

        def run(i: int) -> None:
            try:
                results[i] = stream_via(client, specs[i], progress[i])
            except Exception as e:  # reported by the assertion below
                results[i] = ("error", repr(e))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(specs))]
        for t in threads:
            t.start()
        wait_until(lambda: all(p[0] >= 16 for p in progress), 60, "every stream under way")
        c.workers["a"].proc.send_signal(signal.SIGKILL)
        for t in threads:
            t.join(120)
        assert any(r[0] == "a" for r in results), results  # some ran on the killed worker
        assert [text for _, text in results] == want
