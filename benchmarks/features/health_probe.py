"""/health latency while 32 streams run and a 6 MB prompt is being tokenized.

The server (``kvserve serve``, tcmalloc preloaded) serves 64 requests at concurrency 32
(``kvserve bench serve``: 256 prompt → 128 output tokens); meanwhile a client sends
``"x = 1\\n" * 1_000_000`` (6 MB) as a completion prompt (refused as too long once it is
tokenized) and another probes ``GET /health`` every 20 ms. Reported: probe latency p50 /
p99 / max over the whole run and over the window in which the big prompt was in flight,
and the big prompt's answer.

    python benchmarks/features/health_probe.py --out benchmarks/results/health_probe.json
    python benchmarks/features/health_probe.py --real \
        --out benchmarks/results/health_probe_real.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvserve.engine.tcmalloc import find_tcmalloc
from kvserve.testing.bench import kvserve_cmd, wait_ready, with_tokenizer
from kvserve.testing.models import build_bench_model as build_model

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent  # benchmarks/

URL = "http://127.0.0.1:8101"


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def probe(stop: threading.Event, samples: list[tuple[float, float]]) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        try:
            with urllib.request.urlopen(URL + "/health", timeout=30) as r:
                r.read()
        except OSError:
            pass
        samples.append((t, time.perf_counter() - t))
        stop.wait(0.02)


def big_prompt(window: list[float], answer: dict) -> None:
    body = json.dumps({"model": "smol", "prompt": "x = 1\n" * 1_000_000, "max_tokens": 4})
    req = urllib.request.Request(URL + "/v1/completions", data=body.encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    window.append(time.perf_counter())
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            answer["status"] = r.status
    except urllib.error.HTTPError as e:
        answer["status"], answer["error"] = e.code, json.loads(e.read())["error"]["message"]
    window.append(time.perf_counter())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct's tokenizer")
    ap.add_argument("--out", default=str(BENCH / "results" / "health_probe.json"))
    args = ap.parse_args()
    if args.real:
        from kvserve.testing.models import build_real_model

        model, vocab = build_real_model(Path("/tmp/kvserve-bench/smollm2-135m-instruct")), 49152
    else:
        model, vocab = with_tokenizer(build_model(Path("/tmp/kvserve-bench/smol-bf16"))), 8192
    env = dict(os.environ)
    if lib := find_tcmalloc():
        env["LD_PRELOAD"] = lib
    out = Path(args.out)
    log = out.with_suffix(".log").open("w")
    server = subprocess.Popen(kvserve_cmd(model), env=env, stdout=log, stderr=subprocess.STDOUT)
    samples: list[tuple[float, float]] = []
    window: list[float] = []
    answer: dict = {}
    stop = threading.Event()
    try:
        wait_ready(URL, server, 300)
        prober = threading.Thread(target=probe, args=(stop, samples))
        prober.start()
        load = subprocess.Popen(
            [sys.executable, "-m", "kvserve.cli", "bench", "serve", "--url", URL,
             "--model", "smol", "--concurrency", "32", "--num-prompts", "64",
             "--input-len", "256", "--output-len", "128", "--vocab", str(vocab),
             "--out", str(out.with_suffix(".load.json"))],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(5)  # the streams are running
        big_prompt(window, answer)
        load.wait(900)
        stop.set()
        prober.join(60)
    finally:
        stop.set()
        server.terminate()
        server.wait(60)
        log.close()
    lat = [d * 1000 for _, d in samples]
    during = [d * 1000 for t, d in samples if window and window[0] <= t <= window[1]]
    result = {
        "model": str(model),
        "probes": len(lat),
        "health_ms": {"p50": percentile(lat, 0.5), "p99": percentile(lat, 0.99), "max": max(lat)},
        "during_big_prompt": {
            "seconds": window[1] - window[0] if len(window) == 2 else None,
            "probes": len(during),
            "p99_ms": percentile(during, 0.99),
            "max_ms": max(during, default=float("nan")),
        },
        "big_prompt_answer": answer,
        "load": json.loads(out.with_suffix(".load.json").read_text())["summary"],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "load"}, indent=2))
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
