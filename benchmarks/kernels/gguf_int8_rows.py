"""The int8 products by row count: Q8_0 and ``--quantization int8`` (c8) on AMX-INT8 tiles
and on the VNNI kernel, beside kvserve's bf16 GEMM, on a Llama-3.2-1B-shaped layer (issue
49: an int8 prefill and a 32-row decode step must not be slower than bf16's).

For each M, one round runs every variant over the layer's four products (Q/K/V 3072 x 2048,
O 2048 x 2048, gate/up 16384 x 2048, down 2048 x 8192), interleaved; the figure is the
median of the rounds' best-of-reps times, as ms per layer and as tera-operations a second
(2 M N K). ``--layers 16`` runs 16 distinct copies a pass, so that the weights come from
DRAM, as in a decode step, rather than from a large last-level cache. Where the CPU has
no AMX, "amx" runs the VNNI kernel (the script says so).

    python benchmarks/kernels/gguf_int8_rows.py --rows 1,8,16,32,64,256,1024 --rounds 3 \\
        --out benchmarks/results/gguf_int8_rows.json
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
from kvserve.model.linear import KernelLinear
from kvserve.model.quantized import GGUFLinear, pack, pack_int8

SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # qkv, o, gate_up, down


def layer(kind: str, seed: int = 0) -> list:
    """The layer's four products as modules of ``kind``: "bf16", "q8_0" or "int8"."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=g) * 0.02
        if kind == "bf16":
            lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
            lin.weight.data.copy_(w)
            out.append(KernelLinear(lin))
        elif kind == "q8_0":
            raw = quantize(w.numpy().astype(np.float32), "Q8_0")
            out.append(GGUFLinear([pack(raw, "Q8_0", k)]))
        else:
            out.append(GGUFLinear([pack_int8(w)]))
    return out


def seconds(mods: list, xs: list[torch.Tensor], reps: int) -> float:
    """Best of ``reps`` passes over the layer's products."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for mod, x in zip(mods, xs, strict=True):
            mod(x)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,16,32,64,256,1024", help="comma-separated M values")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    ap.add_argument(
        "--layers",
        type=int,
        default=1,
        help="distinct copies of the layer a pass runs through: 1 keeps the weights in a "
        "large last-level cache (480 MiB on the AMX VMs here); 16, a 1B model's worth, "
        "streams them from DRAM as a decode step does",
    )
    ap.add_argument("--out", default=None, help="write the results here as JSON")
    args = ap.parse_args()
    assert load_cpu_kernels()
    amx = bool(torch.ops.kvserve.gguf_gemm_amx())
    switch = torch.ops.kvserve.gguf_gemm_use_amx
    layers = {
        kind: [mod for i in range(args.layers) for mod in layer(kind, seed=i)]
        for kind in ("bf16", "q8_0", "int8")
    }
    variants = [("bf16", "bf16", None), ("q8_0 vnni", "q8_0", False),
                ("q8_0 amx", "q8_0", True), ("int8 vnni", "int8", False),
                ("int8 amx", "int8", True)]  # fmt: skip
    results = []
    for m in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(m, k).bfloat16() for _, k in SHAPES] * args.layers
        work = args.layers * (2 * m * sum(n * k for n, k in SHAPES) + 1e9)
        reps = max(2 if args.layers > 1 else 3, min(50, int(4e10 / work)))
        times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
        for _ in range(args.rounds):
            for name, kind, tiles in variants:
                before = switch(bool(tiles)) if tiles is not None else None
                try:
                    seconds(layers[kind], xs, 1)  # warm
                    times[name].append(seconds(layers[kind], xs, reps))
                finally:
                    if before is not None:
                        switch(before)
        ops = 2 * m * sum(n * k for n, k in SHAPES)
        row = {"rows": m}
        times = {name: [t / args.layers for t in ts] for name, ts in times.items()}
        for name, ts in times.items():
            t = statistics.median(ts)
            row[name] = {"ms": round(t * 1e3, 3), "tops": round(ops / t / 1e12, 3)}
        results.append(row)
        print(f"M={m:5d} " + "  ".join(f"{n} {row[n]['ms']:8.3f} ms" for n, _, _ in variants))
    if not amx:
        print("this CPU has no AMX-INT8 tiles: the 'amx' rows ran the VNNI kernel")
    report = {"machine": platform.processor() or platform.machine(), "amx": amx,
              "threads": torch.get_num_threads(), "layers": args.layers,
              "results": results}  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
