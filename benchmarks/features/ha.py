"""High availability: streams failed over when their worker is killed, the cost of
replication on one worker's throughput, and the bytes delta sync writes per token.

Every sub-benchmark starts its own ``redis-server`` (loopback, no persistence) and its
workers (``kvserve serve``, the bundled default model, 64 MiB of KV, 512-token context)
as subprocesses, and kills them all (SIGKILL) at the end.

``failover``: Redis + workers ``a`` and ``b`` (``--cluster`` and ``--kv-store`` on the
same Redis, ``--replicate-every 16``) + ``kvserve router``. Per trial: a prompt (20-45
tokens, varied by trial), 200 output tokens, temperature 0.8, ``seed`` = trial,
``ignore_eos``, ``return_token_ids``. First the reference: the same request streamed
uninterrupted through the router twice (sessions ``bench-T-cold`` with seed T + 100000,
then ``bench-T-ref``, the reference: its prompt comes from the prefix caches, as the
trial's will — a cached prompt's tail is computed by a different kernel than a cold
prefill, which can flip a sampled token long before any failover; the first run uses
another seed, so its output blocks — same tokens computed another way, same block
hashes — do not end up in the caches a standby restores from). Then the trial stream
(session ``bench-T``, chosen so the router's rendezvous hash puts it on ``a`` and ``b``
alternately): after 40 token ids reached the client, the worker named in
``X-Kvserve-Worker`` is SIGKILLed (``t_kill`` just before ``os.kill``) and the stream is
read to its end. ``failover_s``: from ``t_kill`` to the first token produced by the
standby, i.e. the chunk after the longest silence following the kill (chunks the dead
worker had already sent may still arrive first, within a millisecond or so;
``first_chunk_after_kill_s`` is the naive first-chunk time, ``buffered_tokens`` counts
them). The received token ids are compared with the reference: ``lost`` / ``duplicated``
= reference tokens missing / extra tokens (a diff alignment, when the lengths differ),
``substituted`` = positions that differ (a diverged sampled continuation), ``first_diff``
and ``identical`` = the whole stream equals the reference. A trial whose router did not fail
over (``kvserve_router_failovers_total`` did not move: the stream had ended on the worker
before the kill) is invalid and retried with a new session. After each trial the killed
worker is restarted with the same node id and port and the router must report it
routable again (bounded wait).

``overhead``: output tokens/s of one worker, no router, 16 concurrent streams × 256
tokens (``ignore_eos``, greedy, distinct prompts, one session each) in three
configurations — ``off`` (no ``--cluster``, no ``--kv-store``), ``store`` (``--kv-store``
Redis only), ``on`` (``--cluster`` + ``--kv-store`` Redis + ``--replicate-every 16``).
One worker per configuration, all started up front; each serves one full workload first
(reported apart: it also pays one-time costs), then the measured repetitions run
round-robin (off, store, on, off, …) so that the machine's speed drift hits all alike;
every workload's prompts carry a unique tag (no prefix-cache or store hits). Tokens/s =
generated tokens / wall time of the 16 streams, as the client sees them (client in the
same process, asyncio).

``bytes``: the ``on`` configuration, 8 streams × 256 tokens (greedy, distinct prompts,
one session each); after the streams ended and the write queues drained, the worker's
``/metrics`` deltas give the bytes written to Redis: KV blocks (``tier="redis"``) and
session records. Per generated token, compared with shipping the sequence's whole KV at
every sync point (every 16 output tokens and at the end: (prompt + output so far) ×
bytes/token, computed from the same prompts) plus the same records.

    python benchmarks/features/ha.py failover --out benchmarks/results/ha_failover.json
    python benchmarks/features/ha.py overhead --out benchmarks/results/ha_overhead.json
    python benchmarks/features/ha.py bytes --out benchmarks/results/ha_bytes.json
    python benchmarks/features/ha.py plot benchmarks/results/ha_failover.json \
        benchmarks/results/ha_failover.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import importlib.metadata
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvserve.testing.bench import bench_redis as redis_server  # (4 GB, LRU)
from kvserve.testing.bench import (
    http_get,
    metric,
    percentiles,
    poll_until,
    processes,
    scrape,
    wait_ready,
)
from kvserve.testing.procs import free_port

SECRET = "ha-bench-secret"
CONFIGS = ("off", "store", "on")
PROMPTS = (
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old "
    "clockmaker who",
    "The history of the printing press begins in fifteenth-century Germany, where a goldsmith",
    "Write a short letter to a friend describing your first week at a new job in a busy "
    "city hospital.",
    "Explain to a ten-year-old why the sky looks blue during the day and red at sunset.",
    "My grandmother kept a garden full of tomatoes, beans and sunflowers, and every summer we",
    "List five things a traveller should pack before hiking across the mountains in early spring.",
    "In the year 2150, the first city on Mars had grown to ten thousand people, and its mayor",
    "Describe the smell of rain on hot pavement after a long, dry week in the middle of July.",
    "Dear diary, today the teacher told us that we would be going on a trip to the museum and",
    "A detective walked into the empty train station at midnight, looking for the stolen "
    "painting that",
    "Summarize the rules of chess for someone who has never seen a chessboard before.",
    "The little robot rolled across the kitchen floor, searching for the cat that had taken its",
    "Give three reasons why reading books before bed can help people sleep better at night.",
    "Beneath the frozen lake, scientists discovered a cave filled with strange glowing "
    "crystals that",
    "How do bees find their way back to the hive after flying far away to collect nectar?",
    "Yesterday the baker on the corner made a cake so large that the whole street came to",
    "Imagine a world where every person could fly; describe how schools and roads would change.",
    "Sailors on the old ship sang songs every evening, and the youngest of them, a boy named",
    "Tell me about the most important inventions of the nineteenth century and why they mattered.",
    "Quietly, the fox crept toward the henhouse, but the farmer's dog was already awake and",
)


# ---- processes -------------------------------------------------------------------------


def worker_argv(a: argparse.Namespace, port: int, config: str, redis_port: int, node: str):
    """``kvserve serve`` on the default model in one of CONFIGS."""
    url = f"redis://127.0.0.1:{redis_port}/0"
    argv = [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port),
            "--kv-cache-memory", a.kv_cache_memory,
            "--max-model-len", str(a.max_model_len)]  # fmt: skip
    if config in ("store", "on"):
        argv += ["--kv-store", url]
    if config == "on":
        argv += ["--cluster", url, "--cluster-secret", SECRET,
                 "--replicate-every", str(a.replicate_every), "--node-id", node]  # fmt: skip
        argv += a.worker_arg  # e.g. --replicate-to standby --prewarm-device-fraction 0
    return argv


def router_argv(port: int, redis_port: int) -> list[str]:
    url = f"redis://127.0.0.1:{redis_port}/0"
    return [sys.executable, "-m", "kvserve.cli", "router", "--port", str(port),
            "--cluster", url, "--cluster-secret", SECRET]  # fmt: skip


def bytes_per_token(log: str) -> int:
    m = re.search(r"KV cache: (\d+) bytes/token", log)
    if m is None:
        raise RuntimeError("no 'KV cache: N bytes/token' line in the worker's log")
    return int(m.group(1))


def _chunk_ids(chunk: Any) -> list[int]:
    if not chunk.choices:
        return []
    return list(getattr(chunk.choices[0], "token_ids", None) or [])


def prompt_for(i: int) -> str:
    p = PROMPTS[i % len(PROMPTS)]
    return p if i < len(PROMPTS) else f"Variation {i // len(PROMPTS)}. {p}"


# ---- failover --------------------------------------------------------------------------
def compare(ref: list[int], got: list[int]) -> dict[str, Any]:
    """``got`` against ``ref``. Both have ``max_tokens`` tokens unless tokens were lost or
    repeated at the failover, which a diff alignment shows (``lost``: reference tokens
    missing, ``duplicated``: extra ones). ``substituted``: positions that differ once the
    sampled continuation diverged (an alignment of two diverged samples means nothing, so
    when the lengths match nothing is counted lost or duplicated)."""
    lost = duplicated = 0
    if len(ref) != len(got):
        matcher = difflib.SequenceMatcher(None, ref, got, autojunk=False)
        for op, i1, i2, j1, j2 in matcher.get_opcodes():
            if op in ("delete", "replace"):
                lost += i2 - i1
            if op in ("insert", "replace"):
                duplicated += j2 - j1
    substituted = sum(x != y for x, y in zip(ref, got, strict=False))
    first = next((i for i, (x, y) in enumerate(zip(ref, got, strict=False)) if x != y), None)
    if first is None and len(ref) != len(got):
        first = min(len(ref), len(got))
    return {
        "lost": lost,
        "duplicated": duplicated,
        "substituted": substituted,
        "identical": ref == got,
        "first_diff": first,
    }


def session_for(base: str, target: str, nodes: list[str]) -> str:
    """``base`` or ``base.k``: a session id the router's tie-break puts on ``target`` (at
    equal load the routable worker with the highest rendezvous score takes a new session)."""
    from kvserve.router.workers import rendezvous

    for k in range(200):
        s = base if k == 0 else f"{base}.{k}"
        if max(nodes, key=lambda n: rendezvous(s, n)) == target:
            return s
    return base


def run_failover(a: argparse.Namespace) -> dict:
    import openai
    from tqdm import tqdm

    nodes = ["a", "b"]
    rows: list[dict] = []
    invalid: list[dict] = []
    with redis_server() as rport, processes() as procs:
        wport = {n: free_port() for n in nodes}
        wurl = {n: f"http://127.0.0.1:{wport[n]}" for n in nodes}
        rurl = f"http://127.0.0.1:{free_port()}"

        def start_worker(n: str) -> float:
            t0 = time.monotonic()
            p = procs.start(n, worker_argv(a, wport[n], "on", rport, n))
            wait_ready(wurl[n], p, a.start_timeout, "/ready")
            return time.monotonic() - t0

        def routable() -> set[str]:
            status, body = http_get(rurl + "/router/workers")
            if status != 200:
                return set()
            return {w["id"] for w in json.loads(body)["workers"] if w["routable"]}

        for n in nodes:
            start_worker(n)
        router = procs.start("router", router_argv(int(rurl.rsplit(":", 1)[1]), rport))
        wait_ready(rurl, router, a.start_timeout, "/ready")
        poll_until("both workers routable", lambda: routable() >= set(nodes), 60, router)
        bpt = bytes_per_token(procs.log("a"))
        client = openai.OpenAI(
            base_url=rurl + "/v1", api_key="x", max_retries=0, timeout=a.request_timeout
        )
        model = client.models.list().data[0].id

        def stream(prompt: str, seed: int, session: str, kill_after: int | None) -> dict:
            raw = client.completions.with_raw_response.create(
                model=model,
                prompt=prompt,
                max_tokens=a.max_tokens,
                temperature=0.8,
                seed=seed,
                stream=True,
                extra_body={"ignore_eos": True, "session_id": session, "return_token_ids": True},
            )
            served = raw.headers.get("x-kvserve-worker")
            ids: list[int] = []
            arrivals: list[tuple[float, int]] = []  # (monotonic time, tokens in the chunk)
            t_kill = None
            prompt_ids = None
            error = None
            try:
                for chunk in raw.parse():
                    now = time.monotonic()
                    if prompt_ids is None:
                        prompt_ids = getattr(chunk, "prompt_token_ids", None)
                    new = _chunk_ids(chunk)
                    if not new:
                        continue
                    ids += new
                    arrivals.append((now, len(new)))
                    if kill_after is not None and t_kill is None and len(ids) >= kill_after:
                        proc = procs.procs[served]
                        t_kill = time.monotonic()
                        os.kill(proc.pid, signal.SIGKILL)
            except openai.APIError as e:  # an error event: the router could not resume
                error = repr(e)
            return {
                "served": served,
                "ids": ids,
                "arrivals": arrivals,
                "t_kill": t_kill,
                "prompt_tokens": len(prompt_ids) if prompt_ids else None,
                "error": error,
            }

        def router_counters() -> tuple[float, float, float, float]:
            s = scrape(rurl)
            return (
                metric(s, "kvserve_router_failovers_total"),
                metric(s, "kvserve_router_failover_failures_total"),
                metric(s, "kvserve_router_failover_seconds_sum"),
                metric(s, "kvserve_router_failover_seconds_count"),
            )

        bar = tqdm(total=a.trials, desc="failover trials", unit="trial")
        for trial in range(a.trials):
            prompt = prompt_for(trial)
            target = nodes[trial % 2]
            for attempt in range(a.max_attempts):
                base = f"bench-{trial}" if attempt == 0 else f"bench-{trial}-r{attempt}"
                session = session_for(base, target, nodes)
                # a first run (another seed) puts the prompt in every cache (device
                # pools, Redis), so the reference computes it as the trial will (a prefix
                # hit computes the prompt's tail differently from a cold prefill, which
                # may flip a sampled token long before any failover). Another seed: the
                # same tokens computed another way would be cached under the same block
                # hashes, and a standby could restore those bytes instead of the primary's
                cold = stream(prompt, trial + 100_000, f"{base}-cold", None)
                ref = stream(prompt, trial, f"{base}-ref", None)
                if ref["error"] or len(ref["ids"]) != a.max_tokens:
                    raise RuntimeError(f"trial {trial}: the reference stream failed: {ref}")
                before = router_counters()
                got = stream(prompt, trial, session, a.kill_after)
                victim = got["served"]
                if got["t_kill"] is None:
                    raise RuntimeError(f"trial {trial}: the stream ended before the kill: {got}")
                with contextlib.suppress(subprocess.TimeoutExpired):
                    procs.procs[victim].wait(10)
                after = router_counters()
                failovers = after[0] - before[0]
                t_kill = got["t_kill"]
                post = [(t, k) for t, k in got["arrivals"] if t >= t_kill]
                prev, gap_i, gap = t_kill, None, -1.0
                for i, (t, _) in enumerate(post):
                    if t - prev > gap:
                        gap_i, gap = i, t - prev
                    prev = t
                row = {
                    "trial": trial,
                    "attempt": attempt,
                    "session": session,
                    "prompt_tokens": got["prompt_tokens"],
                    "target": target,
                    "killed": victim,
                    "killed_after_tokens": sum(k for t, k in got["arrivals"] if t < t_kill),
                    "failover_s": round(post[gap_i][0] - t_kill, 4) if post else None,
                    "first_chunk_after_kill_s": round(post[0][0] - t_kill, 4) if post else None,
                    "buffered_tokens": sum(k for _, k in post[:gap_i]) if post else 0,
                    "received_tokens": len(got["ids"]),
                    **compare(ref["ids"], got["ids"]),
                    "cold_first_token_equal": cold["ids"][:1] == ref["ids"][:1],
                    "router_failovers": failovers,
                    "router_failover_failures": after[1] - before[1],
                    "router_failover_s": (
                        round((after[2] - before[2]) / (after[3] - before[3]), 4)
                        if after[3] > before[3]
                        else None
                    ),
                    "error": got["error"],
                }
                t0 = time.monotonic()
                procs.kill(victim)
                start_worker(victim)
                poll_until(
                    f"router sees {victim} again",
                    lambda: routable() >= set(nodes),
                    a.restart_timeout,
                    router,
                )
                row["restart_s"] = round(time.monotonic() - t0, 2)
                if failovers < 1:  # the stream had finished on the worker before the kill
                    invalid.append(row)
                    bar.write(f"trial {trial}: no failover happened (attempt {attempt}); retrying")
                    continue
                rows.append(row)
                bar.set_postfix(
                    failover_s=row["failover_s"], lost=row["lost"], dup=row["duplicated"]
                )
                break
            else:
                bar.write(f"trial {trial}: no valid attempt in {a.max_attempts}")
            bar.update()
        bar.close()

    fo = [r["failover_s"] for r in rows if r["failover_s"] is not None]
    out = {
        "workload": {
            "model": "bundled default",
            "max_tokens": a.max_tokens,
            "temperature": 0.8,
            "kill_after_tokens": a.kill_after,
            "replicate_every": a.replicate_every,
            "kv_cache_memory": a.kv_cache_memory,
            "max_model_len": a.max_model_len,
            "kv_bytes_per_token": bpt,
        },
        "trials": a.trials,
        "valid_trials": len(rows),
        "invalid_attempts": len(invalid),
        "failover_s": percentiles(fo),
        "first_chunk_after_kill_s": percentiles(
            [
                r["first_chunk_after_kill_s"]
                for r in rows
                if r["first_chunk_after_kill_s"] is not None
            ]
        ),
        "router_failover_s": percentiles(
            [r["router_failover_s"] for r in rows if r["router_failover_s"] is not None]
        ),
        "lost_tokens": sum(r["lost"] for r in rows),
        "duplicated_tokens": sum(r["duplicated"] for r in rows),
        "substituted_tokens": sum(r["substituted"] for r in rows),
        "identical_streams": sum(r["identical"] for r in rows),
        "diverged_before_kill": sum(
            r["first_diff"] is not None and r["first_diff"] < r["killed_after_tokens"] for r in rows
        ),
        "stream_errors": sum(r["error"] is not None for r in rows),
        "router_failover_failures": int(sum(r["router_failover_failures"] for r in rows)),
        "killed": {n: sum(r["killed"] == n for r in rows) for n in nodes},
        "rows": rows,
        "invalid_rows": invalid,
    }
    if invalid and len(invalid) > 0.2 * max(1, len(rows)):
        print(
            f"note: {len(invalid)} attempts ended before the kill; consider --max-tokens 400",
            file=sys.stderr,
        )
    return out


def summary_failover(out: dict) -> list[str]:
    f = out["failover_s"]
    return [
        f"valid trials {out['valid_trials']}/{out['trials']} "
        f"(invalid attempts {out['invalid_attempts']}); killed {out['killed']}",
        f"failover_s p50 {f['p50']} p90 {f['p90']} p99 {f['p99']} max {f['max']}",
        f"router's own failover_s p50 {out['router_failover_s']['p50']}",
        f"lost {out['lost_tokens']}, duplicated {out['duplicated_tokens']}, substituted "
        f"{out['substituted_tokens']}; identical streams "
        f"{out['identical_streams']}/{out['valid_trials']} (diverged before the kill: "
        f"{out['diverged_before_kill']}); stream errors {out['stream_errors']}, router "
        f"failover failures {out['router_failover_failures']}",
    ]


# ---- workload (overhead, bytes) --------------------------------------------------------
async def _workload(url: str, n: int, max_tokens: int, tag: str, unique: bool = False) -> dict:
    """``n`` concurrent greedy streams of ``max_tokens`` (ignore_eos), distinct prompts, one
    session each; returns wall time, token counts and prompt lengths."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id

    async def one(i: int) -> tuple[int, int | None]:
        resp = await client.completions.create(
            model=model,
            prompt=f"[{tag}] {prompt_for(i)}" if unique else prompt_for(i),
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={
                "ignore_eos": True,
                "session_id": f"{tag}-{i}",
                "return_token_ids": True,
            },
        )
        count, prompt_tokens = 0, None
        async for chunk in resp:
            if prompt_tokens is None and getattr(chunk, "prompt_token_ids", None):
                prompt_tokens = len(chunk.prompt_token_ids)
            count += len(_chunk_ids(chunk))
        return count, prompt_tokens

    try:
        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(i) for i in range(n)))
        elapsed = time.perf_counter() - t0
    finally:
        await client.close()
    tokens = [c for c, _ in got]
    return {
        "elapsed_s": elapsed,
        "tokens": sum(tokens),
        "complete_streams": sum(c == max_tokens for c in tokens),
        "prompt_tokens": [p for _, p in got],
    }


def workload(url: str, n: int, max_tokens: int, tag: str, unique: bool = False) -> dict:
    return asyncio.run(_workload(url, n, max_tokens, tag, unique))


def run_overhead(a: argparse.Namespace) -> dict:
    """One worker per configuration, all started up front (an idle worker takes no CPU).
    Each first serves one full workload (reported as ``first``: it also pays one-time
    costs — first writes into an empty Redis, allocator growth), then the measured
    repetitions run round-robin over the configurations (off, store, on, off, …), so a
    drift of the machine's speed hits all three alike. Every workload's prompts carry a
    unique tag: nothing is served from a prefix cache or the store."""
    from tqdm import tqdm

    runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    first: dict[str, float] = {}
    with redis_server() as rport, processes() as procs:
        urls = {}
        for config in CONFIGS:
            port = free_port()
            urls[config] = f"http://127.0.0.1:{port}"
            p = procs.start(config, worker_argv(a, port, config, rport, f"ovh-{config}"))
            wait_ready(urls[config], p, a.start_timeout, "/ready")
        for config in CONFIGS:
            res = workload(urls[config], a.streams, a.max_tokens, f"first-{config}", True)
            first[config] = round(res["tokens"] / res["elapsed_s"], 1)
        with tqdm(total=a.reps * len(CONFIGS), desc="overhead runs", unit="run") as bar:
            for rep in range(a.reps):
                for config in CONFIGS:
                    url = urls[config]
                    res = workload(url, a.streams, a.max_tokens, f"ovh-{config}-{rep}", True)
                    if res["complete_streams"] != a.streams:
                        raise RuntimeError(f"{config}: incomplete streams: {res}")
                    run = {
                        "rep": rep,
                        "tok_s": round(res["tokens"] / res["elapsed_s"], 1),
                        "elapsed_s": round(res["elapsed_s"], 3),
                        "tokens": res["tokens"],
                    }
                    runs[config].append(run)
                    bar.set_postfix(config=config, tok_s=run["tok_s"])
                    bar.update()
        totals = {c: scrape(urls[c]) for c in CONFIGS}
    mean = {c: round(statistics.fmean(x["tok_s"] for x in runs[c]), 1) for c in CONFIGS}
    pair = {
        c: round(
            statistics.median(
                x["tok_s"] / o["tok_s"] for x, o in zip(runs[c], runs["off"], strict=True)
            ),
            3,
        )
        for c in ("store", "on")
    }
    return {
        "workload": {
            "model": "bundled default",
            "streams": a.streams,
            "max_tokens": a.max_tokens,
            "temperature": 0,
            "replicate_every": a.replicate_every,
            "kv_cache_memory": a.kv_cache_memory,
            "max_model_len": a.max_model_len,
            "reps": a.reps,
            "order": "one warm worker per configuration, round-robin: "
            + ", ".join(CONFIGS)
            + ", ...",
        },
        "first_workload_tok_s": first,
        "tok_s_mean": mean,
        "on_off_ratio": round(mean["on"] / mean["off"], 3),
        "store_off_ratio": round(mean["store"] / mean["off"], 3),
        "median_rep_ratio": pair,
        "redis_kv_bytes": {
            c: metric(totals[c], "kvserve_kv_store_written_bytes_total", tier="redis")
            for c in CONFIGS
        },
        "replication_records": metric(totals["on"], "kvserve_replication_records_total"),
        "runs": runs,
    }


def summary_overhead(out: dict) -> list[str]:
    m, runs = out["tok_s_mean"], out["runs"]
    lines = [f"{c:5s} mean {m[c]:7.1f} tok/s  runs {[x['tok_s'] for x in runs[c]]}" for c in m]
    return [
        *lines,
        f"on/off {out['on_off_ratio']} (target >= 0.95), store/off {out['store_off_ratio']}; "
        f"median per-round ratio on/off {out['median_rep_ratio']['on']}, store/off "
        f"{out['median_rep_ratio']['store']}",
        f"first workload after start: {out['first_workload_tok_s']}",
    ]


def run_bytes(a: argparse.Namespace) -> dict:
    with redis_server() as rport, processes() as procs:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        p = procs.start("worker", worker_argv(a, port, "on", rport, "bytes"))
        wait_ready(url, p, a.start_timeout, "/ready")
        bpt = bytes_per_token(procs.log("worker"))
        names = (
            "kvserve_generation_tokens_total",
            "kvserve_replication_records_total",
            "kvserve_replication_record_bytes_total",
        )

        def counters() -> dict[str, float]:
            s = scrape(url)
            got = {n: metric(s, n) for n in names}
            got["redis_kv_bytes"] = metric(s, "kvserve_kv_store_written_bytes_total", tier="redis")
            got["queue_depth"] = metric(s, "kvserve_kv_store_queue_depth")
            return got

        before = counters()
        print(f"{a.streams} streams × {a.max_tokens} tokens on one worker ...", flush=True)
        res = workload(url, a.streams, a.max_tokens, "bytes")
        if res["complete_streams"] != a.streams:
            raise RuntimeError(f"incomplete streams: {res}")
        # drain: the store's write queue empty and the counters still for 1 s
        last, still_since, deadline = counters(), time.monotonic(), time.monotonic() + a.drain_s
        drained = False
        while time.monotonic() < deadline:
            time.sleep(0.25)
            now = counters()
            if now != last:
                last, still_since = now, time.monotonic()
            elif now["queue_depth"] == 0 and time.monotonic() - still_since >= 1.0:
                drained = True
                break
        if not drained:
            print(f"warning: the write queues did not settle within {a.drain_s} s", file=sys.stderr)
    d = {k: last[k] - before[k] for k in (*names, "redis_kv_bytes")}
    generated = int(d["kvserve_generation_tokens_total"])
    prompts = res["prompt_tokens"]
    every, m, block = a.replicate_every, a.max_tokens, 16
    points = list(range(every, m + 1, every)) + ([m] if m % every else [])
    whole_kv = sum((pl + n) * bpt for pl in prompts for n in points)
    records = d["kvserve_replication_record_bytes_total"]
    delta_total = d["redis_kv_bytes"] + records
    whole_total = whole_kv + records
    full_blocks = sum((pl + m - 1) // block for pl in prompts)  # the last token has no KV yet
    return {
        "workload": {
            "model": "bundled default",
            "streams": a.streams,
            "max_tokens": m,
            "temperature": 0,
            "replicate_every": every,
            "prompt_tokens": prompts,
            "kv_bytes_per_token": bpt,
        },
        "generated_tokens": generated,
        "delta": {
            "kv_block_bytes": int(d["redis_kv_bytes"]),
            "record_bytes": int(records),
            "records": int(d["kvserve_replication_records_total"]),
            "total_bytes": int(delta_total),
            "bytes_per_generated_token": round(delta_total / generated, 1),
            "kv_full_blocks_expected": full_blocks,
            "kv_bytes_expected_without_headers": full_blocks * block * bpt,
        },
        "whole_kv_each_sync": {
            "sync_points_per_stream": len(points),
            "kv_bytes": whole_kv,
            "record_bytes": int(records),
            "total_bytes": int(whole_total),
            "bytes_per_generated_token": round(whole_total / generated, 1),
        },
        "whole_over_delta": round(whole_total / delta_total, 2),
        "drained": drained,
    }


def summary_bytes(out: dict) -> list[str]:
    dl, wh = out["delta"], out["whole_kv_each_sync"]
    return [
        f"generated {out['generated_tokens']} tokens; KV {out['workload']['kv_bytes_per_token']} "
        f"B/token",
        f"delta sync: {dl['kv_block_bytes']} B of KV blocks + {dl['record_bytes']} B of "
        f"{dl['records']} records = {dl['bytes_per_generated_token']} B/generated token",
        f"whole KV at each sync: {wh['kv_bytes']} B + records = "
        f"{wh['bytes_per_generated_token']} B/generated token",
        f"whole/delta = {out['whole_over_delta']}x",
    ]


# ---- main ------------------------------------------------------------------------------
def machine() -> dict:
    def version(pkg: str) -> str | None:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    redis_v = subprocess.run(
        ["redis-server", "--version"], capture_output=True, text=True, timeout=10
    ).stdout.strip()
    commit = subprocess.run(
        ["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout.strip()
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "openai": version("openai"),
        "redis_server": redis_v,
        "git_commit": commit or None,
    }


def plot_failover(result: Path, out: Path) -> None:
    """Per-trial failover times (kill → first token from the standby) and their CDF."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.loads(result.read_text())["rows"]
    times = sorted(r["failover_s"] * 1000 for r in rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.bar(range(len(rows)), [r["failover_s"] * 1000 for r in rows], color="tab:blue")
    ax1.set_xlabel("trial")
    ax1.set_ylabel("kill → next token (ms)")
    ax1.set_title("failover time per trial (SIGKILL of the serving worker)")
    ax2.step(times, [(i + 1) / len(times) for i in range(len(times))], where="post")
    ax2.axvline(2000, color="tab:red", linestyle="--", label="target p99 < 2 s")
    ax2.set_xscale("log")
    ax2.set_xlabel("kill → next token (ms, log)")
    ax2.set_ylabel("fraction of trials")
    ax2.set_title("CDF")
    ax2.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    if sys.argv[1:2] == ["plot"]:  # python benchmarks/features/ha.py plot RESULT.json OUT.png
        plot_failover(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--kv-cache-memory", default="64MiB")
    common.add_argument("--max-model-len", type=int, default=512)
    common.add_argument("--replicate-every", type=int, default=16)
    common.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="one more flag for the clustered workers (repeat; e.g. --worker-arg=--replicate-to "
        "--worker-arg=standby)",
    )
    common.add_argument("--start-timeout", type=float, default=120, help="seconds per process")
    f = sub.add_parser("failover", parents=[common], help="kill the serving worker mid-stream")
    f.add_argument("--trials", type=int, default=20)
    f.add_argument("--max-tokens", type=int, default=200)
    f.add_argument("--kill-after", type=int, default=40, help="token ids received")
    f.add_argument("--max-attempts", type=int, default=3, help="per trial, if invalid")
    f.add_argument("--restart-timeout", type=float, default=60)
    f.add_argument("--request-timeout", type=float, default=120)
    f.add_argument("--out", default="benchmarks/results/ha_failover.json")
    o = sub.add_parser("overhead", parents=[common], help="tokens/s with HA off / store / on")
    o.add_argument("--reps", type=int, default=3)
    o.add_argument("--streams", type=int, default=16)
    o.add_argument("--max-tokens", type=int, default=256)
    o.add_argument("--out", default="benchmarks/results/ha_overhead.json")
    b = sub.add_parser("bytes", parents=[common], help="bytes written per generated token")
    b.add_argument("--streams", type=int, default=8)
    b.add_argument("--max-tokens", type=int, default=256)
    b.add_argument("--drain-s", type=float, default=30, help="bound on the queue drain wait")
    b.add_argument("--out", default="benchmarks/results/ha_bytes.json")
    a = ap.parse_args()

    run, summary = {
        "failover": (run_failover, summary_failover),
        "overhead": (run_overhead, summary_overhead),
        "bytes": (run_bytes, summary_bytes),
    }[a.command]
    started = time.time()
    result = run(a)
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)),
        "duration_s": round(time.time() - started, 1),
        "machine": machine(),
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, **result}, indent=1))
    from rich.console import Console
    from rich.panel import Panel

    Console().print(Panel("\n".join(summary(result)), title=f"ha {a.command} → {out}"))


if __name__ == "__main__":
    main()
