"""Prefix-aware vs least-loaded vs round-robin routing on 2 workers (issue 18).

Per policy, a fresh cluster: ``redis-server`` (coordinator and shared KV tier), workers
``a`` and ``b`` (``kvserve serve --cluster``, each pinned to one core with ``taskset``,
bf16, prefix caching, the cluster's Redis as their KV store) and ``kvserve router
--routing POLICY --tokenizer MODEL`` (router and client unpinned). Policies run in the
order given, ``--rounds`` times (interleaved: prefix, least-loaded, round-robin, prefix …).

Workload, the same for every policy: ``--groups`` tenants, each with its own long system
prompt (a document of ``--doc-tokens`` tokens, distinct words per group), and
``--per-group`` chat conversations per group (one turn each, a distinct short question,
no session id), sent in interleaved group order by ``--concurrency`` client tasks,
streamed, greedy, ``max_tokens`` ``--max-tokens`` with ``ignore_eos``. Per request the
client records TTFT (first content chunk) and the usage (``include_usage``): prompt
tokens and cached tokens (device-pool hits plus blocks restored from a tier).

``--kv-store host`` gives each worker only its host tier (no shared tier: a prefix one
worker computed is recomputed on the other).

Reported per policy: ``computed_prompt_tokens`` (Σ prompt − cached: what the workers
prefilled), TTFT p50/p99, output tok/s (Σ completion tokens / wall time of the
workload), requests per worker, blocks restored from a store tier and bytes read from
Redis (the workers' ``/metrics``), and the router's decision counts.

    python benchmarks/features/kv_routing.py --model /tmp/kvserve-bench/smollm2-135m-instruct \\
        --out benchmarks/results/kv_routing.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path

from bench_cluster import add_cluster_args, parse_cluster_args, start_cluster

from kvserve.testing.bench import bench_redis as redis_server
from kvserve.testing.bench import metric, percentiles, processes, scrape

SECRET = "routing-bench-secret"
READ_BYTES = "kvserve_kv_store_read_bytes_total"
POLICIES = ("prefix", "least-loaded", "round-robin")
TOPICS = [
    "harbour tides ships cargo cranes pilots anchors buoys lighthouse fog",
    "orchard apples pears pruning frost bees blossom ladders cider baskets",
    "observatory telescopes comets nebula mirrors domes galaxies parallax",
    "railway signals junctions sleepers timetables freight platforms tunnels",
    "bakery flour yeast ovens crusts rye starter proofing pastries dough",
    "glacier moraines crevasses ice cores meltwater valleys erosion snow",
    "library catalogues archives manuscripts shelves readers bindings",
    "vineyard grapes harvest barrels cellars tannins slopes vintage",
]
QUESTIONS = [
    "Summarize the first part in one sentence.",
    "What is the main problem described?",
    "List three facts from the text.",
    "Who would find this useful?",
    "What happens at the end?",
    "Explain the key term simply.",
    "Give a title for this document.",
    "What is missing from the text?",
    "Write a question a student might ask.",
    "What is the tone of the text?",
    "Name one thing that could go wrong.",
    "Describe the setting briefly.",
]


def document(tok, group: int, n_tokens: int) -> str:
    words = TOPICS[group % len(TOPICS)].split()
    out: list[str] = [f"Handbook {group}:"]
    i = 0
    while len(tok.encode(" ".join(out), add_special_tokens=False)) < n_tokens:
        out += [words[(i * 3 + k) % len(words)] for k in range(7)] + [f"(section {i})."]
        i += 1
    return " ".join(out)


def workload(a: argparse.Namespace, tok) -> list[dict]:
    docs = [document(tok, g, a.doc_tokens) for g in range(a.groups)]
    reqs = []
    for i in range(a.per_group):
        for g in range(a.groups):
            q = QUESTIONS[(i + g) % len(QUESTIONS)] + f" (reader {g}-{i})"
            msgs = [{"role": "system", "content": docs[g]}, {"role": "user", "content": q}]
            reqs.append({"group": g, "messages": msgs})
    return reqs


async def run_workload(base: str, model: str, reqs: list[dict], a: argparse.Namespace):
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600)
    queue: asyncio.Queue = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)
    results: list[dict] = []

    async def one(r: dict) -> dict:
        t0 = time.perf_counter()
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=r["messages"], max_tokens=a.max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        worker = raw.headers.get("x-kvserve-worker")
        ttft, usage = None, None
        async for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None
        return {
            "group": r["group"], "worker": worker, "ttft_s": ttft,
            "e2e_s": time.perf_counter() - t0, "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens,
            "completion_tokens": usage.completion_tokens,
        }  # fmt: skip

    async def task() -> None:
        while not queue.empty():
            results.append(await one(queue.get_nowait()))

    t0 = time.perf_counter()
    await asyncio.gather(*(task() for _ in range(a.concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    return results, wall


def run_policy(a: argparse.Namespace, policy: str, reqs: list[dict]) -> dict:
    extra = ["--max-model-len", str(a.max_model_len), "--kv-cache-memory", a.kv_cache_memory]
    if a.kv_store == "host":  # no shared tier: a prefix is on one worker or recomputed
        extra += ["--kv-store", "host://"]
    with processes() as procs, redis_server() as redis_port:
        c = start_cluster(
            procs,
            a.model,
            f"redis://127.0.0.1:{redis_port}/0",
            SECRET,
            {"a": extra, "b": extra},
            ["--routing", policy, "--tokenizer", a.model],
        )
        base = c.router
        results, wall = asyncio.run(run_workload(base, a.served_model, reqs, a))
        samples = scrape(base)
        worker_samples = [s for url in c.workers.values() for s in scrape(url)]
    computed = sum(r["prompt_tokens"] - r["cached_tokens"] for r in results)
    ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    return {
        "policy": policy,
        "requests": len(results),
        "wall_s": round(wall, 3),
        "prompt_tokens": sum(r["prompt_tokens"] for r in results),
        "computed_prompt_tokens": computed,
        "cached_tokens": sum(r["cached_tokens"] for r in results),
        "output_tok_s": round(sum(r["completion_tokens"] for r in results) / wall, 2),
        "ttft_s": percentiles(ttfts),
        "per_worker": {w: sum(r["worker"] == w for r in results) for w in ("a", "b")},
        "store_loaded_blocks": metric(worker_samples, "kvserve_kv_store_loaded_blocks_total"),
        "redis_read_bytes": metric(
            worker_samples, "kvserve_kv_store_read_bytes_total", tier="redis"
        ),
        "decisions": {
            reason: metric(samples, "kvserve_router_decisions_total", reason=reason)
            for reason in ("affinity", "prefix", "load", "least_loaded", "round_robin")
        },
        "groups_on_both_workers": sum(
            len({r["worker"] for r in results if r["group"] == g}) > 1 for g in range(a.groups)
        ),
        "results": results,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cluster_args(p, max_model_len=4096, kv_cache_memory="512MiB")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--doc-tokens", type=int, default=1536)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument(
        "--kv-store",
        choices=("cluster", "host"),
        default="cluster",
        help="the workers' KV store: the cluster's Redis (shared, the default) or host:// only",
    )
    a = parse_cluster_args(p)
    from kvserve.model.tokenizer import load_tokenizer

    tok = load_tokenizer(a.model)
    reqs = workload(a, tok)
    runs = []
    for rnd in range(a.rounds):
        for policy in a.policies.split(","):
            print(f"round {rnd + 1}: {policy} …", file=sys.stderr, flush=True)
            r = run_policy(a, policy, reqs)
            print(json.dumps({k: v for k, v in r.items() if k != "results"}), flush=True)
            runs.append(r)
    out = {
        "machine": {"platform": platform.platform(), "cpus": len(os.sched_getaffinity(0))},
        "args": {k: v for k, v in vars(a).items()},
        "runs": runs,
    }
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
