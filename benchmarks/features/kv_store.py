"""KV store tiers: TTFT restored from Redis vs recomputed; store throughput vs raw redis-py;
a multi-turn chat workload with tiers on and off.

Every sub-benchmark starts its own ``redis-server`` (loopback, no persistence,
``maxmemory 4gb`` + ``allkeys-lru``) and stops it at the end.

``ttft``: a random-weight SmolLM2-135M-shaped model (the offline benchmark's, with an
8192-token context; bfloat16, 30 layers, 3 KV heads: 23 KiB of KV per token). For each
prompt length, engine A (store: Redis) computes the prompt — its time to first token is
the recompute TTFT — and writes the blocks; engine B, a fresh engine with an empty host
tier, gets the same prompt: its TTFT includes looking the prefix up in Redis, fetching,
checking and copying it in, and computing the last partial block.

``throughput``: 1,024 serialized blocks of that model (16 tokens × 23 KiB = 360 KiB + a
header each) put and got in batches of 64 through ``RedisStore`` (got *and* decoded:
header and checksum checked) vs the same bytes through a bare redis-py pipeline (SET /
MGET); ``redis-benchmark`` (SET/GET of the same value size, pipelined) for reference.

``chat``: 16 conversations × 10 turns on the bundled default model, each turn = the
history + 64 new tokens, 32 output tokens; the device pool holds ~3 conversations, so
histories are evicted between turns. Tiers off: recomputed; on: ``host://`` + Redis.

    python benchmarks/features/kv_store.py ttft --out benchmarks/results/kv_store_ttft.json
    python benchmarks/features/kv_store.py throughput \
        --out benchmarks/results/kv_store_throughput.json
    python benchmarks/features/kv_store.py chat --out benchmarks/results/kv_store_chat.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvserve.testing.bench import bench_redis as redis_server
from kvserve.testing.models import SMOL, build_bench_model


def bench_model(root: Path) -> Path:
    return build_bench_model(root / "smol-8k", "smol", max_position_embeddings=8192)


def _engine(model: str, **kw):
    from kvserve.config import EngineArgs
    from kvserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineArgs(model=model, **kw))


def _ttft(engine, rid: str, prompt: list[int]) -> float:
    from kvserve.sampling import SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids:
                ttft = time.perf_counter() - t0
    return ttft


def run_ttft(a: argparse.Namespace) -> dict:
    import torch
    from tqdm import tqdm

    model = str(bench_model(Path(a.cache)))
    rows = []
    g = torch.Generator().manual_seed(0)
    with redis_server() as port:
        url = f"redis://127.0.0.1:{port}/0?prefix=ttft"
        kw = dict(kv_cache_memory="1GiB", max_model_len=8192, max_num_batched_tokens=2048)
        warm = torch.randint(3, SMOL["vocab_size"], (512,), generator=g).tolist()
        plain = _engine(model, **kw)
        _ttft(plain, "warm", warm)
        for n in tqdm(a.lengths, desc="ttft"):
            prompt = torch.randint(3, SMOL["vocab_size"], (n,), generator=g).tolist()
            writer = _engine(model, kv_store=(url,), **kw)
            _ttft(writer, "warm", warm)  # also stores the reader's warm-up prefix
            recompute = [_ttft(writer, "a", [*prompt[:-1], 3])]  # nothing stored yet
            writer.close()  # flushes the queued writes to Redis
            for i in range(a.repeat - 1):  # more recompute samples, on a store-less engine
                plain.kv.reset_prefix_cache()
                recompute.append(_ttft(plain, f"{n}-{i}", [*prompt[:-1], 4 + i]))
            restored = []
            for _ in range(a.repeat):
                reader = _engine(model, kv_store=(url,), **kw)  # a fresh, empty host tier
                _ttft(reader, "warm", warm)  # warms the Redis read path, like live traffic
                restored.append(_ttft(reader, "b", [*prompt[:-1], 99]))
                loaded = reader.offloader.num_loaded_blocks - len(warm) // 16 + 1
                reader.close()
            rows.append(
                {
                    "prompt_tokens": n,
                    "recompute_ttft_s": round(statistics.median(recompute), 3),
                    "recompute_ttft_runs_s": [round(x, 3) for x in recompute],
                    "redis_ttft_s": round(statistics.median(restored), 3),
                    "redis_ttft_runs_s": [round(x, 3) for x in restored],
                    "speedup": round(statistics.median(recompute) / statistics.median(restored), 1),
                    "restored_blocks": loaded,
                }
            )
            print(rows[-1], flush=True)
    return {"model": "SmolLM2-135M-shaped, random, bf16, 8k context", "rows": rows}


def run_throughput(a: argparse.Namespace) -> dict:
    import redis
    import torch

    from kvserve.store import serde
    from kvserve.store.host import HostStore
    from kvserve.store.offloader import KVOffloader
    from kvserve.store.redis_store import RedisStore
    from kvserve.store.tiered import TieredStore

    model = str(bench_model(Path(a.cache)))
    engine = _engine(model, kv_cache_memory="64MiB", max_model_len=1024)
    # the engine's own block format and tensor layout, so the blocks are real-sized
    off = KVOffloader(
        TieredStore([HostStore(1 << 30)]), engine.runner.kv_caches, engine.kv, "fp", "bfloat16"
    )
    fmt, views = off._format(), off._views
    n, batch = a.num_blocks, 64
    values = []
    for i in range(n):
        payload = serde.pack(fmt, [torch.randn(v[:, 0].shape).to(v.dtype) for v in views])
        values.append((i.to_bytes(16, "big"), serde.encode(fmt, i.to_bytes(16, "big"), payload)))
    total = sum(len(v) for _, v in values)
    out = {"block_bytes": len(values[0][1]), "blocks": n, "batch": batch}
    with redis_server() as port:
        store = RedisStore.from_url(f"redis://127.0.0.1:{port}/0?prefix=tp")
        raw = redis.Redis(port=port)

        def timed(fn) -> float:
            best = []
            for _ in range(a.repeat):
                raw.flushall()
                t0 = time.perf_counter()
                fn()
                best.append(time.perf_counter() - t0)
            return statistics.median(best)

        def store_put():
            for i in range(0, n, batch):
                store.put(values[i : i + batch])

        def raw_put():
            for i in range(0, n, batch):
                p = raw.pipeline(transaction=False)
                for k, v in values[i : i + batch]:
                    p.set(b"raw:" + k.hex().encode(), v)
                p.execute()

        out["store_put_gbs"] = round(total / timed(store_put) / 1e9, 3)
        out["raw_put_gbs"] = round(total / timed(raw_put) / 1e9, 3)
        store_put()
        raw_put()
        keys = [k for k, _ in values]

        def store_get():
            for i in range(0, n, batch):
                got = store.get(keys[i : i + batch])
                for k, v in zip(keys[i : i + batch], got, strict=True):
                    serde.decode(fmt, k, v)

        def raw_get():
            for i in range(0, n, batch):
                raw.mget([b"raw:" + k.hex().encode() for k in keys[i : i + batch]])

        store_get(), raw_get()  # warm both (socket buffers, allocator)
        runs: dict[str, list[float]] = {"store": [], "raw": []}
        for _ in range(a.repeat):  # interleaved, so drift hits both alike
            runs["store"].append(_once(store_get))
            runs["raw"].append(_once(raw_get))
        out["store_get_decode_gbs"] = round(total / statistics.median(runs["store"]) / 1e9, 3)
        out["raw_get_gbs"] = round(total / statistics.median(runs["raw"]) / 1e9, 3)
        out["put_ratio"] = round(out["store_put_gbs"] / out["raw_put_gbs"], 3)
        out["get_ratio"] = round(out["store_get_decode_gbs"] / out["raw_get_gbs"], 3)
        bench = subprocess.run(
            ["redis-benchmark", "-p", str(port), "-t", "set,get", "-d", str(out["block_bytes"]),
             "-P", "16", "-n", "4000", "-q"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        out["redis_benchmark"] = [
            part.strip()
            for part in bench.stdout.replace("\r", "\n").splitlines()
            if "requests per second" in part
        ]
    print(json.dumps(out, indent=1))
    return out


def _once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_chat(a: argparse.Namespace) -> dict:
    import random

    from kvserve.default_model import default_model_path
    from kvserve.sampling import SamplingParams

    model = str(default_model_path())
    out = {}
    with redis_server() as port:
        for label, stores in (
            ("tiers off", ()),
            ("host + redis", ("host://?capacity=256MiB", f"redis://127.0.0.1:{port}/0?prefix=c")),
        ):
            engine = _engine(model, kv_cache_memory="12MiB", max_model_len=2048, kv_store=stores)
            rng = random.Random(0)
            history = [[rng.randrange(3, 8000) for _ in range(64)] for _ in range(a.conversations)]
            computed = [0]
            schedule = engine.scheduler.schedule

            def counting(schedule=schedule, computed=computed):
                s = schedule()
                computed[0] += s.num_tokens
                return s

            engine.scheduler.schedule = counting
            params = SamplingParams(max_tokens=32, ignore_eos=True, detokenize=False)
            t0 = time.perf_counter()
            prompt_tokens = 0
            for turn in range(a.turns):
                for c in range(a.conversations):
                    engine.add_request(f"c{c}t{turn}", history[c], params)
                    prompt_tokens += len(history[c])
                got: dict[str, list[int]] = {}
                while engine.has_unfinished_requests():
                    for o in engine.step():
                        got.setdefault(o.request_id, []).extend(o.new_token_ids)
                        if o.finished:
                            c = int(o.request_id[1:].split("t")[0])
                            history[c] = (
                                history[c]
                                + got.pop(o.request_id)
                                + [rng.randrange(3, 8000) for _ in range(64)]
                            )
            elapsed = time.perf_counter() - t0
            engine.close()
            out[label] = {
                "elapsed_s": round(elapsed, 2),
                "prompt_tokens": prompt_tokens,
                "tokens_computed": computed[0],
                "tok_s": round((prompt_tokens + 32 * a.turns * a.conversations) / elapsed, 1),
            }
            print(label, out[label], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["ttft", "throughput", "chat"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8000])
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "kvserve-bench"))
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch

    result = {"ttft": run_ttft, "throughput": run_throughput, "chat": run_chat}[a.command](a)
    meta = {
        "command": " ".join(sys.argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    Path(a.out).write_text(json.dumps({**meta, **result}, indent=1))


if __name__ == "__main__":
    main()
