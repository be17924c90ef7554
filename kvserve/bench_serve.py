"""``kvserve bench serve``: an async load generator for any OpenAI-compatible server.

Like vLLM's serving benchmark: ``--num-prompts`` streaming completion requests, at most
``--concurrency`` in flight (and optionally paced at ``--request-rate`` per second), each
timed from send to first token (TTFT), between tokens (ITL) and to the end (E2E).
Synthetic prompts are random token-id lists (``prompt`` as a list of ints, accepted by
kvserve and vLLM) with ``ignore_eos`` so every request produces exactly ``--output-len``
tokens; ``--dataset FILE`` reads JSON lines ``{"prompt": str, "max_tokens": int}``.

Two clients (``--client``): ``http`` (default) streams over httpx and decodes each SSE
chunk with msgspec, like vLLM's benchmark client; ``openai`` uses the official client.

Output: a summary table, ``--out`` JSON (summary + per-request records) and ``--plot`` PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec


@dataclass
class Record:
    prompt_len: int
    max_tokens: int
    ok: bool = False
    error: str | None = None
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    start: float = 0.0


def synthetic(n: int, input_len: int, output_len: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt": [rng.randrange(10, vocab) for _ in range(input_len)], "max_tokens": output_len}
        for _ in range(n)
    ]


def load_dataset(path: str, n: int) -> list[dict]:
    items = []
    with open(path) as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                items.append({"prompt": d["prompt"], "max_tokens": int(d.get("max_tokens", 128))})
    if not items:
        raise ValueError(f"{path}: no requests")
    return [items[i % len(items)] for i in range(n)]


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))  # nearest rank
    return s[k]


def summarize(records: list[Record], elapsed: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [x for r in ok for x in r.itl]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    s: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": round(elapsed, 3),
        "request_throughput": len(ok) / elapsed,
        "output_throughput": out_tokens / elapsed,
        "total_token_throughput": (in_tokens + out_tokens) / elapsed,
        "total_output_tokens": out_tokens,
    }
    for name, vals in (("ttft", ttft), ("itl", itl), ("e2e", e2e)):
        s[f"mean_{name}_ms"] = statistics.mean(vals) * 1000 if vals else None
        for q in (50, 90, 99):
            v = _pct(vals, q)
            s[f"p{q}_{name}_ms"] = None if v is None else v * 1000
    return s


async def _timed(rec: Record, chunks: AsyncIterator[tuple[float, int | None, bool]]) -> None:
    """Record a stream's timings in ``rec``; ``chunks`` yields, per chunk, its arrival time,
    the completion tokens its usage reports (or None) and whether it carries text."""
    last = None
    texts = 0
    async for now, tokens, text in chunks:
        if tokens is not None:
            rec.output_tokens = tokens
        if not text:
            continue
        texts += 1
        if rec.ttft is None:
            rec.ttft = now - rec.start
        elif last is not None:
            rec.itl.append(now - last)
        last = now
    rec.e2e = time.perf_counter() - rec.start
    rec.output_tokens = rec.output_tokens or texts
    rec.ok = True


async def _one(client: Any, model: str, item: dict, rec: Record, extra: dict) -> None:
    rec.start = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model,
            prompt=item["prompt"],
            max_tokens=item["max_tokens"],
            stream=True,
            temperature=0.0,
            stream_options={"include_usage": True},
            extra_body=extra,
        )

        async def chunks() -> AsyncIterator[tuple[float, int | None, bool]]:
            async for chunk in stream:
                now = time.perf_counter()
                tokens = chunk.usage.completion_tokens if chunk.usage is not None else None
                yield now, tokens, any(c.text for c in chunk.choices)

        await _timed(rec, chunks())
    except Exception as e:  # counted as a failure, the run goes on
        rec.error = repr(e)[:300]


class _Text(msgspec.Struct):
    text: str = ""


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    """The fields of a streamed completion chunk that the benchmark reads."""

    choices: list[_Text] = []
    usage: _Usage | None = None


_read_chunk = msgspec.json.Decoder(_Chunk).decode


async def _one_http(
    client: httpx.AsyncClient, model: str, item: dict, rec: Record, extra: dict
) -> None:
    """``_one`` over plain HTTP: the SSE lines are read and decoded with msgspec, so the
    client spends a fraction of the official client's CPU per chunk (on a machine whose
    cores the server shares, the client's CPU is the server's loss)."""
    rec.start = time.perf_counter()
    body = {
        "model": model,
        "prompt": item["prompt"],
        "max_tokens": item["max_tokens"],
        "stream": True,
        "temperature": 0.0,
        "stream_options": {"include_usage": True},
        **extra,
    }
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")

            async def chunks() -> AsyncIterator[tuple[float, int | None, bool]]:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    chunk = _read_chunk(line[6:])
                    tokens = chunk.usage.completion_tokens if chunk.usage is not None else None
                    yield now, tokens, any(c.text for c in chunk.choices)

            await _timed(rec, chunks())
    except Exception as e:  # counted as a failure, the run goes on
        rec.error = repr(e)[:300]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    if args.client == "openai":
        import openai

        client: Any = openai.AsyncOpenAI(
            base_url=args.url.rstrip("/") + "/v1",
            api_key=args.api_key or "none",
            max_retries=0,
            timeout=600,
        )
        send = _one
        model = args.model or (await client.models.list()).data[0].id
    else:
        client = httpx.AsyncClient(
            base_url=args.url.rstrip("/"),
            headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {},
            timeout=600,
            limits=httpx.Limits(max_connections=args.concurrency + 1),
        )
        send = _one_http
        if args.model:
            model = args.model
        else:
            listed = await client.get("/v1/models")
            listed.raise_for_status()
            model = listed.json()["data"][0]["id"]
    if args.dataset == "synthetic":
        items = synthetic(args.num_prompts, args.input_len, args.output_len, args.vocab, args.seed)
    else:
        items = load_dataset(args.dataset, args.num_prompts)
    extra = {"ignore_eos": True} if args.ignore_eos else {}
    records = [
        Record(len(it["prompt"]) if isinstance(it["prompt"], list) else 0, it["max_tokens"])
        for it in items
    ]
    sem = asyncio.Semaphore(args.concurrency)
    bar = tqdm(total=len(items), desc=f"bench c={args.concurrency}", unit="req")

    async def guarded(item: dict, rec: Record) -> None:
        async with sem:
            await send(client, model, item, rec, extra)
        bar.update(1)

    start, cpu_start = time.perf_counter(), time.process_time()
    tasks = []
    for item, rec in zip(items, records, strict=True):
        tasks.append(asyncio.create_task(guarded(item, rec)))
        if args.request_rate != float("inf"):
            await asyncio.sleep(random.expovariate(args.request_rate))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    bar.close()
    await (client.close() if args.client == "openai" else client.aclose())
    summary = summarize(records, elapsed)
    summary |= {
        "url": args.url,
        "model": model,
        "concurrency": args.concurrency,
        "num_prompts": args.num_prompts,
        "dataset": args.dataset,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "client": args.client,
        "client_cpu_s": round(cpu, 3),  # this process's CPU while the requests ran
    }
    return {"summary": summary, "requests": [asdict(r) for r in records]}


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reqs = [r for r in result["requests"] if r["ok"] and r["ttft"] is not None]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].hist([r["ttft"] * 1000 for r in reqs], bins=30)
    axes[0].set_xlabel("TTFT (ms)")
    axes[1].hist([x * 1000 for r in reqs for x in r["itl"]], bins=50)
    axes[1].set_xlabel("inter-token latency (ms)")
    axes[2].scatter(
        [r["start"] - min(q["start"] for q in reqs) for r in reqs], [r["e2e"] for r in reqs], s=8
    )
    axes[2].set_xlabel("request start (s)")
    axes[2].set_ylabel("end-to-end latency (s)")
    s = result["summary"]
    fig.suptitle(
        f"{s['model']} @ concurrency {s['concurrency']}: {s['output_throughput']:.1f} output tok/s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=None, help="Bearer key for the server")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    p.add_argument("--num-prompts", type=int, default=64, help="requests to send")
    p.add_argument("--dataset", default="synthetic", help="synthetic or a JSONL file")
    p.add_argument("--input-len", type=int, default=256, help="synthetic prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
    p.add_argument("--vocab", type=int, default=8192, help="synthetic token ids < vocab")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second"
    )
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let requests stop at end-of-sequence (default: exactly --output-len tokens)",
    )
    p.add_argument(
        "--client",
        choices=["http", "openai"],
        default="http",
        help="http: plain streaming HTTP with msgspec decoding (light, like vLLM's "
        "benchmark client); openai: the official openai client (several times the CPU per "
        "chunk, which a server sharing the client's cores loses)",
    )
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--plot", default=None, help="write a PNG here (needs matplotlib)")


def main(args: argparse.Namespace) -> int:
    if args.concurrency < 1 or args.num_prompts < 1:
        raise ValueError("--concurrency and --num-prompts must be positive")
    result = asyncio.run(run(args))
    s = result["summary"]
    for key in (
        "completed",
        "failed",
        "duration_s",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "mean_ttft_ms",
        "p50_ttft_ms",
        "p99_ttft_ms",
        "mean_itl_ms",
        "p50_itl_ms",
        "p99_itl_ms",
        "p50_e2e_ms",
    ):
        v = s[key]
        print(f"{key:>24}: {v:.2f}" if isinstance(v, float) else f"{key:>24}: {v}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot(result, args.plot)
    return 0 if s["failed"] == 0 else 1
