"""What bounds the int8 AMX tiles: csrc/gguf_amx.cpp's loop rebuilt one piece at a time.

kvserve's int8 products on AMX-INT8 (``--quantization int8``, Q8_0) reach ~1.2-1.5 TOPS at
256 rows on the 2-core Xeon here, a fraction of what ``tdpbsud`` can do. Each step below adds
one part of the real kernel's work to a bare loop of four products on four C tiles, so the
step where the rate falls names what costs it:

1. ``registers``: the products alone, operands already in the tile registers (the peak).
2. ``l1``: each step loads its four operand tiles (two x, two weight) from one 4 KB spot.
3. ``l2``: the kernel's layout and order: x codes of 256 rows x K = 2,048 (strided by K),
   32 pairs of weight groups (K x 16 bytes each), 32-row passes, 64 K a step, and the C
   tiles stored and zeroed every 128 K (an activation block).
4. ``l2+float``: with each block's float steps as the kernel runs them (per row and group:
   the stored int32 sums, plus the row's -128 sx, converted, times dx, added into a float
   accumulator in memory), after the next block's products are issued.
5. ``l2+float first``: the same float steps before the next block's products are issued.
6. ``llc+float``: ``l2+float`` over 256 weight pairs (16 MB a thread) instead of 32 (2 MB):
   the weights come from the last-level cache, as a real layer's do.

Every mode runs on each of ``--threads`` threads at once (its own buffers); the figure is
ns per product per thread and TOPS over all threads (2 x 16 x 16 x 64 per product).
Needs AMX-INT8 (Sapphire Rapids or later) and a compiler with ``-mamx-int8``:

    python benchmarks/kernels/amx_int8_tiles.py --threads 2 \\
        --out benchmarks/results/amx_int8_tiles.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch
from torch.utils.cpp_extension import load_inline

MODES = ["registers", "l1", "l2", "l2+float", "l2+float first", "llc+float"]

SOURCE = r"""
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {
struct Config { uint8_t palette = 1, start = 0, pad[14] = {}; uint16_t colsb[16] = {};
                uint8_t rows[16] = {}; };
constexpr int kK = 2048, kM = 256, kBlocks = kK / 128;
struct alignas(64) Sums { int32_t v[2][2][16][16]; };

// Block B's float steps for 32 rows x 2 groups, as gguf_amx.cpp's finish runs them.
__attribute__((noinline)) void finish(const Sums& s, const float* dx, const int32_t* si,
                                      float (*acc)[32][16], bool first) {
  for (int r = 0; r < 32; ++r) {
    const __m512 d = _mm512_set1_ps(dx[r * kBlocks]);
    for (int j = 0; j < 2; ++j) {
      const __m512i isum = _mm512_load_si512(s.v[r >> 4][j][r & 15]);
      const __m512i c = _mm512_set1_epi32(si[r * kBlocks]);
      const __m512 t = _mm512_cvtepi32_ps(_mm512_add_epi32(isum, c));
      const __m512 before = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc[j][r]);
      _mm512_storeu_ps(acc[j][r], _mm512_fmadd_ps(t, d, before));
    }
  }
}

// One thread's run of `mode`: seconds into out[0], products into out[1].
void one(int mode, int reps, double* out) {
  const int kPairs = mode == 5 ? 256 : 32;
  if (mode == 5) reps = (reps + 7) / 8;  // about the same work as the others
  auto* x = static_cast<int8_t*>(std::aligned_alloc(4096, kM * kK));
  auto* w = static_cast<uint8_t*>(std::aligned_alloc(4096, 2 * kPairs * kK * 16));
  auto* dx = static_cast<float*>(std::aligned_alloc(64, kM * kBlocks * 4));
  auto* si = static_cast<int32_t*>(std::aligned_alloc(64, kM * kBlocks * 4));
  std::memset(x, 1, kM * kK);
  std::memset(w, 1, 2 * kPairs * kK * 16);
  for (int i = 0; i < kM * kBlocks; ++i) dx[i] = 1e-3f, si[i] = -5;
  alignas(64) float acc[2][32][16];
  Sums sums[2];
  Config cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  long products = 0;
  const auto t0 = std::chrono::steady_clock::now();
  if (mode <= 1) {
    _tile_loadd(4, x, 64); _tile_loadd(5, x, 64); _tile_loadd(6, w, 64); _tile_loadd(7, w, 64);
    const long steps = long(reps) * kPairs * (kM / 32) * (kK / 64);
    for (long i = 0; i < steps; ++i) {
      if (mode == 1) {
        _tile_loadd(4, x, 64); _tile_loadd(6, w, 64); _tile_loadd(7, w + 1024, 64);
        _tile_loadd(5, x + 1024, 64);
      }
      _tile_dpbsud(0, 4, 6); _tile_dpbsud(1, 4, 7); _tile_dpbsud(2, 5, 6); _tile_dpbsud(3, 5, 7);
    }
    products = 4 * steps;
  } else {
    for (int rep = 0; rep < reps; ++rep)
      for (int p = 0; p < kPairs; ++p) {
        const uint8_t* w0 = w + 2 * p * kK * 16;
        const uint8_t* w1 = w0 + kK * 16;
        for (int rt = 0; rt < kM / 32; ++rt) {
          const int8_t* x0 = x + rt * 32 * kK;
          const int8_t* x1 = x0 + 16 * kK;
          const float* dxr = dx + rt * 32 * kBlocks;
          const int32_t* sir = si + rt * 32 * kBlocks;
          auto issue = [&](int b) {
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int kk = b * 128; kk < b * 128 + 128; kk += 64) {
              _tile_loadd(4, x0 + kk, kK);
              _tile_loadd(6, w0 + kk * 16, 64);
              _tile_loadd(7, w1 + kk * 16, 64);
              _tile_dpbsud(0, 4, 6); _tile_dpbsud(1, 4, 7);
              _tile_loadd(5, x1 + kk, kK);
              _tile_dpbsud(2, 5, 6); _tile_dpbsud(3, 5, 7);
            }
            products += 8;
          };
          issue(0);
          for (int b = 0; b < kBlocks; ++b) {
            Sums& s = sums[b % 2];
            _tile_stored(0, s.v[0][0], 64); _tile_stored(1, s.v[0][1], 64);
            _tile_stored(2, s.v[1][0], 64); _tile_stored(3, s.v[1][1], 64);
            if (mode == 4) finish(s, dxr + b, sir + b, acc, b == 0);
            if (b + 1 < kBlocks) issue(b + 1);
            if (mode == 3 || mode == 5) finish(s, dxr + b, sir + b, acc, b == 0);
          }
        }
      }
  }
  out[0] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  out[1] = static_cast<double>(products);
  _tile_release();
  std::free(x), std::free(w), std::free(dx), std::free(si);
}
}  // namespace

// Runs `mode` on `threads` threads at once; returns [seconds, products] per thread.
std::vector<double> run(int64_t mode, int64_t threads, int64_t reps) {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  TORCH_CHECK(granted, "the kernel refused this process the AMX tile state");
  std::vector<double> out(2 * threads);
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t) pool.emplace_back(one, int(mode), int(reps), &out[2 * t]);
  for (auto& t : pool) t.join();
  return out;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=20, help="passes over the product per run")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each mode (median)")
    ap.add_argument("--out", default=None, help="write the results here as JSON")
    a = ap.parse_args()
    mod = load_inline(
        "kvserve_amx_int8_tiles",
        cpp_sources=SOURCE,
        functions=["run"],
        extra_cflags=["-O2", "-march=native", "-mamx-tile", "-mamx-int8"],
        verbose=False,
    )
    rows = []
    for mode, name in enumerate(MODES):
        ns, tops = [], []
        for _ in range(a.rounds):
            r = mod.run(mode, a.threads, a.reps)
            secs = [r[2 * t] for t in range(a.threads)]
            products = r[1]
            ns.append(statistics.mean(secs) / products * 1e9)
            tops.append(a.threads * products * 2 * 16 * 16 * 64 / max(secs) / 1e12)
        row = {"mode": name, "ns_per_product": round(statistics.median(ns), 2),
               "tops": round(statistics.median(tops), 2)}  # fmt: skip
        rows.append(row)
        print(f"{name:16s} {row['ns_per_product']:6.2f} ns a product a thread, "
              f"{row['tops']:6.2f} TOPS on {a.threads} threads")  # fmt: skip
    report = {"machine": platform.processor() or platform.machine(), "threads": a.threads,
              "k": 2048, "rows": 256, "results": rows}  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
