"""Preemption under an oversubscribed KV pool: swap vs recompute vs auto, cost-weighted
victims vs the latest-arrival rule; and the swap-vs-recompute crossover on this machine.

Workload (``workload``): the bundled default model (bfloat16, CPU kernels), a burst of
``--num-requests`` greedy requests, ``ignore_eos``, all submitted at once:

- half are chat turns: one shared system prompt (``--system-len`` tokens) + a private
  user part (32–96 tokens);
- half are documents: a private prompt of 256–512 tokens;
- each generates 64–256 tokens (seeded).

The pool is sized so that the offered KV demand — every request's prompt + output blocks,
the shared system prompt counted once — is ``--oversubscription`` × the pool (2×). Every
configuration runs in a fresh subprocess (tcmalloc preloaded) on the same requests, after
a warm-up; ``--repeat`` rounds, interleaved, median reported. Total completion time =
wall time from submission to the last token; latency = per-request submission to last
token. All configurations must produce identical tokens (checked).

``crossover``: for sequences of L tokens, the measured time to prefill them (one request,
one step) against the time to swap their blocks out and back in (``SwapSpace``), plus the
crossover the engine's online cost model derives from what it measured during a run.

    python benchmarks/features/preemption.py workload --repeat 3 \
        --out benchmarks/results/preemption.json
    python benchmarks/features/preemption.py crossover \
        --out benchmarks/results/preemption_crossover.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvserve.engine.tcmalloc import find_tcmalloc

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent  # benchmarks/

CONFIGS = [
    ("swap", "latest"),
    ("recompute", "latest"),
    ("auto", "latest"),
    ("swap", "cost"),
    ("recompute", "cost"),
    ("auto", "cost"),
]


def make_requests(n: int, system_len: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) per request; deterministic."""
    import random

    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(system_len)]
    out = []
    for i in range(n):
        if i % 2 == 0:
            prompt = system + [rng.randrange(3, vocab) for _ in range(rng.randint(32, 96))]
        else:
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(256, 512))]
        out.append((prompt, rng.randint(64, 256)))
    return out


def demand_blocks(requests: list[tuple[list[int], int]], system_len: int, bs: int) -> int:
    shared = system_len // bs
    total = 0
    for i, (p, m) in enumerate(requests):
        total += -(-(len(p) + m) // bs) - (shared if i % 2 == 0 else 0)
    return total + shared


def _engine(model: str, **kw):
    from kvserve.config import EngineArgs
    from kvserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineArgs(model=model, **kw))


def worker_workload(a: argparse.Namespace) -> dict:
    from kvserve.sampling import SamplingParams

    probe = _engine(a.model, kv_cache_memory="64MiB")
    vocab, bpb, bs = probe.spec.vocab_size, probe.kv_spec.bytes_per_block, probe.kv.block_size
    del probe
    requests = make_requests(a.num_requests, a.system_len, vocab, a.seed)
    pool = int(demand_blocks(requests, a.system_len, bs) / a.oversubscription)
    engine = _engine(
        a.model,
        kv_cache_memory=pool * bpb,
        max_model_len=1024,
        preemption_mode=a.mode,
        preemption_victim=a.victim,
        swap_space=int(a.swap_frac * pool * bpb),
    )
    assert engine.kv.num_blocks == pool, (engine.kv.num_blocks, pool)
    warm = SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False)
    for i, (p, _) in enumerate(make_requests(4, a.system_len, vocab, a.seed + 99)):
        engine.add_request(f"warm{i}", p, warm)
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv.reset_prefix_cache()
    before = dict(engine.scheduler.preemptions)
    work = {"tokens_computed": 0, "swap_bytes": 0}
    schedule = engine.scheduler.schedule

    def counting_schedule():  # the real scheduler; counts the tokens each step computes
        out = schedule()
        work["tokens_computed"] += out.num_tokens
        return out

    engine.scheduler.schedule = counting_schedule
    host = engine.runner.host_swap  # the worker's side of swapping: it does the copies
    if host is not None:
        observe = host.on_copy

        def counting_copy(nbytes: int, seconds: float) -> None:
            work["swap_bytes"] += nbytes
            observe(nbytes, seconds)

        host.on_copy = counting_copy
    c0 = time.process_time()
    t0 = time.perf_counter()
    for i, (p, m) in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False)
        engine.add_request(f"r{i}", p, params)
    finish: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = time.perf_counter() - t0
    total = time.perf_counter() - t0
    cpu = time.process_time() - c0
    lat = sorted(finish.values())
    pre: dict[str, int] = {}
    for (mode, _, _), n in engine.scheduler.preemptions.items():
        pre[mode] = pre.get(mode, 0) + n - before.get((mode, _, _), 0)
    digest = hashlib.sha256(json.dumps([tokens[f"r{i}"] for i in range(len(requests))]).encode())
    out_tokens = sum(m for _, m in requests)
    return {
        "mode": a.mode,
        "victim": a.victim,
        "pool_blocks": pool,
        "total_s": round(total, 3),
        "cpu_s": round(cpu, 3),
        "steps": steps,
        **work,
        "output_tok_s": round(out_tokens / total, 1),
        "latency_p50_s": round(lat[len(lat) // 2], 3),
        "latency_p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3),
        "preemptions": pre,
        "tokens_sha256": digest.hexdigest()[:16],
        "request_sha256": [
            hashlib.sha256(json.dumps(tokens[f"r{i}"]).encode()).hexdigest()[:8]
            for i in range(len(requests))
        ],
        "cost_rates": engine.cost_model.rates(),
        "model_crossover_tokens": engine.cost_model.crossover_tokens(bs),
    }


def worker_crossover(a: argparse.Namespace) -> dict:
    import torch

    from kvserve.request import Request
    from kvserve.sampling import SamplingParams
    from kvserve.sched.scheduler import SchedulerOutput

    engine = _engine(
        a.model, kv_cache_memory="512MiB", max_num_batched_tokens=4096, max_model_len=2048
    )
    bs = engine.kv.block_size
    rows = []
    lengths = [16 * 2**k for k in range(7)] + [2032]  # 16 … 1024, 2032 (+2 = max_model_len)
    for i, n in enumerate([*lengths[:2], *lengths]):  # the first two warm up
        prompt = torch.randint(3, engine.spec.vocab_size, (n,)).tolist()
        params = SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False)
        engine.add_request(f"p{i}", prompt, params)
        t0 = time.perf_counter()
        engine.step()  # the whole prompt in one step
        prefill = time.perf_counter() - t0
        req: Request = engine.requests[f"p{i}"]
        table = engine.kv.block_table(req.request_id)
        swap, null = engine.swap, engine.kv.pool.null_block
        times = []
        for _ in range(5):  # out and back into the same blocks, as the worker copies them
            t0 = time.perf_counter()
            out = swap.reserve(req.request_id, table, null)
            assert out is not None
            engine.runner.step(SchedulerOutput(swap_out=[out]))
            back = swap.release(req.request_id, out.blocks, 0)
            engine.runner.step(SchedulerOutput(swap_in=[back]))
            swap.settle()  # as the step's update does
            times.append(time.perf_counter() - t0)
        engine.abort_request(req.request_id)
        if i >= 2:
            rows.append(
                {
                    "tokens": n,
                    "blocks": len(table),
                    "recompute_ms": round(prefill * 1e3, 3),
                    "swap_out_in_ms": round(statistics.median(times) * 1e3, 3),
                }
            )
    measured = next((r["tokens"] for r in rows if r["swap_out_in_ms"] < r["recompute_ms"]), None)
    return {
        "rows": rows,
        "measured_crossover_tokens": measured,
        "model_crossover_tokens": engine.cost_model.crossover_tokens(bs),
        "cost_rates": engine.cost_model.rates(),
        "bytes_per_token": engine.kv_spec.bytes_per_token,
    }


def _spawn(a: argparse.Namespace, *extra: str) -> dict:
    env = dict(os.environ)
    lib = find_tcmalloc()
    if lib and not a.no_tcmalloc:
        env["LD_PRELOAD"] = lib
    cmd = [sys.executable, __file__, *extra, "--model", a.model, "--seed", str(a.seed)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _meta(a: argparse.Namespace) -> dict:
    import torch

    return {
        "command": " ".join(sys.argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "model": a.model,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def run_workload(a: argparse.Namespace) -> None:
    from tqdm import tqdm

    runs: dict[str, list[dict]] = {}
    wl = [
        "--num-requests",
        str(a.num_requests),
        "--system-len",
        str(a.system_len),
        "--oversubscription",
        str(a.oversubscription),
        "--swap-frac",
        str(a.swap_frac),
    ]
    with tqdm(total=a.repeat * len(CONFIGS), desc="preemption runs") as bar:
        for _ in range(a.repeat):
            for mode, victim in CONFIGS:
                r = _spawn(a, "_workload", "--mode", mode, "--victim", victim, *wl)
                runs.setdefault(f"{mode}/{victim}", []).append(r)
                bar.update()
                bar.set_postfix_str(f"{mode}/{victim} {r['total_s']}s")
    digests = {r["tokens_sha256"] for rs in runs.values() for r in rs}
    reference = runs["swap/latest"][0]["request_sha256"]  # swap restores K/V bit for bit
    summary = []
    for key, rs in runs.items():
        med = lambda f, rs=rs: statistics.median(r[f] for r in rs)  # noqa: E731
        summary.append(
            {
                "config": key,
                "requests_differing_from_swap": max(
                    sum(x != y for x, y in zip(r["request_sha256"], reference, strict=True))
                    for r in rs
                ),
                "total_s": med("total_s"),
                "total_s_min": min(r["total_s"] for r in rs),
                "total_s_max": max(r["total_s"] for r in rs),
                "output_tok_s": med("output_tok_s"),
                "latency_p50_s": med("latency_p50_s"),
                "latency_p99_s": med("latency_p99_s"),
                "total_s_runs": [r["total_s"] for r in rs],
                "preemptions": rs[-1]["preemptions"],
                "steps": med("steps"),
                "tokens_computed": med("tokens_computed"),
                "swap_mb": round(med("swap_bytes") / 2**20, 1),
                "pool_blocks": rs[-1]["pool_blocks"],
            }
        )
    result = {**_meta(a), "identical_tokens": len(digests) == 1, "summary": summary, "runs": runs}
    Path(a.out).write_text(json.dumps(result, indent=1))
    for s in summary:
        print(
            f"{s['config']:16} total {s['total_s']:7.2f}s  {s['output_tok_s']:7.1f} tok/s  "
            f"p50 {s['latency_p50_s']:6.2f}s p99 {s['latency_p99_s']:6.2f}s  {s['preemptions']} "
            f"steps {s['steps']} computed {s['tokens_computed']} swap {s['swap_mb']} MiB "
            f"differing {s['requests_differing_from_swap']}"
        )
    print("identical tokens across configurations:", len(digests) == 1)


def plot_crossover(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [row["tokens"] for row in r["rows"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [row["recompute_ms"] for row in r["rows"]], "o-", label="recompute (prefill)")
    ax.plot(x, [row["swap_out_in_ms"] for row in r["rows"]], "s-", label="swap out + in")
    ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="ms")
    ax.set_title("Restoring a preempted sequence (default model, CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_crossover(a: argparse.Namespace) -> None:
    r = _spawn(a, "_crossover")
    Path(a.out).write_text(json.dumps({**_meta(a), **r}, indent=1))
    plot_crossover(r, str(Path(a.out).with_suffix(".png")))
    for row in r["rows"]:
        print(row)
    print("crossover (tokens): measured", r["measured_crossover_tokens"])
    print("crossover (tokens): cost model", r["model_crossover_tokens"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["workload", "crossover", "_workload", "_crossover"])
    ap.add_argument("--model", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--system-len", type=int, default=384)
    ap.add_argument("--oversubscription", type=float, default=2.0)
    ap.add_argument("--swap-frac", type=float, default=0.25, help="swap space / KV pool")
    ap.add_argument("--mode", default="auto")
    ap.add_argument("--victim", default="cost")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-tcmalloc", action="store_true")
    ap.add_argument("--out", default=str(BENCH / "results" / "preemption.json"))
    a = ap.parse_args()
    if a.model is None:
        from kvserve.default_model import default_model_path

        a.model = str(default_model_path())
    {
        "workload": run_workload,
        "crossover": run_crossover,
        "_workload": lambda a: print(json.dumps(worker_workload(a))),
        "_crossover": lambda a: print(json.dumps(worker_crossover(a))),
    }[a.command](a)


if __name__ == "__main__":
    main()
