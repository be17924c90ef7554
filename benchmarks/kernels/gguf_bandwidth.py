"""How close a lone decode row's GGUF GEMV comes to the machine's streaming read (issue 49).

One decode token of a Llama-3.2-1B-shaped layer (Q/K/V 3072 x 2048, O 2048 x 2048, gate/up
16384 x 2048, down 2048 x 8192) through ``GGUFLinear`` at M = 1, over four copies of the
layer (~140 MB of Q4_K: past every cache), as GB/s of weight bytes; beside it, in the same
round, a plain float32 sum (PyTorch, every thread) over a buffer of the same bytes: the
rate this machine streams memory at that moment. The ratio of the two, per round, is what
this VM's moving bandwidth (35-65 GB/s within minutes) does not blur.

A type at ~1.0 is at the memory floor: no kernel change makes its decode faster, only
fewer bytes a weight do.

    python benchmarks/kernels/gguf_bandwidth.py --rounds 5 \\
        --out benchmarks/results/gguf_bandwidth.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch

from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.kquants import quantize
from kvserve.model.quantized import GGUFLinear, pack

SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # qkv, o, gate_up, down
COPIES = 4


def layers(ggml_type: str) -> tuple[list[tuple[GGUFLinear, torch.Tensor]], int]:
    """``COPIES`` distinct quantized copies of the 1B layer's four products, with an input
    row each, and one copy's weight bytes."""
    g = np.random.default_rng(0)
    out = []
    for n, k in SHAPES:
        raw = quantize(g.standard_normal((n, k), dtype=np.float32) * 0.02, ggml_type)
        for c in range(COPIES):
            lin = GGUFLinear([pack(np.roll(raw, c, axis=0).copy(), ggml_type, k)])
            out.append((lin, torch.randn(1, k)))
    nbytes = sum(p.nbytes for lin, _ in out for p in lin.parts) // COPIES
    return out, nbytes


def best_seconds(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_0,Q4_K,Q6_K,Q8_0")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", help="write the result as JSON here")
    args = ap.parse_args()
    assert load_cpu_kernels(), "needs the CPU kernels"
    types = args.types.split(",")
    built = {t: layers(t) for t in types}
    rows: dict[str, list[dict[str, float]]] = {t: [] for t in types}
    for r in range(args.rounds):
        for t in types if r % 2 == 0 else reversed(types):
            mods, nbytes = built[t]
            stream = torch.rand(COPIES * nbytes // 4)

            def gemv(mods=mods) -> None:
                for lin, x in mods:
                    lin(x)

            s_gemv = best_seconds(gemv, 5) / COPIES
            s_sum = best_seconds(stream.sum, 5) / COPIES
            rows[t].append({"kernel_gbps": nbytes / s_gemv / 1e9,
                            "stream_gbps": nbytes / s_sum / 1e9,
                            "ratio": s_sum / s_gemv, "ms_per_layer": s_gemv * 1e3})  # fmt: skip
            print(f"round {r} {t}: {rows[t][-1]}", flush=True)
    summary = {
        t: {
            "weight_mb_per_layer": built[t][1] / 1e6,
            "median_ratio": statistics.median(x["ratio"] for x in rows[t]),
            "median_kernel_gbps": statistics.median(x["kernel_gbps"] for x in rows[t]),
            "median_stream_gbps": statistics.median(x["stream_gbps"] for x in rows[t]),
        }
        for t in types
    }
    for t, s in summary.items():
        print(f"{t}: kernel {s['median_kernel_gbps']:.1f} GB/s, stream "
              f"{s['median_stream_gbps']:.1f} GB/s, ratio {s['median_ratio']:.2f}")  # fmt: skip
    if args.out:
        machine = platform.processor() or platform.machine()
        result = {"machine": machine, "threads": torch.get_num_threads(),
                  "rounds": rows, "summary": summary}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
