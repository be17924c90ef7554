"""Decode-size GEMMs of 30 SmolLM2-135M layers: ``F.linear``, oneDNN-prepacked weights,
kvserve's own bf16 GEMM (``csrc/bf16_gemm.cpp``, when its kernels load and the CPU has
AVX-512-BF16; on a CPU with AMX both of its kernels, tiles and dot products) and, when
run with vLLM's Python, vLLM-CPU's own ``onednn_mm``. Each output is dropped before the
next call, as in a forward pass (kept, 30 fresh outputs a round fault their pages in).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 python \
        benchmarks/kernels/gemm_prepack.py
    LD_PRELOAD=... /work/venvs/vllm/bin/python benchmarks/kernels/gemm_prepack.py
    python benchmarks/kernels/gemm_prepack.py --rows 32,64,72,96,128,192 --only-kvserve
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30


def bench(fn, n: int) -> float:
    for _ in range(3):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def drop(results) -> None:
    """Consume ``results`` one at a time, keeping none."""
    for _ in results:
        pass


def amx(enable: bool, fn):
    """``fn`` run with kvserve's AMX kernel on or off (``bf16_gemm_use_amx``)."""

    def run():
        before = torch.ops.kvserve.bf16_gemm_use_amx(enable)
        try:
            return fn()
        finally:
            torch.ops.kvserve.bf16_gemm_use_amx(before)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,64,256", help="comma-separated M values")
    ap.add_argument(
        "--only-kvserve", action="store_true", help="time kvserve's GEMM alone (and vLLM's)"
    )
    a = ap.parse_args()
    try:
        from vllm import _custom_ops as vllm_ops
    except ImportError:
        vllm_ops = None
    try:
        from kvserve.model.cpu_kernels import load_cpu_kernels

        own = load_cpu_kernels() and torch.ops.kvserve.bf16_gemm_available()
        tiles = own and torch.ops.kvserve.bf16_gemm_amx()
    except ImportError:
        own = tiles = False
    for m in (int(v) for v in a.rows.split(",")):
        totals: dict[str, float] = {}
        for n_out, k in SHAPES.values():
            ws = [torch.randn(n_out, k, dtype=torch.bfloat16) for _ in range(LAYERS)]
            x = torch.randn(m, k, dtype=torch.bfloat16)
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in ws]
            reps = 10 if m >= 256 else 20
            runs = {}
            if not a.only_kvserve:
                runs["F.linear"] = lambda x=x, ws=ws: drop(F.linear(x, w) for w in ws)
                runs["prepacked"] = lambda x=x, ps=packed: drop(
                    torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in ps
                )
            if own:
                mine = [torch.ops.kvserve.bf16_pack_weight(w) for w in ws]
                ours = lambda x=x, ps=mine, n=n_out: drop(  # noqa: E731
                    torch.ops.kvserve.bf16_linear(x, p, None, n) for p in ps
                )
                if tiles:
                    runs["kvserve AMX"] = amx(True, ours)
                    runs["kvserve AVX-512-BF16"] = amx(False, ours)
                else:
                    runs["kvserve bf16_linear"] = ours
            if vllm_ops is not None:
                handles = [vllm_ops.create_onednn_mm(w.t(), 32) for w in ws]
                runs["vllm onednn_mm"] = lambda x=x, hs=handles: drop(
                    vllm_ops.onednn_mm(h, x, None) for h in hs
                )
            for name, fn in runs.items():
                totals[name] = totals.get(name, 0.0) + bench(fn, reps)
        print(f"M={m:4d} " + "  ".join(f"{k}: {v * 1e3:7.2f} ms" for k, v in totals.items()))


if __name__ == "__main__":
    main()
