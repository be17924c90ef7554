"""bf16 tiled attention on AMX tiles vs the AVX-512-BF16 spans, in one process (AMX CPUs).

The two kernels read the same tiled bf16 caches (``csrc/paged_attention_amx.cpp`` and
``csrc/paged_attention_tiles.cpp``); ``torch.ops.kvserve.attention_use_amx`` switches
between them. Two workloads of SmolLM2-135M's shape (9 query heads on 3 KV heads of 64,
16-token blocks, each layer's cache its own tensor, so 30 layers come from DRAM):

- ``decode``: 32 sequences, one query row each, at context 320 (offline.py's decode step);
- ``prefill``: 8 sequences of 256 query rows at context 256 (a 2048-token prefill step).

Each iteration times all 30 layers with one kernel, then the other, alternating which goes
first; the medians (ms for 30 layers) are printed and written with ``--out``.

    python benchmarks/kernels/attention_amx.py --out benchmarks/results/attention_amx.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.kv_cache import TILE

LAYERS, HQ, HKV, D, BS = 30, 9, 3, 64, 16


def workload(seqs: int, context: int, rows: int) -> tuple:
    """30 layers' caches [2, blocks, 1, 3, 16, 64] and one call's arguments."""
    blocks = (context + BS - 1) // BS
    g = torch.Generator().manual_seed(0)
    shape = (2, seqs * blocks, BS // TILE, HKV, TILE, D)
    caches = [torch.randn(*shape, generator=g).bfloat16() for _ in range(LAYERS)]
    tables = torch.arange(seqs * blocks).view(seqs, blocks)
    lens = torch.full((seqs,), context)
    starts = torch.arange(seqs + 1) * rows
    q = torch.randn(seqs * rows, HQ, D, generator=g).bfloat16()
    return caches, tables, lens, starts, q


def time_layers(caches, tables, lens, starts, q) -> float:
    """Seconds for one call per layer."""
    t0 = time.perf_counter()
    for c in caches:
        torch.ops.kvserve.paged_attention(q, c[0], c[1], tables, lens, starts, D**-0.5, 0, 0)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=10, help="timed iterations per kernel")
    ap.add_argument("--out", type=Path, help="write the medians here as JSON")
    a = ap.parse_args()
    if not (load_cpu_kernels() and torch.ops.kvserve.attention_amx()):
        raise SystemExit("attention_amx.py: this CPU or build has no AMX attention kernel")
    results: dict[str, dict[str, float]] = {}
    before = torch.ops.kvserve.attention_use_amx(True)
    try:
        for name, shape in [("decode", (32, 320, 1)), ("prefill", (8, 256, 256))]:
            args = workload(*shape)
            times: dict[str, list[float]] = {"amx": [], "avx512": []}
            for i in tqdm(range(a.iters), desc=name):
                order = ["amx", "avx512"] if i % 2 == 0 else ["avx512", "amx"]
                for kernel in order:
                    torch.ops.kvserve.attention_use_amx(kernel == "amx")
                    times[kernel].append(time_layers(*args))
            results[name] = {k: 1e3 * statistics.median(v) for k, v in times.items()}
            med = results[name]
            print(f"{name}: AMX {med['amx']:.2f} ms, AVX-512 {med['avx512']:.2f} ms "
                  f"({med['amx'] / med['avx512']:.2f}x)")  # fmt: skip
    finally:
        torch.ops.kvserve.attention_use_amx(before)
    if a.out:
        a.out.write_text(json.dumps({"ms_for_30_layers": results, "iters": a.iters}, indent=1))


if __name__ == "__main__":
    main()
