"""Start and stop a real ``kvserve serve`` process for tests (bounded waits only)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

POLL_INTERVAL_S = 0.05


def wait_until(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` until it is true; raise TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout}s")
        time.sleep(POLL_INTERVAL_S)


def kill_process(proc: subprocess.Popen | None) -> None:
    """SIGKILL ``proc`` if it still runs, and reap it."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)


def stop_process(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
    """SIGTERM ``proc`` if it still runs; SIGKILL it after ``timeout`` seconds."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_process(proc)


def engine_core_pid(pid: int) -> int:
    """The engine-core child that ``kvserve serve`` (process ``pid``) spawned (not
    multiprocessing's resource tracker)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"spawn_main" in cmd:
                return int(child)
    raise AssertionError(f"no engine-core child of {pid}")


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def tp_ranks(server_pid: int) -> list[int]:
    """The tensor-parallel rank processes under ``kvserve serve`` (process ``server_pid``)."""

    def is_rank(pid: int) -> bool:
        try:
            return b"kvserve.worker.worker_proc" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False

    return [p for p in descendants(server_pid) if is_rank(p)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``kvserve serve --model MODEL *args`` on a free loopback port (or, with
    ``command="router"``, ``kvserve router *args``; then ``model`` is unused)."""

    def __init__(
        self, model: Path | None, *args: str, log: Path, command: str = "serve", port: int = 0
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        model_args = ["--model", str(model)] if command == "serve" else []
        cmd = [
            sys.executable,
            "-m",
            "kvserve.cli",
            command,
            *model_args,
            "--port",
            str(self.port),
            *args,
        ]
        self._log = log.open("a")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited early:\n{self.log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(self.url + "/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = 120.0) -> None:
        wait_until(self._ready, timeout, f"server ready (log: {self.log})")

    def metric(self, name: str, having: str = "") -> float:
        """Sum of a metric's samples on /metrics (only lines containing ``having``)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and (line[len(name)] in " {") and having in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


@contextlib.contextmanager
def running_server(model: Path, *args: str, log: Path) -> Iterator[ServerProcess]:
    """A ready server; on exit SIGTERM it and require a clean (status 0) drain."""
    proc = ServerProcess(model, *args, log=log)
    try:
        proc.wait_ready()
        yield proc
    finally:
        assert proc.stop() == 0, log.read_text()[-2000:]
