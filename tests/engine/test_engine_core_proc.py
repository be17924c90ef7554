"""The engine core in its own process: faults between the API server and the core.

Real processes and signals: ``kvserve serve`` spawns the engine core; SIGKILL of either
side must end in a clear state within a bound, never a hang or an orphan.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
from pathlib import Path

from kvserve.engine import tcmalloc
from kvserve.testing.procs import ServerProcess, engine_core_pid, wait_until


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited


def _status(url: str, body: dict | None = None) -> int:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_engine_core_killed_mid_stream(llama_dir, tmp_path):
    """SIGKILL of the engine core: the running stream ends with an error event, new
    requests and /health get 503 while the server is up, and the server exits 1."""
    server = ServerProcess(
        llama_dir, "--kv-cache-memory", "16MiB", "--max-model-len", "2048",
        log=tmp_path / "serve.log",
    )  # fmt: skip
    try:
        server.wait_ready()
        core = engine_core_pid(server.proc.pid)
        body = {"prompt": "hello", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        req = urllib.request.Request(
            server.url + "/v1/completions", data=json.dumps(body).encode(), method="POST"
        )
        req.add_header("Content-Type", "application/json")
        events = []
        with urllib.request.urlopen(req, timeout=60) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:
                    os.kill(core, signal.SIGKILL)
        assert len(events) > 3 and events[-1] != "[DONE]"
        assert "ServiceUnavailableError" in events[-1] and "engine" in events[-1]
        assert server.proc.wait(30) == 1
    finally:
        server.stop(signal.SIGKILL)
    log = (tmp_path / "serve.log").read_text()
    assert "the engine core died" in log


def test_api_server_killed_leaves_no_orphan(llama_dir, tmp_path):
    server = ServerProcess(llama_dir, "--kv-cache-memory", "16MiB", log=tmp_path / "s.log")
    try:
        server.wait_ready()
        core = engine_core_pid(server.proc.pid)
        assert _status(server.url + "/health") == 200
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        wait_until(lambda: not _alive(core), 15, "the engine core exits with its server")
    finally:
        server.stop(signal.SIGKILL)


def test_sigterm_drains_and_the_core_exits_cleanly(llama_dir, tmp_path):
    server = ServerProcess(llama_dir, "--kv-cache-memory", "16MiB", log=tmp_path / "s.log")
    try:
        server.wait_ready()
        core = engine_core_pid(server.proc.pid)
        body = {"prompt": "hi", "max_tokens": 4}
        assert _status(server.url + "/v1/completions", body) == 200
        assert server.stop(signal.SIGTERM, timeout=30) == 0
        wait_until(lambda: not _alive(core), 15, "the engine core exits after a drain")
    finally:
        server.stop(signal.SIGKILL)
    log = (tmp_path / "s.log").read_text()
    assert "engine stopped" in log and "the engine core exited" not in log  # not an error


def test_the_engine_core_runs_on_tcmalloc_and_the_api_server_on_glibc(
    llama_dir, tmp_path, monkeypatch
):
    """kvserve/engine/tcmalloc.py: a CPU engine core is spawned with tcmalloc preloaded
    (.ci/run installs libtcmalloc-minimal4); KVSERVE_TCMALLOC=0 keeps it out; a path that
    is not a file is refused at start."""
    assert tcmalloc.find_tcmalloc(), "no tcmalloc installed (apt-get install libtcmalloc-minimal4)"
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    for setting, expect in (("1", True), ("0", False)):
        monkeypatch.setenv("KVSERVE_TCMALLOC", setting)
        log = tmp_path / f"serve{setting}.log"
        server = ServerProcess(llama_dir, "--kv-cache-memory", "16MiB", log=log)
        try:
            server.wait_ready()
            core = engine_core_pid(server.proc.pid)
            assert tcmalloc.loaded(core) is expect
            assert not tcmalloc.loaded(server.proc.pid)
            assert _status(server.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2}) == 200
        finally:
            server.stop(signal.SIGKILL)
        assert ("tcmalloc preloaded" in log.read_text()) is expect
    monkeypatch.setenv("KVSERVE_TCMALLOC", str(tmp_path / "nowhere.so"))
    server = ServerProcess(llama_dir, "--kv-cache-memory", "16MiB", log=tmp_path / "bad.log")
    try:
        assert server.proc.wait(60) == 1
    finally:
        server.stop(signal.SIGKILL)
    assert "KVSERVE_TCMALLOC=" in (tmp_path / "bad.log").read_text()
