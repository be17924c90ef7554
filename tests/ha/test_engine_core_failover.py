"""The engine-core process of a worker dies (SIGKILL) mid-stream behind ``kvserve router``:
its API server ends the stream with an error within a bounded time, the router continues
it on the standby with the exact text of an uninterrupted run — a chat completion and a
Responses stream alike — and the worker whose core died reports unhealthy and exits
(for its supervisor to restart it)."""

from __future__ import annotations

import os
import signal
import time

from router_client import prompt_text, router_client, session_spec, stream_via

from kvserve.testing.cluster import cluster
from kvserve.testing.procs import engine_core_pid, wait_until

HANDOVER_S = 5.0


def test_a_dead_engine_core_hands_its_streams_to_the_standby(llama_dir, tmp_path):
    with cluster(llama_dir, tmp_path) as c:
        router = c.routers[0]
        client = router_client(router)
        model = str(llama_dir)
        spec = session_spec(1, model, "core-death", 200)
        want = stream_via(client, spec)[1]  # uninterrupted

        raw = client.completions.with_raw_response.create(stream=True, **spec)
        primary = raw.headers["x-kvserve-worker"]
        worker = c.workers[primary]
        core = engine_core_pid(worker.proc.pid)
        text, killed_at, gap = "", None, 0.0
        for chunk in raw.parse():
            piece = chunk.choices[0].text if chunk.choices else ""
            if killed_at is not None and piece and not gap:
                gap = time.monotonic() - killed_at  # the first text after the kill
            text += piece
            if killed_at is None and len(text) >= 20:
                os.kill(core, signal.SIGKILL)
                killed_at = time.monotonic()
        assert killed_at is not None and text == want  # nothing lost, nothing repeated
        assert 0 < gap < HANDOVER_S, f"the stream went on {gap:.1f} s after the kill"
        assert router.metric("kvserve_router_failovers_total") >= 1
        assert worker.proc.wait(30) == 1  # unhealthy, then gone: its supervisor restarts it

        # a Responses stream on the other worker's core, which dies too: no worker is
        # left to continue it, so it ends with an error event — never a hang
        other = next(n for n in c.workers if n != primary)
        # warm: a first Responses request through the router and worker costs ~0.5 s of
        # one-time setup, in which the tiny model (~2500 tokens/s) can finish all 200
        # tokens before the client sees the first, and the kill would come too late
        client.responses.create(model=model, input=prompt_text(2), max_output_tokens=4)
        stream = client.responses.create(
            model=model, input=prompt_text(3), max_output_tokens=200, stream=True
        )
        kinds = []
        for ev in stream:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta" and kinds.count(ev.type) == 1:
                os.kill(engine_core_pid(c.workers[other].proc.pid), signal.SIGKILL)
        assert kinds[-1] == "error" and "response.completed" not in kinds
        wait_until(lambda: c.workers[other].proc.poll() is not None, 30, "the worker exited")
