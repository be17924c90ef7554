"""kvserve's bf16 GEMM against the machine's instruction peak, not PyTorch's matmul rate.

1. The ``vdpbf16ps`` peak: a register-only loop of 24 independent dot products (inline
   assembly, built with ``load_inline``), one copy on every OpenMP thread at once.
2. ``bf16_linear`` (``bf16_linear_silu_mul`` for gate/up, as the engine runs it) on
   SmolLM2-135M's four products, as a share of that peak, with one thread and with all:
   ``cache`` (the same call repeated: x and weights stay in cache), and ``dram`` at decode
   sizes (30 layers' weights on huge pages, as the engine packs them, each call on the next
   layer's, as in a decode step) or ``evicted`` at prefill sizes (64 MB read between calls:
   clean lines, so no write-backs land in the timed call). ``--rounds`` repeats it all;
   the JSON keeps every round.

Needs AVX-512-BF16 and the kernels. Run it alone, with tcmalloc preloaded:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \\
        python benchmarks/kernels/gemm_peak.py --out benchmarks/results/gemm_peak.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from gemm_prepack import LAYERS, SHAPES  # a script of this folder
from torch.utils.cpp_extension import load_inline

from kvserve.hugepages import huge_arena
from kvserve.model.cpu_kernels import load_cpu_kernels

_PEAK_SRC = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <chrono>
#include <vector>
#define KVS_DOT(r) "vdpbf16ps %%zmm30, %%zmm31, %%zmm" #r "\n"
// GFLOP/s of every thread running `iters` x 24 independent vdpbf16ps at once (the slowest
// thread's time counts).
double dpbf16_peak(int64_t iters) {
  const int threads = at::get_num_threads();
  std::vector<double> secs(threads, 0.0);
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      int64_t n = iters;
      const auto t0 = std::chrono::steady_clock::now();
      __asm__ volatile(
          "vpxord %%zmm30, %%zmm30, %%zmm30\n vpxord %%zmm31, %%zmm31, %%zmm31\n"
          "1:\n" KVS_DOT(0) KVS_DOT(1) KVS_DOT(2) KVS_DOT(3) KVS_DOT(4) KVS_DOT(5)
          KVS_DOT(6) KVS_DOT(7) KVS_DOT(8) KVS_DOT(9) KVS_DOT(10) KVS_DOT(11) KVS_DOT(12)
          KVS_DOT(13) KVS_DOT(14) KVS_DOT(15) KVS_DOT(16) KVS_DOT(17) KVS_DOT(18)
          KVS_DOT(19) KVS_DOT(20) KVS_DOT(21) KVS_DOT(22) KVS_DOT(23)
          "dec %0\n jnz 1b\n"
          : "+r"(n)::"memory");
      secs[t] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
  });
  const double slowest = *std::max_element(secs.begin(), secs.end());
  return threads * static_cast<double>(iters) * 24 * 64 / slowest / 1e9;
}
"""


def dot_peak(threads: int) -> float:
    """GFLOP/s of ``vdpbf16ps`` on ``threads`` threads at once (median of 5)."""
    mod = load_inline(
        "kvserve_dpbf16_peak",
        cpp_sources=_PEAK_SRC,
        functions=["dpbf16_peak"],
        extra_cflags=["-O2", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )
    torch.set_num_threads(threads)
    mod.dpbf16_peak(10_000_000)  # warm up (clock, thread pool)
    return statistics.median(mod.dpbf16_peak(50_000_000) for _ in range(5))


def _product(name: str, n: int, k: int, layers: int):
    """A callable running ``name`` on x with layer i's weights, of ``layers`` random ones
    packed on huge pages (gate/up: its SiLU kernel, which takes any packed [2I, K] weight
    as interleaved gate and up blocks; random values make the order moot)."""
    ws = [torch.randn(n, k, dtype=torch.bfloat16) for _ in range(layers)]
    packed = huge_arena([torch.ops.kvserve.bf16_pack_weight(w) for w in ws])
    if name == "gate_up":
        return lambda x, i: torch.ops.kvserve.bf16_linear_silu_mul(x, packed[i], None, n // 2)
    return lambda x, i: torch.ops.kvserve.bf16_linear(x, packed[i], None, n)


def efficiency(m: int, mode: str, peak_gflops: float, reps: int) -> dict[str, float]:
    """Each product's share of ``peak_gflops`` at M = m in ``mode`` (median of ``reps``
    timed calls, or rounds of 30 layers for ``dram``), and all four together."""
    junk = torch.ones(16 << 20, dtype=torch.int32) if mode == "evicted" else None
    out: dict[str, float] = {}
    flops = secs = 0.0
    for name, (n, k) in SHAPES.items():
        layers = LAYERS if mode == "dram" else 1
        run = _product(name, n, k, layers)
        x = torch.randn(m, k, dtype=torch.bfloat16)
        for i in range(layers):
            run(x, i)
        times = []
        for _ in range(reps):
            if junk is not None:
                junk.sum()
            t = time.perf_counter()
            for i in range(layers):
                run(x, i)
            times.append((time.perf_counter() - t) / layers)
        s = statistics.median(times)
        out[name] = 2 * m * n * k / s / 1e9 / peak_gflops
        flops, secs = flops + 2 * m * n * k, secs + s
    out["all"] = flops / secs / 1e9 / peak_gflops
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="32,64,512,2048", help="comma-separated M values")
    ap.add_argument("--reps", type=int, default=15, help="timed calls per median")
    ap.add_argument("--rounds", type=int, default=2, help="times the whole table is measured")
    ap.add_argument("--out", default="benchmarks/results/gemm_peak.json")
    a = ap.parse_args()
    if not (load_cpu_kernels() and torch.ops.kvserve.bf16_gemm_available()):
        raise SystemExit("gemm_peak: needs the CPU kernels built with AVX-512-BF16")
    all_threads = torch.get_num_threads()
    report: dict = {"threads": all_threads, "rounds": []}
    for r in range(a.rounds):
        this: dict = {"peak_gflops": {}, "rows": {}}
        report["rounds"].append(this)
        for threads in sorted({1, all_threads}):
            peak = dot_peak(threads)
            this["peak_gflops"][threads] = peak
            print(f"round {r}: vdpbf16ps peak, {threads} thread(s): {peak:.1f} GFLOP/s")
            for m in (int(v) for v in a.rows.split(",")):
                # decode sizes: weights from DRAM as in a decode step (30 layers in turn);
                # prefill sizes: x and weights from DRAM at each call's start
                modes = ("cache", "dram") if m <= 128 else ("cache", "evicted")
                for mode in modes:
                    eff = efficiency(m, mode, peak, a.reps)
                    this["rows"].setdefault(str(m), {}).setdefault(str(threads), {})[mode] = eff
                    parts = "  ".join(f"{k} {v * 100:5.1f}%" for k, v in eff.items())
                    print(f"M={m:5d} threads={threads} {mode:8s} {parts}")
        with open(a.out, "w") as f:  # every round as it ends
            json.dump(report, f, indent=1)
    torch.set_num_threads(all_threads)


if __name__ == "__main__":
    main()
