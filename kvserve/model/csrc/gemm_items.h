// What kvserve's two bf16 GEMMs share (bf16_gemm.cpp: AVX-512-BF16 dot products;
// bf16_gemm_amx.cpp: AMX tiles): the problem they compute and its split into work items.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace kvserve_gemm {

// y[M, n] = x[M, K] @ W[n, K]^T (+ bias), bf16 out; W packed as [ceil(n/16)][K/2][16][2]
// (bf16_pack_weight). With the SiLU epilogue, W holds gate and up blocks interleaved and
// n is the SiLU output width (half the packed columns).
struct Problem {
  const uint16_t* a;  // x, row stride lda
  int64_t lda;
  const uint16_t* w;  // packed weight
  int64_t k2;         // K / 2
  uint16_t* c;        // out, row stride n
  int64_t n;
  const float* bias;  // nullptr or float32 bias in the packed column order
};

// Products of up to this many chunks of RC rows count as decode-sized (see for_items).
constexpr int64_t kFewChunks = 4;

// Calls item(m0, m1, nb0) for every item of an m-row product over nblocks blocks of 16
// columns: rows [m0, m1) against the panel of blocks [nb0, nb0 + NP) (fewer at the end).
// Each item runs whole on one thread, so neither the order nor the chunking changes a
// result; each thread calls done() after its last item.
// - A product of up to kFewChunks chunks of RC rows (decode sizes) cuts its rows into
//   near-equal chunks of whole RT tiles and orders its items panel-major: a panel's
//   weights, read from DRAM once, serve every chunk from cache. Larger products keep
//   chunks of RC rows, chunk-major, so consecutive items share rows of x in cache.
// - Each thread takes a contiguous run of items holding its share of the rows x panels,
//   not of the item count: items differ in rows where the last chunk is partial. (Split
//   by count, chunk-major, M = 64 rows of the SiLU product, chunks 60 + 4, gave one thread
//   the 60 rows: 3.5x the time of 32 rows; M = 2048, 34 chunks of 60 and one of 8, gave
//   one thread 5 % more rows than the other.)
template <int NP, int RT, int RC, class Item, class Done>
void for_items(int64_t m, int64_t nblocks, const Item& item, const Done& done) {
  const int64_t panels = (nblocks + NP - 1) / NP;
  const int64_t rc_chunks = (m + RC - 1) / RC;  // chunks of RC rows
  const bool few = rc_chunks <= kFewChunks;
  // few: near-equal chunks of whole tiles
  const int64_t rc = few ? ((m + rc_chunks - 1) / rc_chunks + RT - 1) / RT * RT : RC;
  const int64_t chunks = (m + rc - 1) / rc, items = chunks * panels;
  auto chunk_of = [&](int64_t i) { return few ? i % chunks : i / panels; };
  auto panel_of = [&](int64_t i) { return few ? i / chunks : i % panels; };
  // rows x panels before item i (the last panel counts whole: it is at most NP - 1
  // blocks short, on every chunk alike)
  auto before = [&](int64_t i) -> int64_t {  // i < items
    const int64_t c = chunk_of(i), q = panel_of(i);
    return few ? q * m + c * rc : c * rc * panels + std::min(rc, m - c * rc) * q;
  };
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  // the first item at or past thread t's share of the work
  auto first_of = [&](int64_t t) {
    int64_t lo = 0, hi = items;  // before() is non-decreasing in i
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (before(mid) * threads >= t * m * panels) hi = mid;
      else lo = mid + 1;
    }
    return lo;
  };
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t i = first_of(t0), end = first_of(t1); i < end; ++i) {
      const int64_t m0 = chunk_of(i) * rc;
      item(m0, std::min(m, m0 + rc), panel_of(i) * NP);
    }
    done();
  });
}

}  // namespace kvserve_gemm

namespace kvserve_amx {

// True when this build has AMX-BF16 and the kernel granted this process the tile state
// (asked once, on the first call). False otherwise: the AVX-512-BF16 kernel runs.
bool ready();

// True when this build has the AMX kernel (whether or not the kernel granted the state).
bool built();

// The product `p` of m rows over nblocks packed blocks with AMX tiles (with the SiLU
// epilogue when `silu`: nblocks counts gate and up blocks). Needs ready().
// Same contract as bf16_gemm.cpp's kernel: each output is one float accumulator over the
// K pairs in order, whatever m or the split, so a row never depends on the others.
void run(const kvserve_gemm::Problem& p, int64_t m, int64_t nblocks, bool silu);

}  // namespace kvserve_amx
