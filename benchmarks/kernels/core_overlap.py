"""Decode attention on one core beside the GEMMs on the other: what overlap can buy here.

The decode step runs its GEMMs on both cores, then attention on both cores. Its
"overlapped floor" (all bytes at the read bandwidth, or all FLOPs at the matmul rate,
whichever is longer) assumes attention's KV read can hide under the GEMMs' arithmetic.
The fourteenth and sixteenth rounds tried that on one core (prefetching the next layer's
KV into L1, then L2, during the GEMMs) and came out level. This measures the other way:
one core reading KV while the other multiplies, and whether they slow each other down.

The workloads are one decode step's, SmolLM2-135M's shape: bf16 attention over 30
layers' caches, 32 sequences at context ``--context`` (``attention_ab.py``'s tables, every
layer from DRAM); and the 30 layers' GEMMs at M = 32 (QKV, O, gate/up with SiLU, down).
Each run is a child process pinned to its cores; two children started together run side
by side on cores 0 and 1. Medians of step times, in ms:

- ``attention_2t``, ``gemms_2t``: each alone on both cores (the engine's schedule is
  their sum);
- ``attention_1t``, ``gemms_1t``: each alone on one core; ``gemms_1t_halves``: the
  GEMMs as two micro-batches of 16 rows (what a pipeline of attention on one half beside
  the GEMMs of the other needs);
- ``attention_beside``, ``gemms_beside``: both at once, one core each.

From these it prints the best a two-core schedule of these kernels can do when neither
slows the other (one core's attention time plus the halves' GEMM time, shared evenly),
beside the sequential sum. Run it with tcmalloc, alone on the machine:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \
        python benchmarks/kernels/core_overlap.py --out benchmarks/results/core_overlap_r18.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from attention_ab import BS, HKV, HQ, B, D, L, decode_tables  # scripts of this folder
from gemm_prepack import SHAPES

from kvserve.model.cpu_kernels import load_cpu_kernels

NB = 2048  # blocks in each layer's cache


def child(role: str, threads: int, seconds: float, start_at: float, context: int) -> None:
    """Run one workload in this process (pinned by the parent) and print its median step."""
    torch.set_num_threads(threads)
    assert load_cpu_kernels(), "the CPU kernels did not build"
    ops = torch.ops.kvserve
    torch.manual_seed(0)
    if role == "attention":
        tables, _ = decode_tables(B, (context + BS - 1) // BS)
        lens = torch.full((B,), context, dtype=torch.long)
        starts = torch.arange(B + 1, dtype=torch.long)
        q = torch.randn(B, HQ, D).bfloat16()
        cache = torch.randn(L, 2, NB, 1, HKV, 16, D).bfloat16()  # the engine's bf16 tiles

        def step() -> None:
            for layer in range(L):
                c = cache[layer]
                ops.paged_attention(q, c[0], c[1], tables, lens, starts, D**-0.5, 0, 0, None, None)
    else:
        shapes = [SHAPES[k] for k in ("qkv", "o", "gate_up", "down")]  # [N, K] each
        weights = [
            tuple(ops.bf16_pack_weight(torch.randn(n, k).bfloat16()) for n, k in shapes)
            for _ in range(L)
        ]
        nqkv, hidden = SHAPES["qkv"]
        inter = SHAPES["gate_up"][0] // 2
        x = torch.randn(B, hidden).bfloat16()
        parts = [x[: B // 2].contiguous(), x[B // 2 :].contiguous()] if role == "halves" else [x]

        def step() -> None:
            for wq, wo, wgu, wd in weights:
                for xp in parts:
                    ops.bf16_linear(xp, wq, None, nqkv)
                    ops.bf16_linear(xp, wo, None, hidden)
                    g = ops.bf16_linear_silu_mul(xp, wgu, None, inter)
                    ops.bf16_linear(g, wd, None, hidden)

    for _ in range(3):
        step()
    while time.time() < start_at:  # the side-by-side pair starts together
        time.sleep(0.0005)
    times: list[float] = []
    end = time.time() + seconds
    while time.time() < end:
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    print(json.dumps({"ms": 1e3 * statistics.median(times), "steps": len(times)}))


def spawn(role: str, cpus: set[int], a: argparse.Namespace, start_at: float) -> subprocess.Popen:
    args = [sys.executable, __file__, "--child", role, "--threads", str(len(cpus))]
    args += ["--seconds", str(a.seconds), "--start-at", str(start_at)]
    args += ["--context", str(a.context)]
    return subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
    )


def collect(p: subprocess.Popen, timeout: float) -> float:
    out, _ = p.communicate(timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"a child failed (rc {p.returncode})")
    return float(json.loads(out.strip().splitlines()[-1])["ms"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=6.0, help="timed seconds per measurement")
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--rounds", type=int, default=2, help="repeat the whole set, interleaved")
    ap.add_argument("--out", help="write the result as JSON here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.threads, a.seconds, a.start_at, a.context)
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("core_overlap.py needs two allowed CPUs")
    both, c0, c1 = set(cpus[:2]), {cpus[0]}, {cpus[1]}
    lead = 12.0  # seconds for a child to import torch, build the kernels' data and warm up
    limit = lead + a.seconds + 120
    runs: dict[str, list[float]] = {}
    for _ in range(a.rounds):
        for name, role, where in (
            ("attention_2t", "attention", both),
            ("gemms_2t", "gemms", both),
            ("attention_1t", "attention", c0),
            ("gemms_1t", "gemms", c1),
            ("gemms_1t_halves", "halves", c1),
        ):
            p = spawn(role, where, a, time.time() + lead)
            runs.setdefault(name, []).append(collect(p, limit))
            print(f"{name}: {runs[name][-1]:.2f} ms", flush=True)
        start = time.time() + lead
        pa, pg = spawn("attention", c0, a, start), spawn("gemms", c1, a, start)
        runs.setdefault("attention_beside", []).append(collect(pa, limit))
        runs.setdefault("gemms_beside", []).append(collect(pg, limit))
        print(
            f"beside: attention {runs['attention_beside'][-1]:.2f} ms, "
            f"GEMMs {runs['gemms_beside'][-1]:.2f} ms",
            flush=True,
        )
    med = {k: statistics.median(v) for k, v in runs.items()}
    sequential = med["attention_2t"] + med["gemms_2t"]
    # each core keeps its own rate beside the other, so a pipeline that shares the work
    # evenly takes half the cores' total time (barriers and imbalance not counted)
    pipelined = (
        med["attention_beside"] + med["gemms_1t_halves"] * med["gemms_beside"] / med["gemms_1t"]
    ) / 2
    result = {
        "ms": {k: round(v, 2) for k, v in med.items()},
        "runs": runs,
        "slowdown_beside": {
            "attention": round(med["attention_beside"] / med["attention_1t"], 3),
            "gemms": round(med["gemms_beside"] / med["gemms_1t"], 3),
        },
        "sequential_ms": round(sequential, 2),
        "best_pipeline_ms": round(pipelined, 2),
        "workload": {"context": a.context, "seqs": B, "layers": L, "seconds": a.seconds},
    }
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
