"""Disaggregated vs colocated prefill/decode on 2 workers, one core each (issue 18).

Per mode, a fresh cluster: ``redis-server``, workers ``a`` and ``b`` (``kvserve serve
--cluster``, bf16, each pinned to one core with ``taskset``) and ``kvserve router
--tokenizer MODEL`` (prefix routing; router and client unpinned):

- ``colocated``: both workers ``--role both``;
- ``disaggregated``: ``a`` is ``--role prefill``, ``b`` ``--role decode``.

Workload, the same in both modes: ``--chats`` short chat streams (a one-line question,
``--chat-tokens`` output tokens, greedy, ``ignore_eos``), started together, and while they
run ``--long`` long prompts (``--long-tokens-min`` to ``--long-tokens-max`` tokens of
distinct text each, ``--long-output`` output tokens), one every ``--long-every`` seconds,
all streamed through the router. Per chat stream the client records the gaps between
content chunks (ITL); per long prompt its TTFT and end-to-end time.

Reported per mode: chat ITL p50/p99/max, chat TTFT p50, long-prompt TTFT p50/max, the
wall time, and the router's hand-offs. Modes run in the order given, ``--rounds`` times.

    python benchmarks/features/disaggregated.py --model /tmp/kvserve-bench/smollm2-135m-instruct \\
        --out benchmarks/results/disaggregated.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path

from bench_cluster import add_cluster_args, parse_cluster_args, start_cluster

from kvserve.testing.bench import bench_redis as redis_server
from kvserve.testing.bench import metric, percentiles, processes, scrape

SECRET = "disagg-bench-secret"
MODES = ("colocated", "disaggregated")
ROLES = {"colocated": ("both", "both"), "disaggregated": ("prefill", "decode")}


def long_prompt(tok, i: int, n_tokens: int) -> str:
    words, k = [f"Report {i}:"], 0
    while len(tok.encode(" ".join(words), add_special_tokens=False)) < n_tokens:
        words += [f"item{i}x{k}", "was", "checked", "by", f"team{(k * 13 + i) % 41}."]
        k += 1
    return " ".join(words) + " Summarize the report."


async def run_workload(base: str, model: str, a: argparse.Namespace, longs: list[str]):
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=900)

    async def stream(messages, max_tokens: int) -> dict:
        t0 = time.perf_counter()
        s = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0.0,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        stamps = []
        async for chunk in s:
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append(time.perf_counter())
        return {
            "ttft_s": stamps[0] - t0 if stamps else None,
            "itl_s": [y - x for x, y in itertools.pairwise(stamps)],
            "e2e_s": time.perf_counter() - t0,
        }

    async def chat(i: int) -> dict:
        q = [{"role": "user", "content": f"Tell me a story about lighthouse keeper {i}."}]
        return await stream(q, a.chat_tokens)

    async def long(i: int) -> dict:
        await asyncio.sleep(a.long_start + i * a.long_every)
        return await stream([{"role": "user", "content": longs[i]}], a.long_output)

    t0 = time.perf_counter()
    chats = [asyncio.create_task(chat(i)) for i in range(a.chats)]
    long_tasks = [asyncio.create_task(long(i)) for i in range(len(longs))]
    chat_res = await asyncio.gather(*chats)
    long_res = await asyncio.gather(*long_tasks)
    wall = time.perf_counter() - t0
    await client.close()
    return chat_res, long_res, wall


def run_mode(a: argparse.Namespace, mode: str, longs: list[str]) -> dict:
    extra = ["--max-model-len", str(a.max_model_len), "--kv-cache-memory", a.kv_cache_memory]
    roles = dict(zip(("a", "b"), ROLES[mode], strict=True))
    with processes() as procs, redis_server() as redis_port:
        c = start_cluster(
            procs,
            a.model,
            f"redis://127.0.0.1:{redis_port}/0",
            SECRET,
            {node: [*extra, "--role", role] for node, role in roles.items()},
            ["--tokenizer", a.model],
        )
        base = c.router
        chat_res, long_res, wall = asyncio.run(run_workload(base, a.served_model, a, longs))
        samples = scrape(base)
    itl = [x for r in chat_res for x in r["itl_s"]]
    return {
        "mode": mode,
        "wall_s": round(wall, 2),
        "chat_itl_s": percentiles(itl),
        "chat_ttft_s": percentiles([r["ttft_s"] for r in chat_res if r["ttft_s"] is not None]),
        "long_ttft_s": percentiles([r["ttft_s"] for r in long_res if r["ttft_s"] is not None]),
        "long_e2e_s": percentiles([r["e2e_s"] for r in long_res]),
        "handoffs": metric(samples, "kvserve_router_handoffs_total"),
        "failovers": metric(samples, "kvserve_router_failovers_total"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cluster_args(p, max_model_len=4608, kv_cache_memory="1GiB")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--chats", type=int, default=8)
    p.add_argument("--chat-tokens", type=int, default=192)
    p.add_argument("--long", type=int, default=6)
    p.add_argument("--long-tokens-min", type=int, default=2048)
    p.add_argument("--long-tokens-max", type=int, default=4096)
    p.add_argument("--long-output", type=int, default=16)
    p.add_argument("--long-start", type=float, default=2.0)
    p.add_argument("--long-every", type=float, default=2.0)
    a = parse_cluster_args(p)
    from kvserve.model.tokenizer import load_tokenizer

    tok = load_tokenizer(a.model)
    span = a.long_tokens_max - a.long_tokens_min
    longs = [
        long_prompt(tok, i, a.long_tokens_min + (span * i) // max(a.long - 1, 1))
        for i in range(a.long)
    ]
    runs = []
    for rnd in range(a.rounds):
        for mode in a.modes.split(","):
            print(f"round {rnd + 1}: {mode} …", file=sys.stderr, flush=True)
            r = run_mode(a, mode, longs)
            print(json.dumps(r), flush=True)
            runs.append(r)
    out = {
        "machine": {"platform": platform.platform(), "cpus": len(os.sched_getaffinity(0))},
        "args": vars(a),
        "runs": runs,
    }
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
