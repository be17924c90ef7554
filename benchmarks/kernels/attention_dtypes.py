"""Decode attention per KV cache dtype, each in the layout the engine allocates for it.

The workload is ``attention_ab.py``'s decode step: 30 layers of SmolLM2-135M's shape (9 query
heads on 3 KV heads of 64), 32 sequences at context 320, 16-token blocks (each sequence's
first 16 contiguous, the rest interleaved), every layer's cache read from DRAM. The caches
are timed in alternating order and the medians printed (ms for the 30 layers):

- ``bf16``: tiles ``[blocks, 1, 3, 16, 64]``;
- ``int8``, ``fp8_e4m3``: tiles of codes with float16 scales ``[slots / 16, 3, 16]`` per
  token and head (the token-scale default), what a bf16 model's engine allocates;
- ``int8_rows``: codes ``[blocks, 16, 3, 64]`` with scales ``[slots, 3]``, the layout of
  8-bit caches before tiles (and still of fp16 / fp32 models' caches).

``--hot`` reads layer 0's caches 30 times instead of each layer's once: one layer's K/V
(7.9 MB in bf16) stays in L3, so the time is the kernel's arithmetic and L3's, not DRAM's.
The two together tell a cache whose kernel waits on memory from one that waits on its own
arithmetic.

    python benchmarks/kernels/attention_dtypes.py --out benchmarks/results/attention_dtypes_r13.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from attention_ab import decode_tables  # a script of this folder

from kvserve.model.cpu_kernels import load_cpu_kernels

L, B, HKV, HQ, D, BS, NB = 30, 32, 3, 9, 64, 16, 2048


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument(
        "--hot", action="store_true", help="every layer reads layer 0's caches (from L3)"
    )
    ap.add_argument("--out", help="write the result as JSON here")
    a = ap.parse_args()
    assert load_cpu_kernels(), "the CPU kernels did not build"
    torch.manual_seed(0)
    nbs = (a.context + BS - 1) // BS
    tables, _ = decode_tables(B, nbs)
    lens = torch.full((B,), a.context, dtype=torch.long)
    starts = torch.arange(B + 1, dtype=torch.long)
    q = torch.randn(B, HQ, D).bfloat16()
    scales = (torch.rand(L, 2, NB * BS, HKV) * 0.01 + 0.01).half()
    tile_scales = scales.view(L, 2, NB * BS // 16, HKV, 16)  # random: any order will do
    tiles = (L, 2, NB, BS // 16, HKV, 16, D)
    caches = {
        "bf16": (torch.randn(*tiles).bfloat16(), None),
        "int8": (torch.randint(-127, 128, tiles, dtype=torch.int8), tile_scales),
        "fp8_e4m3": (torch.randn(*tiles).to(torch.float8_e4m3fn), tile_scales),
        "int8_rows": (torch.randint(-127, 128, (L, 2, NB, BS, HKV, D), dtype=torch.int8), scales),
    }

    def decode(name: str) -> float:
        c, sc = caches[name]
        t = time.perf_counter()
        for layer in range(L):
            i = 0 if a.hot else layer
            ks, vs = (sc[i, 0], sc[i, 1]) if sc is not None else (None, None)
            torch.ops.kvserve.paged_attention(
                q, c[i, 0], c[i, 1], tables, lens, starts, D**-0.5, 0, 0, ks, vs
            )
        return time.perf_counter() - t

    times: dict[str, list[float]] = {k: [] for k in caches}
    for i in range(a.iters):
        for k in list(caches) if i % 2 else list(caches)[::-1]:
            times[k].append(decode(k))
    result = {
        "decode_ms_per_step": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "workload": vars(a),
    }
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
