"""What the benchmarks share beyond processes and models: a server's command line and
readiness, its engine-time counters, random token prompts, and a scratch Redis.

Every wait is bounded: ``wait_ready`` raises when the server exits or stays unready past
its timeout; ``stop_server`` kills what does not stop within a minute.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from kvserve.testing.redis_procs import redis_server

# the engine-time counters /metrics has (kvserve only)
ENGINE_COUNTERS = (
    "kvserve_engine_loop_busy_seconds_total",
    "kvserve_engine_step_seconds_total",
    "kvserve_engine_forward_seconds_total",
)


def with_tokenizer(model: Path) -> Path:
    """``model`` with the bundled model's tokenizer files copied in where it has none (a
    random-weight checkpoint has none); returns ``model``."""
    from kvserve.default_model import default_model_path

    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (model / name).exists():
            shutil.copy(default_model_path() / name, model / name)
    return model


def kvserve_cmd(model: Path, port: int = 8101) -> list[str]:
    """``kvserve serve`` as the serving benchmarks run it (bf16, 2 GiB of KV, 2048
    tokens, served as ``smol``)."""
    return [
        sys.executable, "-m", "kvserve.cli", "serve", "--model", str(model),
        "--port", str(port), "--served-model-name", "smol", "--kv-cache-memory", "2GiB",
        "--max-model-len", "2048", "--dtype", "bfloat16",
    ]  # fmt: skip


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Until ``url``'s ``/health`` answers 200; raises RuntimeError when ``proc`` exits
    first, TimeoutError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout}s")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 60 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def engine_seconds(url: str) -> dict[str, float] | None:
    """kvserve's engine-time counters from /metrics (None for a server without them)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    got: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ENGINE_COUNTERS:
            got[name] = got.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return got or None


def vocab_of(model_dir: Path) -> int:
    """The vocabulary size in a checkpoint's config.json."""
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` random token ids below ``vocab`` (seeded)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(n, length)).tolist()


@contextlib.contextmanager
def bench_redis() -> Iterator[int]:
    """A scratch ``redis-server`` (no persistence, 4 GB, LRU eviction) on a free port;
    yields the port, removes everything after."""
    args = ("--maxmemory", "4gb", "--maxmemory-policy", "allkeys-lru")
    with (
        tempfile.TemporaryDirectory(prefix="kvserve-bench-redis-") as d,
        redis_server(Path(d), *args) as server,
    ):
        yield server.port
