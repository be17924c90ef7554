// The AMX-INT8 tile of gguf_gemm.cpp's s8 and c8 kinds (the contract: gguf_amx.h).
//
// Tiles: tmm0-3 the int32 sums (rows 0-15 and 16-31 of x, against groups g and g + 1),
// tmm4-5 x's codes (rows 0-15, 16-31), tmm6-7 the two groups' weights. Per activation
// block (c8: 128 values where K allows, else 32; s8: 32) the C tiles start at zero, take
// the block's tdpbsud steps (64 K a step, or 32), and are stored; the block's float steps
// run while the next block's products are in flight (the tile registers are not renamed:
// run before them, they would hold those products back).
#include <torch/extension.h>

#include <atomic>

#include "amx_config.h"
#include "gemm_items.h"
#include "gguf_amx.h"
#include "gguf_c8.h"

namespace kvserve_gguf {
namespace {
std::atomic<bool> g_enabled{true};
}  // namespace

bool amx_int8_enable(bool enable) { return g_enabled.exchange(enable); }
}  // namespace kvserve_gguf

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(KVSERVE_GGUF_VNNI)
#include <immintrin.h>

namespace kvserve_gguf {
namespace {

// Rows of AMX's products from which it beats the VNNI tile (benchmarks/kernels/
// gguf_int8_rows.py on a 1B layer, Xeon AMX, ms, VNNI -> tiles): int8 at M = 1 1.42 ->
// 1.35, 4 2.22 -> 1.41, 32 8.5 -> 3.7; Q8_0 at M = 1 1.39 -> 1.40 (both at the memory
// floor), 2 1.52 -> 1.45, 8 2.95 -> 2.17, 32 10.9 -> 5.8.
constexpr int64_t kMinRows = 2;

// The configuration loaded on this thread: rows of the two halves and K bytes a step;
// -1: none (released, or never loaded).
thread_local int tl_config = -1;

void configure(int r0, int r1, int kb) {
  const int key = (r0 * 64 + r1) * 128 + kb;
  if (key == tl_config) return;
  kvserve_amx::TileConfig cfg;
  for (int t : {0, 1}) cfg.rows[t] = r0, cfg.colsb[t] = 64;
  cfg.rows[4] = r0, cfg.colsb[4] = kb;
  if (r1 > 0) {
    for (int t : {2, 3}) cfg.rows[t] = r1, cfg.colsb[t] = 64;
    cfg.rows[5] = r1, cfg.colsb[5] = kb;
  }
  for (int t : {6, 7}) cfg.rows[t] = kb / 4, cfg.colsb[t] = 64;
  kvserve_amx::load_config(cfg);
  tl_config = key;
}

// One block's int32 sums, out of the tiles: [half][group][row][output].
struct alignas(64) Sums {
  int32_t v[2][2][16][16];
};

template <int KIND, bool TWO, int NG>
void tile(const QAct& a, int64_t r0, int n0, int n1, const QWeight& w, int64_t g,
          float (*acc)[kAmxRows][16], const uint8_t* pf) {
  const int qbv = KIND == kC8 ? static_cast<int>(a.ab * kQB) : static_cast<int>(kQB);
  const int kb = qbv % 64 == 0 ? 64 : 32, steps = qbv / kb;
  const int64_t nab = a.nb * kQB / qbv;  // activation blocks a row
  const uint8_t* w0 = w.qs + g * a.nb * w.qbytes;
  const uint8_t* w1 = w0 + a.nb * w.qbytes;
  const int8_t* x0 = a.q + r0 * a.k;
  const int8_t* x1 = x0 + 16 * a.k;
  const int rows = n0 + n1;
  Sums sums[2];
  // the products of block B, into tmm0-3
  auto issue = [&](int64_t B) {
    _tile_zero(0);
    if constexpr (NG == 2) _tile_zero(1);
    if constexpr (TWO) {
      _tile_zero(2);
      if constexpr (NG == 2) _tile_zero(3);
    }
    for (int s = 0; s < steps; ++s) {
      const int64_t kk = B * qbv + s * kb;  // the weights' chunks of kk..: 16 bytes a K
      if (pf != nullptr)  // the same chunks of the next pair's two groups, into L2
        for (int64_t at = kk * 16; at < (kk + kb) * 16; at += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(pf + at), _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(pf + a.nb * w.qbytes + at), _MM_HINT_T1);
        }
      _tile_loadd(4, x0 + kk, a.k);
      _tile_loadd(6, w0 + kk * 16, 64);
      if constexpr (NG == 2) _tile_loadd(7, w1 + kk * 16, 64);
      _tile_dpbsud(0, 4, 6);
      if constexpr (NG == 2) _tile_dpbsud(1, 4, 7);
      if constexpr (TWO) {
        _tile_loadd(5, x1 + kk, a.k);
        _tile_dpbsud(2, 5, 6);
        if constexpr (NG == 2) _tile_dpbsud(3, 5, 7);
      }
    }
  };
  auto store = [&](Sums& s) {
    _tile_stored(0, s.v[0][0], 64);
    if constexpr (NG == 2) _tile_stored(1, s.v[0][1], 64);
    if constexpr (TWO) {
      _tile_stored(2, s.v[1][0], 64);
      if constexpr (NG == 2) _tile_stored(3, s.v[1][1], 64);
    }
  };
  // block B's float steps, the VNNI tile's (gguf_c8.h, gguf_tile_vnni.h): the accumulators
  // start at zero in the first block's FMA, and c8's take the row scale in the last's
  auto finish = [&](const Sums& s, int64_t B) {
    __m512 dw[NG];
    if constexpr (KIND == kS8)
      for (int j = 0; j < NG; ++j)
        dw[j] = _mm512_cvtph_ps(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(w.d + ((g + j) * a.nb + B) * 16)));
    else
      for (int j = 0; j < NG; ++j)
        dw[j] = _mm512_loadu_ps(reinterpret_cast<const float*>(w.d) + (g + j) * 16);
    const bool first = B == 0, last = B == nab - 1;
    for (int r = 0; r < rows; ++r) {
      const int h = r / 16, i = r % 16;
      const int64_t at = (r0 + r) * nab + B;
      const __m512 dx = _mm512_set1_ps(a.d[at]);
      for (int j = 0; j < NG; ++j) {
        const __m512i isum = _mm512_load_si512(s.v[h][j][i]);
        __m512 t;
        if constexpr (KIND == kC8) {
          t = _mm512_cvtepi32_ps(_mm512_add_epi32(isum, _mm512_set1_epi32(a.si[at])));
        } else {
          const __m512 sx = _mm512_set1_ps(a.s[at]);
          t = _mm512_mul_ps(dw[j], _mm512_sub_ps(_mm512_cvtepi32_ps(isum),
                                                 _mm512_mul_ps(_mm512_set1_ps(128.f), sx)));
        }
        const __m512 before = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc[j][r]);
        const __m512 sum = _mm512_fmadd_ps(t, dx, before);
        _mm512_storeu_ps(acc[j][r], KIND == kC8 && last ? _mm512_mul_ps(sum, dw[j]) : sum);
      }
    }
  };
  configure(n0, n1, kb);
  issue(0);
  for (int64_t B = 0; B < nab; ++B) {
    store(sums[B % 2]);
    if (B + 1 < nab) issue(B + 1);
    finish(sums[B % 2], B);
  }
}

template <int KIND>
void tile_kind(const QAct& a, int64_t r0, int rows, const QWeight& w, int64_t g, int ng,
               float (*acc)[kAmxRows][16], const uint8_t* pf) {
  const int n0 = std::min(rows, 16), n1 = rows - n0;
  if (n1 > 0) {
    if (ng == 2) tile<KIND, true, 2>(a, r0, n0, n1, w, g, acc, pf);
    else tile<KIND, true, 1>(a, r0, n0, n1, w, g, acc, pf);
  } else {
    if (ng == 2) tile<KIND, false, 2>(a, r0, n0, n1, w, g, acc, pf);
    else tile<KIND, false, 1>(a, r0, n0, n1, w, g, acc, pf);
  }
}

}  // namespace

bool amx_int8_ready() { return kvserve_amx::ready(); }

bool amx_int8_takes(int kind, int64_t m) {
  return (kind == kS8 || kind == kC8) && m >= kMinRows && g_enabled.load() && amx_int8_ready();
}

void tile_amx(int kind, const QAct& a, int64_t r0, int rows, const QWeight& w, int64_t g,
              int ng, float (*acc)[kAmxRows][16], const uint8_t* pf) {
  if (kind == kC8) tile_kind<kC8>(a, r0, rows, w, g, ng, acc, pf);
  else tile_kind<kS8>(a, r0, rows, w, g, ng, acc, pf);
}

void amx_release() {
  if (tl_config == -1) return;
  _tile_release();
  tl_config = -1;
}

}  // namespace kvserve_gguf

#else  // no AMX-INT8 in this build

namespace kvserve_gguf {
bool amx_int8_ready() { return false; }
bool amx_int8_takes(int, int64_t) { return false; }
void tile_amx(int, const QAct&, int64_t, int, const QWeight&, int64_t, int,
              float (*)[kAmxRows][16], const uint8_t*) {
  TORCH_CHECK(false, "this build of the CPU kernels has no AMX-INT8");
}
void amx_release() {}
}  // namespace kvserve_gguf

#endif
