// Paged attention over a tiled bf16 cache on AMX tiles (CPUs with AMX-BF16): the tiled
// kernel's work items, spans and prefetch (paged_attention_tiles.cpp, paged_items.h), with
// a span's two products on the tile unit instead of vdpbf16ps.
//
// Per KV head, an item's query rows become "A rows", one per (row, query head of the
// group), and up to 16 A rows share each product. For a span of 4 cells (64 positions):
//  - scores: C[a][key] = q_a . k_key, one 16 x 16 C tile per cell. A K tile
//    ([D / 2][16][2], kv_tiles.h) is already AMX's B operand and is read in place;
//  - softmax (AVX-512): each A row's visible lanes, running max and sum, and its weights
//    rounded to bf16 into P [a][64 keys];
//  - P.V: the span's V tiles copied into one [32 key pairs][D][2] buffer (AMX's B layout
//    over 32 keys). Lanes that no row of the item sees are zeroed there, so another
//    sequence's stale values (even NaN) never meet a 0 weight. Then acc = acc * corr + P.V.
//
// Determinism (the rule of attention_span.h): a key sits at index position - 64 * span of
// its span's 64 keys in both products, whatever the item; a row's softmax reads its own
// lanes only; and AMX computes each output from its own A row alone, over K in a fixed
// order. A key the row does not see has weight 0, an exact zero in its sums when its value
// is finite, and a step whose keys are all hidden from a tile's rows adds nothing when
// skipped. So a row's bits do not depend on the batch, the chunking or which A tile it
// lands in. Contract: the values at positions some row of the item sees are finite, as the
// model writes them (lanes no row sees are zeroed in the copy, and a window frees only
// positions no later row sees). An inf or NaN there, from a model that overflowed, would
// reach the item's rows that do not see it too, where the AVX-512 spans zero it per row.
// This kernel and the AVX-512 spans are not bitwise equal to each other: a process uses
// one of them for every row (attention_use_amx switches it, for tests).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "amx_config.h"
#include "attention_span.h"
#include "gemm_items.h"
#include "kv_tiles.h"
#include "paged_items.h"
#include "tiled_rows.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define KVSERVE_AMX_ATTENTION 1
#include <immintrin.h>
#endif

namespace kvserve_tiles {

namespace {
// Whether bf16 tiles go to this kernel where it can run; tests turn it off to check the
// AVX-512 spans on an AMX machine.
std::atomic<bool> g_use_amx{true};
}  // namespace

bool attention_amx_usable() {
#ifdef KVSERVE_AMX_ATTENTION
  return g_use_amx.load() && kvserve_amx::ready();
#else
  return false;
#endif
}

#ifdef KVSERVE_AMX_ATTENTION
namespace {

using kvserve_cell::CELL;
using kvserve_cell::NEG_BIG;
using kvserve_cell::SPAN;
using kvserve_items::Item;
constexpr int KEYS = SPAN * CELL;  // keys of a span: 64, two K steps of 32
constexpr int AT = 16;             // A rows per tile

// Tiles: C 0-3 (scores of a cell, then P.V of 16 dimensions), A 4 and 6 (q or P), B 5 and
// 7 (K or V).
// The rows of the loaded configuration; -1: none loaded by this call on this thread.
thread_local int tl_rows = -1;

inline void configure(int rows) {
  if (rows == tl_rows) return;
  kvserve_amx::TileConfig cfg;
  for (int t : {0, 1, 2, 3, 4, 6}) cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = 64;
  cfg.rows[5] = cfg.rows[7] = 16, cfg.colsb[5] = cfg.colsb[7] = 64;
  kvserve_amx::load_config(cfg);
  tl_rows = rows;
}

// Tile operations, one function per register (GCC's _tile_* macros take the register
// number as a literal). The A and B operands alternate between two registers each (A 4/6,
// B 5/7): tile registers are not renamed, so a load into the register a product still
// reads would wait for it.
template <int T> void c_zero();
template <int T> void c_store(void* p, int stride);
template <int R> void t_load(const void* p, int stride);
template <int T, int A, int B> void c_dot();
#define KVSERVE_C_TILE(t)                                                                  \
  template <> inline void c_zero<t>() { _tile_zero(t); }                                   \
  template <> inline void c_store<t>(void* p, int stride) { _tile_stored(t, p, stride); }  \
  template <> inline void c_dot<t, 4, 5>() { _tile_dpbf16ps(t, 4, 5); }                    \
  template <> inline void c_dot<t, 4, 7>() { _tile_dpbf16ps(t, 4, 7); }                    \
  template <> inline void c_dot<t, 6, 5>() { _tile_dpbf16ps(t, 6, 5); }                    \
  template <> inline void c_dot<t, 6, 7>() { _tile_dpbf16ps(t, 6, 7); }
KVSERVE_C_TILE(0)
KVSERVE_C_TILE(1)
KVSERVE_C_TILE(2)
KVSERVE_C_TILE(3)
#undef KVSERVE_C_TILE
#define KVSERVE_LOAD_TILE(r) \
  template <> inline void t_load<r>(const void* p, int stride) { _tile_loadd(r, p, stride); }
KVSERVE_LOAD_TILE(4)
KVSERVE_LOAD_TILE(5)
KVSERVE_LOAD_TILE(6)
KVSERVE_LOAD_TILE(7)
#undef KVSERVE_LOAD_TILE

// f(integral_constant<int, t>) for each bit t (< 4) set in `mask`: tile registers are
// immediates.
template <typename F>
inline void each_tile(unsigned mask, F&& f) {
  if (mask & 1u) f(std::integral_constant<int, 0>{});
  if (mask & 2u) f(std::integral_constant<int, 1>{});
  if (mask & 4u) f(std::integral_constant<int, 2>{});
  if (mask & 8u) f(std::integral_constant<int, 3>{});
}

template <int D>
struct Scratch {  // one thread's buffers for one A tile of one span
  alignas(64) float s[AT][KEYS];           // scores
  alignas(64) uint16_t p[AT][KEYS];        // bf16 weights
  alignas(64) float pv[AT][D];             // P.V
  alignas(64) uint16_t v[KEYS / 2][D][2];  // the span's V, key pairs
  alignas(64) float bm[AT], corr[AT];      // new running max, rescale factor
};

// The span's V tiles of one head into s.v: cell i (vt[i], or nullptr) with the lanes of
// `uni[i]` (those some row of the item sees) kept, the others zeroed. A cell no row sees
// is zeroed when the other cell of its K step is read, and left alone otherwise. Issues
// SPAN of `tr`'s prefetch steps on the way.
template <int D>
void fill_v(const uint16_t* const* vt, const uint16_t* uni, Scratch<D>& s,
            kvserve_items::Trickle& tr) {
  for (int i = 0; i < SPAN; ++i) {
    tr.step();
    uint16_t* dst = &s.v[i * CELL / 2][0][0];
    if (!uni[i]) {
      if (uni[i ^ 1]) std::memset(dst, 0, CELL * D * sizeof(uint16_t));
      continue;
    }
    if (uni[i] == 0xFFFF) {
      std::memcpy(dst, vt[i], CELL * D * sizeof(uint16_t));
      continue;
    }
    for (int j = 0; j < CELL / 2; ++j) {  // key pair j: keys 2j (low half), 2j + 1 (high)
      const unsigned bits = (uni[i] >> (2 * j)) & 3u;
      const __mmask32 keep = (bits & 1u ? 0x55555555u : 0u) | (bits & 2u ? 0xAAAAAAAAu : 0u);
      for (int d = 0; d < 2 * D; d += 32)
        _mm512_storeu_si512(dst + j * 2 * D + d,
                            _mm512_maskz_mov_epi16(keep, _mm512_loadu_si512(vt[i] + j * 2 * D + d)));
    }
  }
}

// One A tile (A rows [0, n) at `qa`, [n][D] bf16; row a's visible lanes of the span's
// cells mk[a][0..3]) against the span of one head: K tiles kt[i] (cell i, or nullptr),
// V in s.v (fill_v). Updates the rows' running max m, sum l and accumulators acc [n][D];
// a row that sees no key of the span is left as it is. Issues up to a_steps<D>() of `tr`'s
// prefetch steps on the way (they move lines into the cache, never a value). Never
// inlined: every caller runs exactly this code (the rule of attention_span.h).
template <int D>
__attribute__((noinline)) void a_tile(const uint16_t* qa, int n, const uint16_t (*mk)[SPAN],
                                      const uint16_t* const* kt, float scale, Scratch<D>& s,
                                      kvserve_items::Trickle& tr, float* m, float* l,
                                      float* acc) {
  unsigned cells = 0;  // the cells some row of the tile sees
  for (int a = 0; a < n; ++a)
    for (int i = 0; i < SPAN; ++i) cells |= mk[a][i] ? 1u << i : 0u;
  if (!cells) return;
  configure(n);
  each_tile(cells, [&](auto t) { c_zero<decltype(t)::value>(); });
  const auto score_step = [&](int ks, auto a_reg) {  // K pairs [16 ks, 16 ks + 16)
    constexpr int A = decltype(a_reg)::value;
    tr.step();
    t_load<A>(qa + ks * 32, D * 2);
    each_tile(cells, [&](auto t) {
      constexpr int T = decltype(t)::value, B = T % 2 ? 7 : 5;
      t_load<B>(kt[T] + ks * 16 * 32, 64);
      c_dot<T, A, B>();
    });
  };
  for (int ks = 0; ks < D / 32; ks += 2) {
    score_step(ks, std::integral_constant<int, 4>{});
    if (ks + 1 < D / 32) score_step(ks + 1, std::integral_constant<int, 6>{});
  }
  each_tile(cells, [&](auto t) {
    constexpr int T = decltype(t)::value;
    c_store<T>(&s.s[0][T * CELL], KEYS * 4);
  });
  const __m512 sc = _mm512_set1_ps(scale), neg = _mm512_set1_ps(NEG_BIG);
  bool seen[AT];  // whether row a sees a key of the span
  for (int a = 0; a < n; ++a) {
    __m512 mx = neg;
    seen[a] = false;
    for (int i = 0; i < SPAN; ++i) {
      if (!mk[a][i]) continue;
      seen[a] = true;
      const __m512 x =
          _mm512_mask_mov_ps(neg, mk[a][i], _mm512_mul_ps(_mm512_loadu_ps(&s.s[a][i * CELL]), sc));
      _mm512_storeu_ps(&s.s[a][i * CELL], x);
      mx = _mm512_max_ps(mx, x);
    }
    s.bm[a] = std::max(m[a], _mm512_reduce_max_ps(mx));
    s.corr[a] = m[a] - s.bm[a];
  }
  tr.step();
  const __mmask16 rows = static_cast<__mmask16>((1u << n) - 1u);
  _mm512_mask_storeu_ps(s.corr, rows, kvserve_cell::exp16(_mm512_maskz_loadu_ps(rows, s.corr)));
  for (int a = 0; a < n; ++a) {
    const __m512 bv = _mm512_set1_ps(s.bm[a]);
    __m512 sum = _mm512_setzero_ps();
    for (int i = 0; i < SPAN; ++i) {
      __m256i w = _mm256_setzero_si256();
      if (mk[a][i]) {
        const __m512 x = _mm512_loadu_ps(&s.s[a][i * CELL]);
        const __m512 e = _mm512_maskz_mov_ps(mk[a][i], kvserve_cell::exp16(_mm512_sub_ps(x, bv)));
        sum = _mm512_add_ps(sum, e);
        w = (__m256i)_mm512_cvtneps_pbh(e);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&s.p[a][i * CELL]), w);
    }
    if (!seen[a]) continue;
    l[a] = l[a] * s.corr[a] + _mm512_reduce_add_ps(sum);
    m[a] = s.bm[a];
  }
  const unsigned steps = (cells & 3u ? 1u : 0u) | (cells & 12u ? 2u : 0u);  // K steps of P.V
  for (int dg = 0; dg < D / 16; dg += 4) {
    const unsigned group = D / 16 - dg >= 4 ? 15u : (1u << (D / 16 - dg)) - 1u;
    each_tile(group, [&](auto t) { c_zero<decltype(t)::value>(); });
    const auto pv_step = [&](int ks, auto a_reg) {  // keys [32 ks, 32 ks + 32)
      constexpr int A = decltype(a_reg)::value;
      if (!(steps >> ks & 1u)) return;
      tr.step();
      t_load<A>(&s.p[0][ks * 32], KEYS * 2);
      each_tile(group, [&](auto t) {
        constexpr int T = decltype(t)::value, B = T % 2 ? 7 : 5;
        t_load<B>(&s.v[ks * 16][(dg + T) * 16][0], D * 4);
        c_dot<T, A, B>();
      });
    };
    pv_step(0, std::integral_constant<int, 4>{});
    pv_step(1, std::integral_constant<int, 6>{});
    each_tile(group, [&](auto t) {
      constexpr int T = decltype(t)::value;
      c_store<T>(&s.pv[0][(dg + T) * 16], D * 4);
    });
  }
  for (int a = 0; a < n; ++a) {
    if (!seen[a]) continue;
    const __m512 cv = _mm512_set1_ps(s.corr[a]);
    float* ar = acc + a * D;
    for (int d = 0; d < D; d += 16)
      _mm512_storeu_ps(ar + d, _mm512_fmadd_ps(_mm512_loadu_ps(ar + d), cv,
                                               _mm512_loadu_ps(&s.pv[a][d])));
  }
}

// How many prefetch steps a_tile issues at most: one per K step of the scores, one after
// them, one per K step of P.V for each group of 4 C tiles.
template <int D>
constexpr int64_t a_steps() {
  return D / 32 + 1 + 2 * ((D / 16 + 3) / 4);
}

template <int D>
void amx_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& query_start,
                at::Tensor& out, double scale, int64_t window, int64_t sinks,
                const float* sink_logits) {
  // rows per item: 32 for G = 3 (6 A tiles per copy of a span's V), up to 128 for G = 1.
  // Against 16 rows for G = 3, prefill attention 8 x 256 tokens took 0.92x the time; 64
  // rows gave the same as 32.
  const int64_t G = q.size(1) / k_cache.size(2);
  const TiledCall call(q, k_cache, v_cache, tables, lens, query_start, out,
                       16 * std::max<int64_t>(1, 8 / G), window, sinks, sink_logits);
  std::atomic<int64_t> counter{0};
  const float sc = static_cast<float>(scale);

#pragma omp parallel num_threads(call.threads)
  {
    ItemRows rows(call);
    const int64_t AR = rows.per_head;  // A rows per KV head
    std::vector<uint16_t> mk(AR * SPAN);  // per A row: its lanes of the span's cells
    auto scratch = std::make_unique<Scratch<D>>();
    kvserve_items::Claims claims(call.items, counter, call.lines);
    kvserve_items::Trickle trickle;
    while (const Item* it = claims.next()) {
      const Item& item = *it;
      const int64_t s = item.seq, nr = item.r1 - item.r0, h0 = item.h0, h1 = item.h1;
      const int64_t na = nr * G, c0 = item.lo / CELL, c1 = (item.hi - 1) / CELL;
      rows.begin(call, item);
      for (int64_t span = c0 / SPAN; span <= c1 / SPAN; ++span) {
        trickle.reset();
        const int64_t ca = std::max(span * SPAN, c0), cb = std::min(span * SPAN + SPAN - 1, c1);
        const uint16_t* kt[SPAN] = {};  // the span's tiles (all heads), by cell
        const uint16_t* vt[SPAN] = {};
        uint16_t uni[SPAN] = {};  // the lanes some row of the item sees
        for (int64_t c = ca; c <= cb; ++c) {
          const int64_t i = c - span * SPAN, slot = call.slot(s, c);
          kt[i] = call.k_at<uint16_t>(slot);
          vt[i] = call.v_at<uint16_t>(slot);
          trickle.add(claims.ahead(c - c0));
        }
        for (int64_t r = 0; r < nr; ++r)
          for (int i = 0; i < SPAN; ++i) {
            const int64_t c = span * SPAN + i;
            const uint16_t lanes =
                c >= ca && c <= cb ? kvserve_items::row_lanes(rows.vis[r], c * CELL) : 0;
            for (int64_t g = 0; g < G; ++g) mk[(r * G + g) * SPAN + i] = lanes;
            uni[i] |= lanes;
          }
        if (nr > 1) trickle.drain();
        else trickle.pace((h1 - h0) * (SPAN + (na + AT - 1) / AT * a_steps<D>()));
        for (int64_t h = h0; h < h1; ++h) {
          const uint16_t* kh[SPAN];
          const uint16_t* vh[SPAN];
          for (int i = 0; i < SPAN; ++i) {
            kh[i] = kt[i] ? kt[i] + h * CELL * D : nullptr;
            vh[i] = vt[i] ? vt[i] + h * CELL * D : nullptr;
          }
          fill_v<D>(vh, uni, *scratch, trickle);
          for (int64_t a0 = 0; a0 < na; a0 += AT) {
            const int an = static_cast<int>(std::min<int64_t>(AT, na - a0));
            const int64_t ai = h * AR + a0;
            a_tile<D>(rows.q.data() + ai * D, an,
                      reinterpret_cast<const uint16_t(*)[SPAN]>(mk.data() + a0 * SPAN), kh, sc,
                      *scratch, trickle, rows.m.data() + ai, rows.l.data() + ai,
                      rows.acc.data() + ai * D);
          }
        }
        trickle.drain();
      }
      rows.finish(call, item);
    }
    _tile_release();
    tl_rows = -1;
  }
}

}  // namespace
#endif

void attention_tiles_amx(const at::Tensor& q, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& tables,
                         const at::Tensor& lens, const at::Tensor& query_start, at::Tensor& out,
                         double scale, int64_t window, int64_t sinks,
                         const float* sink_logits) {
  TORCH_CHECK(attention_amx_usable(), "paged_attention: the AMX kernel cannot run here");
#ifdef KVSERVE_AMX_ATTENTION
#define KVSERVE_AMX_D(d)                                                                   \
  case d:                                                                                  \
    return amx_kernel<d>(q, k_cache, v_cache, tables, lens, query_start, out, scale, window, \
                         sinks, sink_logits);
  switch (q.size(2)) {
    KVSERVE_AMX_D(32)
    KVSERVE_AMX_D(64)
    KVSERVE_AMX_D(96)
    KVSERVE_AMX_D(128)
    KVSERVE_AMX_D(256)
    default: break;
  }
#undef KVSERVE_AMX_D
#endif
  TORCH_CHECK(false, "paged_attention: no AMX kernel for head_dim ", q.size(2));
}

}  // namespace kvserve_tiles

namespace {

// Sets whether bf16 tiles may take the AMX kernel; returns the previous setting. The two
// kernels differ in last bits, so a switch while an engine runs breaks its batch invariance.
bool attention_use_amx(bool enable) { return kvserve_tiles::g_use_amx.exchange(enable); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("attention_use_amx(bool enable) -> bool", &attention_use_amx);
  m.def("attention_amx() -> bool", &kvserve_tiles::attention_amx_usable);
}
