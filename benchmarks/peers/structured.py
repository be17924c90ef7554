"""Structured-output cost: JSON-schema requests vs the same requests unconstrained, through
each engine's OpenAI server on SmolLM2-135M-Instruct (``benchmarks/peers/real_model.py``), at
c=1 and c=32 — kvserve beside vLLM-CPU (whose structured outputs also use xgrammar).

Each round starts one engine's server alone (kvserve, then vLLM, alternating which goes
first), warms it up, and runs both kinds back to back at each concurrency (alternating
which kind goes first). Reported: generated tokens per second (completion tokens / wall
time) per engine and kind, and each engine's json_schema/unconstrained ratio. vLLM runs at
its best as benchmarks/peers/serving.py starts it: tcmalloc preloaded, OpenMP threads bound to
every allowed CPU. Both engines generate compact JSON (vLLM with ``disable_any_whitespace``,
kvserve's default), so the outputs have the same shape. The two kinds generate the same
token counts: a warm-up run of the constrained requests records each one's length (they
are seeded), and its unconstrained twin ignores EOS and runs to exactly that length — so
the ratio is the cost per token, not a difference in how much a prompt's prefill is
amortized over.

    python benchmarks/peers/structured.py --rounds 2 --out benchmarks/results/structured.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai

from kvserve.engine.tcmalloc import find_tcmalloc
from kvserve.testing.models import build_real_model

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 6,
            "maxItems": 6,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 10},
                    "qty": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["name", "qty"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
LEVELS = ((1, 6), (32, 64))  # (concurrency, requests)
KINDS = ("unconstrained", "json_schema")


async def load(
    url: str, n: int, conc: int, kind: str, max_tokens: int, lengths: dict[int, int]
) -> float:
    """Generated tokens per second of ``n`` chat requests, ``conc`` at a time. Constrained
    requests record their lengths in ``lengths``; unconstrained ones run to them."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=900)
    sem = asyncio.Semaphore(conc)
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        kw: dict = {"extra_body": {"ignore_eos": True}}
        limit = lengths.get(i, max_tokens) if kind == "unconstrained" else max_tokens
        if kind == "json_schema":
            kw = {"response_format": {"type": "json_schema",
                                      "json_schema": {"name": "list", "schema": SCHEMA}}}
        async with sem:
            r = await client.chat.completions.create(
                model="smol", messages=[{"role": "user", "content": f"A shopping list, {i}."}],
                max_tokens=limit, temperature=0.7, seed=i, **kw,
            )  # fmt: skip
        tokens += r.usage.completion_tokens
        if kind == "json_schema":
            lengths[i] = r.usage.completion_tokens
        if kind == "json_schema" and r.choices[0].finish_reason == "stop":
            json.loads(r.choices[0].message.content)

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    await client.close()
    return tokens / (time.perf_counter() - start)


def serve(cmd: list[str], env: dict[str, str], url: str, log: Path) -> subprocess.Popen:
    out = log.open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while True:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2):
                return proc
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise SystemExit(f"{cmd[2]} did not start; see {log}") from None
            time.sleep(1)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def commands(model: Path, vllm_python: str) -> dict[str, tuple[list[str], dict[str, str], str]]:
    env = dict(os.environ)
    lib = find_tcmalloc()
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    vllm_env = env | ({"LD_PRELOAD": lib} if lib else {}) | {
        "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": cpus}  # fmt: skip
    common = ["--model", str(model), "--served-model-name", "smol", "--dtype", "bfloat16",
              "--max-model-len", "2048"]  # fmt: skip
    return {
        "kvserve": ([sys.executable, "-m", "kvserve.cli", "serve", *common, "--port", "8111",
                     "--kv-cache-memory", "2GiB"], env, "http://127.0.0.1:8111"),
        "vllm": ([vllm_python, "-m", "vllm.entrypoints.openai.api_server", *common,
                  "--port", "8112", "--max-num-seqs", "64", "--structured-outputs-config",
                  json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})],
                 vllm_env, "http://127.0.0.1:8112"),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--model-dir", default="/tmp/kvserve-bench/smollm2-135m-instruct")
    ap.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/structured.json")
    a = ap.parse_args()
    model = build_real_model(Path(a.model_dir))
    engines = commands(model, a.vllm_python)
    if a.skip_vllm or not Path(a.vllm_python).exists():
        del engines["vllm"]
    runs: dict[str, dict[str, dict[str, list[float]]]] = {
        e: {f"c={c}": {k: [] for k in KINDS} for c, _ in LEVELS} for e in engines
    }
    for r in range(a.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            cmd, env, url = engines[name]
            proc = serve(cmd, env, url, Path(f"/tmp/structured-{name}-r{r}.log"))
            try:
                lengths: dict[int, int] = {}  # warm-up, and each request's length
                asyncio.run(load(url, 64, 32, "json_schema", a.max_tokens, lengths))
                asyncio.run(load(url, 4, 4, "unconstrained", a.max_tokens, lengths))
                for conc, n in LEVELS:
                    kinds = KINDS if (r + conc) % 2 == 0 else tuple(reversed(KINDS))
                    for kind in kinds:
                        tps = asyncio.run(load(url, n, conc, kind, a.max_tokens, lengths))
                        runs[name][f"c={conc}"][kind].append(tps)
                        print(f"round {r} {name} c={conc} {kind}: {tps:.1f} tok/s", flush=True)
            finally:
                stop(proc)
    summary = {}
    for name, levels in runs.items():
        for level, kinds in levels.items():
            u, s = (statistics.median(kinds[k]) for k in KINDS)
            summary[f"{name} {level}"] = {"unconstrained": round(u, 1),
                                          "json_schema": round(s, 1),
                                          "ratio": round(s / u, 3)}  # fmt: skip
    print(json.dumps(summary, indent=1))
    Path(a.out).write_text(json.dumps({"summary": summary, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
