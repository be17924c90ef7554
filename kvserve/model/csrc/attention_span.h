// One span of paged attention over a tiled bf16 cache (kv_tiles.h): up to SPAN cells (16
// keys each, of one KV head) folded into the online-softmax state of a query row's G heads
// in a single update. Against one update per cell (attention_cell.h's fold_bf16), a span
// shares each broadcast of the query across SPAN cells, and the max, the exp's rescale of
// the accumulators and the horizontal reductions across 4x as many keys.
//
// Determinism rule (paged_attention.cpp): spans are aligned to absolute positions (span k
// holds positions [64k, 64k + 64)); a row folds, span after span in position order, the
// cells of each in which it sees some key, each key in the lane of its position % 16, with
// one non-inlined routine. Which cells and lanes it folds is a function of its position,
// window and sinks alone, so its result is the same for a decode token, a row of a prefill
// chunk of any split, and whichever rows share its call.
#pragma once

#include <cstdint>

#include "attention_cell.h"

namespace kvserve_cell {

constexpr int SPAN = 4;  // cells per update

#ifdef __AVX512BF16__
// NH heads of one query row against NC cells: q [NH][D / 2] bf16 pairs (unscaled), cell c's
// K tile kt[c] [D / 2][CELL] pairs and V tile vt[c] [CELL / 2][D] key pairs, its visible
// lanes mk[c] (not 0). Updates m, l [NH] and acc [NH][D].
template <int D, int NH, int NC>
inline void span_heads(const uint32_t* q, float scale, const uint32_t* const* kt,
                       const uint32_t* const* vt, const uint16_t* mk, float* m, float* l,
                       float* acc) {
  __m512 s[NH][NC];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < NC; ++c) s[h][c] = _mm512_setzero_ps();
  for (int j = 0; j < D / 2; ++j) {  // one chain per (head, cell), pairs in order
    __m512bh k[NC];
    for (int c = 0; c < NC; ++c) {
      __m512i x = _mm512_loadu_si512(kt[c] + j * CELL);
      // kept in a register: GCC would load it again for every head, and on Zen 4 the
      // loads, not the dot products, then bound the loop (701 against 406 cycles a span)
      __asm__("" : "+v"(x));
      k[c] = (__m512bh)x;
    }
    for (int h = 0; h < NH; ++h) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[h * (D / 2) + j]));
      for (int c = 0; c < NC; ++c) s[h][c] = _mm512_dpbf16_ps(s[h][c], qb, k[c]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale), neg = _mm512_set1_ps(NEG_BIG);
  alignas(64) float bm[16], corr[16];  // per head: the new running max, the rescale factor
  for (int h = 0; h < NH; ++h) {
    __m512 mx = neg;
    for (int c = 0; c < NC; ++c) {
      s[h][c] = _mm512_mask_mov_ps(neg, mk[c], _mm512_mul_ps(s[h][c], sc));
      mx = _mm512_max_ps(mx, s[h][c]);
    }
    bm[h] = std::max(m[h], _mm512_reduce_max_ps(mx));
    corr[h] = m[h] - bm[h];
  }
  // every head's factor by one vector exp (a libm call here would make the compiler spill
  // the live scores around it); exp16(0) is exactly 1, so a held max still skips the rescale
  const __mmask16 hm = static_cast<__mmask16>((1u << NH) - 1u);
  _mm512_mask_storeu_ps(corr, hm, exp16(_mm512_maskz_loadu_ps(hm, corr)));
  alignas(64) uint32_t p[NH][NC][CELL / 2];  // bf16 weights, lane pairs
  for (int h = 0; h < NH; ++h) {
    const __m512 bv = _mm512_set1_ps(bm[h]);
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < NC; ++c) {
      const __m512 e = _mm512_maskz_mov_ps(mk[c], exp16(_mm512_sub_ps(s[h][c], bv)));
      sum = _mm512_add_ps(sum, e);
      _mm256_store_si256(reinterpret_cast<__m256i*>(p[h][c]), (__m256i)_mm512_cvtneps_pbh(e));
    }
    l[h] = l[h] * corr[h] + _mm512_reduce_add_ps(sum);
    m[h] = bm[h];
  }
  __m512 a[NH][D / 16];
  load_rescaled<D, NH>(acc, corr, a);
  // Key pair j of cell c into the accumulators. A pair with a hidden key has that half
  // zeroed after the load, so what a tile holds there (another sequence's stale values,
  // even a NaN) never meets its 0 weight. (A masked load instead costs ~25 % of prefill
  // attention on Zen 4; zeroing in a register does not show.)
  for (int c = 0; c < NC; ++c)
    for (int j = 0; j < CELL / 2; ++j) {
      const unsigned bits = (mk[c] >> (2 * j)) & 3u;  // keys 2j (low half), 2j + 1 (high)
      if (!bits) continue;
      const __mmask32 keep = (bits & 1u ? 0x55555555u : 0u) | (bits & 2u ? 0xAAAAAAAAu : 0u);
      __m512bh w[NH];
      for (int h = 0; h < NH; ++h)
        w[h] = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[h][c][j]));
      for (int d = 0; d < D / 16; ++d) {
        const __m512i x = _mm512_loadu_si512(vt[c] + j * D + 16 * d);
        const __m512bh v = (__m512bh)_mm512_maskz_mov_epi16(keep, x);
        for (int h = 0; h < NH; ++h) a[h][d] = _mm512_dpbf16_ps(a[h][d], w[h], v);
      }
    }
  store_acc<D, NH>(a, acc);
}

// Fold nc (1..SPAN) cells of one KV head — K tiles kt, V tiles vt, visible lanes mk (not 0),
// in position order — into the online-softmax state of one query row's G heads: `q` [G][D / 2]
// bf16 pairs (unscaled; scaled after the dot products), running max `m`, sum `l`,
// accumulator `acc` [G][D]. Never inlined: every caller runs exactly this code.
template <int D>
__attribute__((noinline)) void fold_span(const uint32_t* q, int64_t G, float scale,
                                         const uint32_t* const* kt, const uint32_t* const* vt,
                                         const uint16_t* mk, int nc, float* m, float* l,
                                         float* acc) {
  by_heads<D>(G, [&](auto nh, int64_t g) {
    constexpr int NH = decltype(nh)::value;
    const uint32_t* qg = q + g * (D / 2);
    switch (nc) {
      case 1: return span_heads<D, NH, 1>(qg, scale, kt, vt, mk, m + g, l + g, acc + g * D);
      case 2: return span_heads<D, NH, 2>(qg, scale, kt, vt, mk, m + g, l + g, acc + g * D);
      case 3: return span_heads<D, NH, 3>(qg, scale, kt, vt, mk, m + g, l + g, acc + g * D);
      default: return span_heads<D, NH, SPAN>(qg, scale, kt, vt, mk, m + g, l + g, acc + g * D);
    }
  });
}
#endif

}  // namespace kvserve_cell
