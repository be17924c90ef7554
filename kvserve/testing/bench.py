"""What the benchmarks share beyond processes and models: a server's command line and
readiness, its engine-time counters, random token prompts, and a scratch Redis.

Every wait is bounded: ``wait_ready`` raises when the server exits or stays unready past
its timeout (a server is stopped with ``procs.stop_process``).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from kvserve.testing.procs import wait_until
from kvserve.testing.redis_procs import redis_server

# the engine-time counters /metrics has (kvserve only)
ENGINE_COUNTERS = (
    "kvserve_engine_loop_busy_seconds_total",
    "kvserve_engine_step_seconds_total",
    "kvserve_engine_forward_seconds_total",
)


def with_tokenizer(model: Path) -> Path:
    """``model`` with the bundled model's tokenizer files copied in where it has none (a
    random-weight checkpoint has none); returns ``model``. A checkpoint whose vocabulary is
    larger than the bundled tokenizer's gets a word-level tokenizer of its own size
    instead (``word_tokenizer``), so that every token it can emit decodes."""
    from kvserve.default_model import default_model_path

    if all((model / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return model
    vocab = json.loads((model / "config.json").read_text()).get("vocab_size", 0)
    bundled = default_model_path()
    if vocab > json.loads((bundled / "config.json").read_text())["vocab_size"]:
        return word_tokenizer(model, vocab)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (model / name).exists():
            shutil.copy(bundled / name, model / name)
    return model


def word_tokenizer(model: Path, vocab: int) -> Path:
    """Write a word-level tokenizer of ``vocab`` words (``w0`` … ``w{vocab - 1}``, split on
    whitespace; ``w0`` unknown, ``w1`` end of sequence) into ``model``; returns ``model``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(model / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "w0",
        "eos_token": "w1",
        "model_max_length": 1 << 20,
    }
    (model / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return model


def kvserve_cmd(model: Path, port: int = 8101) -> list[str]:
    """``kvserve serve`` as the serving benchmarks run it (bf16, 2 GiB of KV, 2048
    tokens, served as ``smol``)."""
    return [
        sys.executable, "-m", "kvserve.cli", "serve", "--model", str(model),
        "--port", str(port), "--served-model-name", "smol", "--kv-cache-memory", "2GiB",
        "--max-model-len", "2048", "--dtype", "bfloat16",
    ]  # fmt: skip


def engine_seconds(url: str) -> dict[str, float] | None:
    """kvserve's engine-time counters from /metrics (None for a server without them, or
    one that does not answer)."""
    try:
        samples = scrape(url)
    except (OSError, RuntimeError):
        return None
    got = {name: metric(samples, name) for name in ENGINE_COUNTERS}
    return got if any(n in ENGINE_COUNTERS for n, _, _ in samples) else None


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


# ---- a run's processes ------------------------------------------------------------------
class Procs:
    """The workers and routers of a run: each one's log in a temp dir; all SIGKILLed and
    the dir removed by ``close`` (after printing the log tails when the run failed)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvserve-ha-bench-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self._n = 0

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        self._n += 1
        log = self.dir / f"{self._n:03d}-{name}.log"
        with log.open("w") as f:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
        self.procs[name], self.logs[name] = proc, log
        return proc

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)

    def log(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")

    def close(self, failed: bool) -> None:
        for name in list(self.procs):
            self.kill(name)
        if failed:
            for name, path in self.logs.items():
                tail = path.read_text(errors="replace").splitlines()[-25:]
                print(f"---- {name} ({path.name}), last lines:", *tail, sep="\n", file=sys.stderr)
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def processes() -> Iterator[Procs]:
    """A ``Procs`` for one run: every process killed when the block ends (logs printed
    first when it raised)."""
    procs = Procs()
    failed = True
    try:
        yield procs
        failed = False
    finally:
        procs.close(failed)


# ---- waiting and reading ----------------------------------------------------------------
def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """A GET's status and body (an HTTP error status too; a refused connection raises
    OSError)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def poll_until(what: str, check, timeout: float, proc: subprocess.Popen | None = None):
    """``procs.wait_until`` for a check with a value: poll ``check()`` (an OSError counts
    as not yet) until it is truthy and return that value; raises RuntimeError when
    ``proc`` exits first, TimeoutError after ``timeout`` s."""
    got = None

    def done() -> bool:
        nonlocal got
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {proc.returncode}")
        try:
            got = check()
        except OSError:
            got = None
        return bool(got)

    wait_until(done, timeout, what)
    return got


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, path: str = "/health") -> None:
    """Until ``url + path`` answers 200 (``poll_until``'s errors: ``proc`` exited, or
    ``timeout`` s passed)."""
    poll_until(f"{url}{path}", lambda: http_get(url + path, 2.0)[0] == 200, timeout, proc)


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of ``url``'s /metrics as (name, labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = http_get(url + "/metrics", timeout=10)
    if status != 200:
        raise RuntimeError(f"{url}/metrics answered {status}")
    return [
        (s.name, s.labels, s.value)
        for fam in text_string_to_metric_families(body.decode())
        for s in fam.samples
    ]


def metric(samples, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(
        v
        for n, lab, v in samples
        if n == name and all(lab.get(k) == want for k, want in labels.items())
    )


def percentiles(xs: list[float]) -> dict[str, float | None]:
    """p50, p90, p99, max and mean of ``xs`` (all None when empty)."""
    import numpy as np

    if not xs:
        return {"p50": None, "p90": None, "p99": None, "max": None, "mean": None}
    q = np.percentile(xs, [50, 90, 99])
    return {
        "p50": round(float(q[0]), 4),
        "p90": round(float(q[1]), 4),
        "p99": round(float(q[2]), 4),
        "max": round(max(xs), 4),
        "mean": round(statistics.fmean(xs), 4),
    }
