// bf16 GEMM on AMX tiles, for CPUs with AMX-BF16 (Sapphire Rapids and later): the same
// products as bf16_gemm.cpp (y = x @ W^T (+ bias), and the gate/up product with its SiLU
// epilogue), on the same packed weight.
//
// The packed layout [ceil(N/16)][K/2][16][2] is already AMX's B operand: 16 K pairs of one
// block are a 16-row x 64-byte tile at a stride of 64 bytes. A micro-kernel holds up to
// 32 rows x 2 blocks of float accumulators in four C tiles (tmm0-3: rows 0-15 and 16-31 of
// blocks 0 and 1), loads x into tmm4-5 and the weights into tmm6-7, and walks K 32 values
// (16 pairs) a step. Each accumulator takes the K pairs in order 0, 1, ..., K/2 - 1 and
// no value from another row, so a row is the same whatever M, the tile or the thread split
// (the contract of bf16_gemm.cpp; the two kernels need not agree with each other, and a
// process uses one of them for every product of a layer). A tile's epilogue (bias, bf16,
// SiLU) runs while the next tile's products are in flight (Pending). Tiles load x in place
// at its row stride: a copy into tile order first measured 6-10 % slower at M = 32-2048.
//
// Why our own and not oneDNN's AMX kernels: at decode sizes oneDNN's call costs ~20 us
// before it computes (121 calls a SmolLM2 step), and its products cannot fuse SiLU or run
// inside the C++ decoder stack (benchmarks/gemm_prepack.py compares the three).
#include <torch/extension.h>

#include <cstdint>
#include <cstring>

#include "amx_config.h"
#include "float_convert.h"
#include "gemm_items.h"
#include "silu16.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(KVSERVE_AVX512_BF16)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

using kvserve_amx::TileConfig;
using kvserve_gemm::Problem;

constexpr int kRowTile = 32;  // two A tiles of 16 rows
constexpr int kPanel = 2;     // two B tiles of one 16-column block each
// Rows that share one pass over a weight panel: 256 rows (x's 295 KB at K = 576 stays in
// L2) measured 5-10 % faster at M = 2048 than 128 and 64, and 512 much slower.
constexpr int kRowChunk = 256;

// The rows of the two A/C tile halves the loaded configuration has; -1: none loaded by
// this call on this thread (another library may have loaded its own in between calls).
thread_local int tl_config = -1;

// Loads the configuration for r0 + r1 rows (r0 in 1..16, r1 in 0..16) unless it is the
// one loaded.
inline void configure(int r0, int r1) {
  const int key = r0 * 64 + r1;
  if (key == tl_config) return;
  TileConfig cfg;
  for (int t : {0, 1, 4}) cfg.rows[t] = r0, cfg.colsb[t] = 64;
  if (r1 > 0)
    for (int t : {2, 3, 5}) cfg.rows[t] = r1, cfg.colsb[t] = 64;
  for (int t : {6, 7}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  kvserve_amx::load_config(cfg);
  tl_config = key;
}

// A tile's sums, stored out of the tile registers, waiting for their epilogue. It runs
// while the next tile's products are in flight (the tile registers are not renamed, so
// run in place it would hold the next tile's first product back by its whole length).
struct Pending {
  alignas(64) float acc[2][2][16][16];  // [row half][block][row][column]
  const uint16_t* a = nullptr;          // the tile's rows of x; nullptr: nothing pending
  uint16_t* c = nullptr;
  int64_t nb0 = 0;
  int rows = 0, nr = 0;
};

// The calling thread's two pending slots: the tile just stored and the one before it.
struct PendingSlots {
  Pending slot[2];
  int next = 0;  // the slot the next tile stores into
};
thread_local PendingSlots tl_pending;

// Writes the outputs of `e` and marks it done; no-op when nothing is pending. Row i of
// block j: the tiles' sum over the first 16 * (K / 32) K pairs, then the pairs past them
// (K % 32 != 0) with vdpbf16ps, in order, then the bias; bf16 out (with SILU: the tile's
// blocks are the gate and up halves of 16 outputs, written as bf16(bf16(silu(g)) * u)).
template <bool SILU>
void epilogue(const Problem& p, Pending& e) {
  if (e.a == nullptr) return;
  const int64_t bstride = p.k2 * 32;
  const int64_t tail0 = p.k2 / 16 * 16;
  auto sum = [&](int i, int j) {
    __m512 v = _mm512_load_ps(e.acc[i / 16][j][i % 16]);
    const uint16_t* b = p.w + (e.nb0 + j) * bstride;
    for (int64_t k = tail0; k < p.k2; ++k) {
      int32_t pair;
      std::memcpy(&pair, e.a + i * p.lda + 2 * k, sizeof(pair));
      v = _mm512_dpbf16_ps(v, (__m512bh)_mm512_set1_epi32(pair),
                           (__m512bh)_mm512_loadu_si512(b + k * 32));
    }
    return v;
  };
  if constexpr (SILU) {
    using kvserve_cpu::widen_bf16;
    const int64_t col = e.nb0 / 2 * 16;  // p.n (the SiLU output width) is a multiple of 16
    const __m512 bg = p.bias ? _mm512_loadu_ps(p.bias + e.nb0 * 16) : _mm512_setzero_ps();
    const __m512 bu = p.bias ? _mm512_loadu_ps(p.bias + e.nb0 * 16 + 16) : _mm512_setzero_ps();
    for (int i = 0; i < e.rows; ++i) {
      const __m512 g = p.bias ? _mm512_add_ps(sum(i, 0), bg) : sum(i, 0);
      const __m512 u = p.bias ? _mm512_add_ps(sum(i, 1), bu) : sum(i, 1);
      const __m512 prod = kvserve_cpu::silu_mul16(widen_bf16((__m256i)_mm512_cvtneps_pbh(g)),
                                                  widen_bf16((__m256i)_mm512_cvtneps_pbh(u)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(e.c + i * p.n + col),
                          (__m256i)_mm512_cvtneps_pbh(prod));
    }
  } else {
    // Row by row, both blocks in one 64-byte store: the rows of a tile lie a row of y
    // apart, often in the same few L1 sets, so a line must be written while it is there.
    const int64_t col = e.nb0 * 16, left = p.n - col;
    const __mmask32 m = left >= 32 ? ~__mmask32(0) : (__mmask32(1) << left) - 1;
    const __m512 b0 = p.bias ? _mm512_maskz_loadu_ps(__mmask16(m), p.bias + col)
                             : _mm512_setzero_ps();
    const __m512 b1 = p.bias && e.nr == 2
                          ? _mm512_maskz_loadu_ps(__mmask16(m >> 16), p.bias + col + 16)
                          : _mm512_setzero_ps();
    for (int i = 0; i < e.rows; ++i) {
      const __m512 v0 = _mm512_add_ps(sum(i, 0), b0);
      const __m512 v1 = e.nr == 2 ? _mm512_add_ps(sum(i, 1), b1) : _mm512_setzero_ps();
      const __m512i both = _mm512_inserti64x4(
          _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(v0)),
          (__m256i)_mm512_cvtneps_pbh(v1), 1);
      _mm512_mask_storeu_epi16(e.c + i * p.n + col, m, both);
    }
  }
  e.a = nullptr;
}

// Rows [0, r0 + r1) at `a` / `c` against blocks nb0 (and nb0 + 1 when NR = 2), K 32 values
// a step; stores the sums into the next pending slot, and runs the other slot's epilogue
// after the first step's products are issued.
// `pf` (or nullptr) is the next panel, prefetched into L2 a step of K at a time.
template <bool TWO, int NR, bool SILU>
void micro(const Problem& p, const uint16_t* a, int r0, int r1, uint16_t* c, int64_t nb0,
           const uint16_t* pf) {
  const int64_t bstride = p.k2 * 32;  // elements of one packed block
  const uint16_t* b0 = p.w + nb0 * bstride;
  const uint16_t* b1 = b0 + bstride;
  const int64_t astride = p.lda * 2;  // bytes between rows of x
  const uint16_t* a1 = a + 16 * p.lda;
  PendingSlots& ps = tl_pending;
  Pending& out = ps.slot[ps.next];
  Pending& prev = ps.slot[ps.next ^ 1];
  _tile_zero(0);
  if constexpr (NR == 2) _tile_zero(1);
  if constexpr (TWO) {
    _tile_zero(2);
    if constexpr (NR == 2) _tile_zero(3);
  }
  const int64_t steps = p.k2 / 16;
  for (int64_t kc = 0; kc < steps; ++kc) {
    if (pf != nullptr)
      for (int j = 0; j < kPanel; ++j)
        for (int l = 0; l < 16; ++l)
          _mm_prefetch(reinterpret_cast<const char*>(pf + j * bstride + kc * 512 + l * 32),
                       _MM_HINT_T1);
    _tile_loadd(4, a + kc * 32, astride);
    _tile_loadd(6, b0 + kc * 512, 64);
    if constexpr (NR == 2) _tile_loadd(7, b1 + kc * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NR == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (TWO) {
      _tile_loadd(5, a1 + kc * 32, astride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NR == 2) _tile_dpbf16ps(3, 5, 7);
    }
    if (kc == 0) epilogue<SILU>(p, prev);
  }
  epilogue<SILU>(p, prev);  // K < 32: no step ran it
  _tile_stored(0, out.acc[0][0], 64);
  if constexpr (NR == 2) _tile_stored(1, out.acc[0][1], 64);
  if constexpr (TWO) {
    _tile_stored(2, out.acc[1][0], 64);
    if constexpr (NR == 2) _tile_stored(3, out.acc[1][1], 64);
  }
  out.a = a, out.c = c, out.nb0 = nb0, out.rows = r0 + r1, out.nr = NR;
  ps.next ^= 1;
}

template <bool SILU>
void run_item(const Problem& p, int64_t nblocks, int64_t m0, int64_t m1, int64_t nb0) {
  const int nr = static_cast<int>(std::min<int64_t>(kPanel, nblocks - nb0));
  const uint16_t* next = nb0 + kPanel < nblocks ? p.w + (nb0 + kPanel) * p.k2 * 32 : nullptr;
  for (int64_t m = m0; m < m1; m += kRowTile) {
    const int rows = static_cast<int>(std::min<int64_t>(kRowTile, m1 - m));
    const int r0 = std::min(rows, 16), r1 = rows - r0;
    configure(r0, r1);
    const uint16_t* a = p.a + m * p.lda;
    uint16_t* c = p.c + m * p.n;
    const uint16_t* pf = m == m0 ? next : nullptr;  // the first tile prefetches the next panel
    if (SILU || nr == 2) {  // a SiLU panel is always one (gate, up) pair of blocks
      if (r1 > 0) micro<true, 2, SILU>(p, a, r0, r1, c, nb0, pf);
      else micro<false, 2, SILU>(p, a, r0, r1, c, nb0, pf);
    } else if constexpr (!SILU) {
      if (r1 > 0) micro<true, 1, false>(p, a, r0, r1, c, nb0, pf);
      else micro<false, 1, false>(p, a, r0, r1, c, nb0, pf);
    }
  }
}

// Every item of the product (kvserve_gemm::for_items); each thread writes its last tile,
// still pending, and releases the tiles when its items are done.
template <bool SILU>
void run_all(const Problem& p, int64_t m, int64_t nblocks) {
  kvserve_gemm::for_items<kPanel, kRowTile, kRowChunk>(
      m, nblocks,
      [&](int64_t m0, int64_t m1, int64_t nb0) { run_item<SILU>(p, nblocks, m0, m1, nb0); },
      [&] {
        PendingSlots& ps = tl_pending;
        epilogue<SILU>(p, ps.slot[ps.next ^ 1]);
        _tile_release();
        tl_config = -1;
      });
}

bool request_tile_state() {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace

namespace kvserve_amx {

bool built() { return true; }

bool ready() {
  static const bool granted = request_tile_state();
  return granted;
}

void run(const Problem& p, int64_t m, int64_t nblocks, bool silu) {
  if (silu) run_all<true>(p, m, nblocks);
  else run_all<false>(p, m, nblocks);
}

}  // namespace kvserve_amx

#else  // no AMX in this build

namespace kvserve_amx {
bool built() { return false; }
bool ready() { return false; }
void run(const kvserve_gemm::Problem&, int64_t, int64_t, bool) {
  TORCH_CHECK(false, "this build of the CPU kernels has no AMX");
}
}  // namespace kvserve_amx

#endif
