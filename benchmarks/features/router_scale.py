"""The router alone at scale (issue 18): one ``kvserve router`` process against 64
lightweight stand-in workers on loopback. The router is what is measured.

Stand-ins (one process, asyncio, raw HTTP/1.1): each registers in Redis like a worker
(heartbeat every second with ``running``/``waiting`` 0, the cluster secret's fingerprint,
KV root keys, block size and the router tokenizer's fingerprint), answers ``/ready`` and
``/health``, serves ``GET /internal/kv/snapshot`` (the chained hashes of the documents
it "holds": stand-in ``i`` holds documents ``i % D`` and ``(i + 1) % D``) and publishes a
keepalive on its ZeroMQ PUB socket, and answers ``POST /v1/completions`` with a canned
SSE stream (``--tokens`` chunks with token ids, a finish chunk, a usage chunk, ``[DONE]``)
without computing anything.

The router runs with ``--routing prefix --tokenizer`` (the bundled model's tokenizer),
pinned to one core (``taskset``), the stand-ins and the client on the other. The client
sends ``--requests`` streamed completions, ``--concurrency`` at a time, each prompt a
document (``--doc-tokens`` tokens of text, one of D = 16) plus a distinct question, no
session id (every request is placed).

Reported: requests/s (client side, whole streams), the router's own
``kvserve_router_decision_seconds`` (arrival → worker chosen: parsing, tokenization,
owner look-up, scoring) p50/p99 from its histogram, the share of requests that went to a
stand-in holding their document, and Redis commands per request (``INFO commandstats``
deltas over the run, less the stand-ins' heartbeat SETs).

    python benchmarks/features/router_scale.py --out benchmarks/results/router_scale.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from kvserve.testing.bench import bench_redis as redis_server
from kvserve.testing.bench import http_get, poll_until, processes, scrape
from kvserve.testing.procs import free_port

SECRET = "router-scale-secret"
DECISION = "kvserve_router_decision_seconds"
N_DOCS = 16


def documents(tok, n_tokens: int) -> list[str]:
    docs = []
    for d in range(N_DOCS):
        words, i = [f"Manual {d}."], 0
        while len(tok.encode(" ".join(words))) < n_tokens:
            words += [f"part{d}x{i}", "describes", "the", f"unit{(i * 7 + d) % 97}", "and"]
            i += 1
        docs.append(" ".join(words))
    return docs


# ---- stand-in workers (run with --standins) ---------------------------------------------
async def standins(a: argparse.Namespace) -> None:
    import msgspec
    import redis
    import zmq
    import zmq.asyncio

    from kvserve.ha.coordination import Coordinator, secret_fingerprint
    from kvserve.kv.events import DEVICE, HOST
    from kvserve.kv.hashing import hash_blocks, root_hash
    from kvserve.model.tokenizer import load_tokenizer
    from kvserve.server.kv_events import TOPIC, KVEventBatch, KVSnapshot

    tok = load_tokenizer(a.tokenizer)
    docs = [tok.encode(d) for d in documents(tok, a.doc_tokens)]
    keys = ["standin-model", "kv=bfloat16", "block_size=16"]
    root = root_hash(*keys)
    chains = [hash_blocks(root, ids, 16) for ids in docs]
    coord = Coordinator(redis.Redis(port=a.redis_port), lease_s=5.0)
    ctx = zmq.asyncio.Context.instance()
    enc = msgspec.msgpack.Encoder()
    chunk_tpl = (
        'data: {"id":"cmpl-x","object":"text_completion","created":1,"model":"m",'
        '"choices":[{"index":0,"text":"w","token_ids":[%d],"finish_reason":null}],"usage":null}\n\n'
    )
    tail = (
        'data: {"id":"cmpl-x","object":"text_completion","created":1,"model":"m","choices":'
        '[{"index":0,"text":"","finish_reason":"length"}],"usage":null}\n\n'
        'data: {"id":"cmpl-x","object":"text_completion","created":1,"model":"m","choices":[],'
        '"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d,'
        '"prompt_tokens_details":{"cached_tokens":%d}}}\n\ndata: [DONE]\n\n'
    )
    servers = []

    def make(i: int):
        held = chains[i % N_DOCS] + chains[(i + 1) % N_DOCS]
        snap = enc.encode(KVSnapshot(f"s{i:02d}", "inst", 0, {DEVICE: held, HOST: []}))

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    line, *hdrs = head.decode().split("\r\n")
                    method, path, _ = line.split(" ", 2)
                    length = 0
                    for h in hdrs:
                        if h.lower().startswith("content-length:"):
                            length = int(h.split(":", 1)[1])
                    if length:
                        await reader.readexactly(length)
                    if path in ("/ready", "/health"):
                        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    elif path == "/internal/kv/snapshot":
                        writer.write(
                            b"HTTP/1.1 200 OK\r\ncontent-type: application/x-msgpack\r\n"
                            + f"content-length: {len(snap)}\r\n\r\n".encode()
                            + snap
                        )
                    elif method == "POST":
                        body = "".join(chunk_tpl % (5 + k) for k in range(a.tokens))
                        body += tail % (a.doc_tokens, a.tokens, a.doc_tokens + a.tokens, 0)
                        data = body.encode()
                        writer.write(
                            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                            + f"content-length: {len(data)}\r\n\r\n".encode()
                            + data
                        )
                    else:
                        writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        return handle

    pubs = []
    for i in range(a.workers):
        port = free_port()
        pub = ctx.socket(zmq.PUB)
        ep_port = pub.bind_to_random_port("tcp://127.0.0.1")
        pubs.append((f"s{i:02d}", pub))
        servers.append(await asyncio.start_server(make(i), "127.0.0.1", port))
        info = {
            "running": 0, "waiting": 0, "kv_usage": 0.0,
            "secret_fp": secret_fingerprint(SECRET),
            "kv_events": f"tcp://127.0.0.1:{ep_port}", "block_size": 16,
            "cache_keys": keys, "tenant_isolation": False, "tokenizer_fp": tok.fingerprint,
        }  # fmt: skip
        servers[-1].info = (f"s{i:02d}", f"http://127.0.0.1:{port}", info)  # type: ignore[attr-defined]
    print("ready", flush=True)
    while True:
        for s in servers:
            node, url, info = s.info  # type: ignore[attr-defined]
            await asyncio.to_thread(coord.heartbeat, node, url, **info)
        for node, pub in pubs:
            await pub.send_multipart([TOPIC, enc.encode(KVEventBatch(node, "inst", 0, []))])
        await asyncio.sleep(1.0)


# ---- the client --------------------------------------------------------------------------
async def client(a: argparse.Namespace, base: str, prompts: list[tuple[int, str]]):
    import httpx

    sem = asyncio.Semaphore(a.concurrency)
    hits = 0
    limits = httpx.Limits(max_connections=a.concurrency, max_keepalive_connections=a.concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60) as http:

        async def one(doc: int, prompt: str) -> None:
            nonlocal hits
            async with sem:
                body = {"model": "m", "prompt": prompt, "max_tokens": a.tokens, "stream": True}
                async with http.stream("POST", base + "/v1/completions", json=body) as r:
                    assert r.status_code == 200, await r.aread()
                    w = int(r.headers["x-kvserve-worker"][1:])
                    async for _ in r.aiter_bytes():
                        pass
                hits += doc in (w % N_DOCS, (w + 1) % N_DOCS)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(d, p) for d, p in prompts))
        return time.perf_counter() - t0, hits


def histogram_quantile(samples, name: str, q: float) -> float | None:
    buckets = sorted((float(lab["le"]), v) for n, lab, v in samples if n == name + "_bucket")
    total = buckets[-1][1] if buckets else 0
    if not total:
        return None
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= q * total:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (q * total - prev_c) / max(c - prev_c, 1e-9)
        prev_le, prev_c = le, c
    return None


def redis_calls(port: int) -> dict[str, int]:
    import redis

    stats = redis.Redis(port=port).info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--tokens", type=int, default=16, help="SSE chunks per canned stream")
    p.add_argument("--doc-tokens", type=int, default=1024)
    p.add_argument("--routing", default="prefix")
    p.add_argument("--tokenizer", default=str(Path(__file__).resolve().parents[2]
                                               / "kvserve" / "models" / "default"))  # fmt: skip
    p.add_argument("--standins", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--redis-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--py-spy", default=None, metavar="FILE", help="profile the router into FILE")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.standins:
        asyncio.run(standins(a))
        return
    from kvserve.model.tokenizer import load_tokenizer

    tok = load_tokenizer(a.tokenizer)
    docs = documents(tok, a.doc_tokens)
    prompts = [(i % N_DOCS, f"{docs[i % N_DOCS]} Question {i}?") for i in range(a.requests)]
    cpus = sorted(os.sched_getaffinity(0))
    router_cpu, rest = str(cpus[0]), ",".join(map(str, cpus[1:] or cpus))
    with processes() as procs, redis_server() as redis_port:
        url = f"redis://127.0.0.1:{redis_port}/0"
        standin = procs.start("standins", [
            "taskset", "-c", rest, sys.executable, __file__, "--standins",
            "--redis-port", str(redis_port), "--workers", str(a.workers),
            "--tokens", str(a.tokens), "--doc-tokens", str(a.doc_tokens),
            "--tokenizer", a.tokenizer])  # fmt: skip
        rport = free_port()
        procs.start("router", [
            "taskset", "-c", router_cpu, sys.executable, "-m", "kvserve.cli", "router",
            "--port", str(rport), "--cluster", url, "--cluster-secret", SECRET,
            "--routing", a.routing, "--tokenizer", a.tokenizer,
            "--log-level", "warning"])  # fmt: skip
        base = f"http://127.0.0.1:{rport}"

        def ready():
            status, body = http_get(base + "/router/workers")
            if status != 200:
                return False
            ws = json.loads(body)["workers"]
            indexed = a.routing == "prefix"
            ok = [
                w for w in ws
                if w["routable"] and (not indexed or (w["kv_index"] or {}).get("synced"))
            ]  # fmt: skip
            return len(ok) == a.workers

        poll_until("the router indexes every stand-in", ready, 120, procs.procs["router"])
        os.sched_setaffinity(0, {int(c) for c in rest.split(",")})
        asyncio.run(client(a, base, prompts[: min(200, len(prompts))]))  # warm-up
        before = redis_calls(redis_port)
        spy = None
        if a.py_spy:  # taskset exec'd the router: its pid is the router's
            spy = subprocess.Popen(
                ["py-spy", "record", "-p", str(procs.procs["router"].pid), "-d", "10",
                 "--format", "raw", "--nonblocking", "-o", a.py_spy],
                stdout=subprocess.DEVNULL,
            )  # fmt: skip
        wall, hits = asyncio.run(client(a, base, prompts))
        if spy is not None:
            spy.wait(60)
        after = redis_calls(redis_port)
        samples = scrape(base)
        assert standin.poll() is None
    calls = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    # the router never writes: SETs are the stand-ins' heartbeats, INFO this script's
    router_calls = sum(v for k, v in calls.items() if k not in ("set", "info"))
    out = {
        "machine": {"platform": platform.platform(), "cpus": len(cpus)},
        "args": vars(a),
        "requests_per_s": round(a.requests / wall, 1),
        "wall_s": round(wall, 2),
        "decision_p50_ms": round(1000 * histogram_quantile(samples, DECISION, 0.5), 3),
        "decision_p99_ms": round(1000 * histogram_quantile(samples, DECISION, 0.99), 3),
        "placed_on_holder": round(hits / a.requests, 3),
        "redis_calls_per_request": round(router_calls / a.requests, 2),
        "redis_calls": {k: v for k, v in calls.items() if v},
    }  # fmt: skip
    print(json.dumps(out, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
