// One span of paged attention over a tiled cache (kv_tiles.h; bf16, or 8-bit codes): up to
// SPAN cells (16 keys each, of one KV head) folded into the online-softmax state of a query
// row's G heads in a single update. Against one update per cell (attention_cell.h's
// fold_bf16), a span shares each broadcast of the query across SPAN cells, and the max, the
// exp's rescale of the accumulators and the horizontal reductions across 4x as many keys.
//
// Determinism rule (paged_attention.cpp): spans are aligned to absolute positions (span k
// holds positions [64k, 64k + 64)); a row folds, span after span in position order, the
// cells of each in which it sees some key, each key in the lane of its position % 16, with
// one non-inlined routine. Which cells and lanes it folds is a function of its position,
// window and sinks alone, so its result is the same for a decode token, a row of a prefill
// chunk of any split, and whichever rows share its call.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#include "attention_cell.h"
#include "kv_codes.h"
#include "paged_items.h"

namespace kvserve_cell {

constexpr int SPAN = 4;  // cells per update

#ifdef __AVX512BF16__
// 32 elements of a tile as bf16 bits: a bf16 cache's as they are, 8-bit codes converted
// exactly (kv_codes.h).
template <typename CT>
inline __m512i tile32(const CT* p) {
  if constexpr (std::is_same_v<CT, c10::BFloat16>) return _mm512_loadu_si512(p);
  else return kvserve_codes::codes32(p);
}

// Whether CT's tiles are converted 64 codes at a time (kv_codes.h's fp8_codes64).
template <typename CT>
constexpr bool fp8_pairs() {
#ifdef __AVX512VBMI__
  return std::is_same_v<CT, c10::Float8_e4m3fn> || std::is_same_v<CT, c10::Float8_e5m2>;
#else
  return false;
#endif
}

// A cell's float16 scales of one head (16 lanes) as floats.
inline __m512 lane_scales(const c10::Half* s) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
}

// NH heads of one query row against NC cells: q [NH][D / 2] bf16 pairs (unscaled), cell c's
// K tile kt[c] [D / 2][CELL] pairs and V tile vt[c] [CELL / 2][D] key pairs of CT elements
// (bf16, or 8-bit codes with their lanes' float16 scales ks[c], vs[c]: a key's score is
// its codes' dot product times its K scale, its weight in P·V times its V scale), visible
// lanes mk[c] (not 0). Updates m, l [NH] and acc [NH][D], and issues some of `trickle`'s
// prefetches: one step() per K pair of the scores and per key pair of P·V (they move
// lines into the cache, never a value; span_steps counts them). `scaled`: whether the elements
// carry the lanes' scales (8-bit codes; also bf16 tiles converted from them, which give
// the same arithmetic bit for bit). `cap` > 0 soft-caps the scaled scores (softcap16).
template <int D, int NH, int NC, typename CT, bool scaled>
inline void span_heads(const uint32_t* q, float scale, float cap, const CT* const* kt, const CT* const* vt,
                       const c10::Half* const* ks, const c10::Half* const* vs,
                       const uint16_t* mk, kvserve_items::Trickle& trickle, float* m, float* l,
                       float* acc) {
  kvserve_items::Trickle tr = trickle;  // a local copy: its state can stay in registers
  __m512 s[NH][NC];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < NC; ++c) s[h][c] = _mm512_setzero_ps();
  // pair j of every head's query against the cells' K pair j: one chain per (head, cell),
  // pairs in order
  const auto score_pair = [&](int j, const __m512bh* k) {
    tr.step();
    for (int h = 0; h < NH; ++h) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[h * (D / 2) + j]));
      for (int c = 0; c < NC; ++c) s[h][c] = _mm512_dpbf16_ps(s[h][c], qb, k[c]);
    }
  };
  if constexpr (fp8_pairs<CT>()) {  // two pairs' codes converted at once
#ifdef __AVX512VBMI__
    static_assert(D % 32 == 0, "fp8 pairs: 64 codes are two K pairs, or two 32-wide V groups");
    for (int j = 0; j < D / 2; j += 2) {
      __m512bh k0[NC], k1[NC];
      for (int c = 0; c < NC; ++c) {
        __m512i x0, x1;
        kvserve_codes::fp8_codes64(kt[c] + j * 2 * CELL, x0, x1);
        k0[c] = (__m512bh)x0;
        k1[c] = (__m512bh)x1;
      }
      score_pair(j, k0);
      score_pair(j + 1, k1);
    }
#endif
  } else {
    for (int j = 0; j < D / 2; ++j) {
      __m512bh k[NC];
      for (int c = 0; c < NC; ++c) {
        __m512i x = tile32(kt[c] + j * 2 * CELL);
        // kept in a register: GCC would load it again for every head, and on Zen 4 the
        // loads, not the dot products, then bound the loop (701 against 406 cycles a span)
        __asm__("" : "+v"(x));
        k[c] = (__m512bh)x;
      }
      score_pair(j, k);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale), neg = _mm512_set1_ps(NEG_BIG);
  __m512 kf[NC], vf[NC];  // per cell: the scores' factor, the weights' (8-bit: per lane)
  for (int c = 0; c < NC; ++c) {
    kf[c] = scaled ? _mm512_mul_ps(sc, lane_scales(ks[c])) : sc;
    vf[c] = scaled ? lane_scales(vs[c]) : _mm512_setzero_ps();
  }
  alignas(64) float bm[16], corr[16];  // per head: the new running max, the rescale factor
  for (int h = 0; h < NH; ++h) {
    __m512 mx = neg;
    for (int c = 0; c < NC; ++c) {
      const __m512 x = _mm512_mul_ps(s[h][c], kf[c]);
      s[h][c] = _mm512_mask_mov_ps(neg, mk[c], cap > 0.f ? softcap16(x, cap) : x);
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
      // hidden lanes stay 0 (their stale scales may be anything, even NaN)
      const __m512 w = scaled ? _mm512_maskz_mul_ps(mk[c], e, vf[c]) : e;
      _mm256_store_si256(reinterpret_cast<__m256i*>(p[h][c]), (__m256i)_mm512_cvtneps_pbh(w));
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
      tr.step();
      const unsigned bits = (mk[c] >> (2 * j)) & 3u;  // keys 2j (low half), 2j + 1 (high)
      if (!bits) continue;
      const __mmask32 keep = (bits & 1u ? 0x55555555u : 0u) | (bits & 2u ? 0xAAAAAAAAu : 0u);
      __m512bh w[NH];
      for (int h = 0; h < NH; ++h)
        w[h] = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[h][c][j]));
      const auto accumulate = [&](int d, __m512i x) {  // 32 elements of V, dims 16d..
        const __m512bh v = (__m512bh)_mm512_maskz_mov_epi16(keep, x);
        for (int h = 0; h < NH; ++h) a[h][d] = _mm512_dpbf16_ps(a[h][d], w[h], v);
      };
      if constexpr (fp8_pairs<CT>()) {
#ifdef __AVX512VBMI__
        __m512i x[D / 16];
        for (int d = 0; d < D / 16; d += 2)
          kvserve_codes::fp8_codes64(vt[c] + j * 2 * D + 32 * d, x[d], x[d + 1]);
        for (int d = 0; d < D / 16; ++d) accumulate(d, x[d]);
#endif
      } else {
        for (int d = 0; d < D / 16; ++d) accumulate(d, tile32(vt[c] + j * 2 * D + 32 * d));
      }
    }
  store_acc<D, NH>(a, acc);
  trickle = tr;
}

// How many times fold_span calls trickle.step() for G query heads and nc cells: per group
// of heads (by_heads), one per K pair of the scores and one per key pair of P·V.
template <int D>
constexpr int64_t span_steps(int64_t G, int64_t nc) {
  constexpr int64_t NH = heads_per_pass<D>();
  return (G + NH - 1) / NH * (D / 2 + nc * (CELL / 2));
}

// Fold nc (1..SPAN) cells of one KV head — K tiles kt, V tiles vt (with their scales ks,
// vs for 8-bit codes), visible lanes mk (not 0), in position order — into the online-softmax
// state of one query row's G heads: `q` [G][D / 2] bf16 pairs (unscaled; scaled after the
// dot products; soft-capped when `cap` > 0), running max `m`, sum `l`, accumulator
// `acc` [G][D]; issues some of `tr`'s
// prefetches on the way (span_heads). Never inlined: every caller of one instantiation
// runs exactly its code. `scaled` (8-bit caches): the tiles are codes with scales, read in
// place (CT the code type: decode rows) or converted to bf16 beforehand (CT bf16: prefill
// items). Those are two instantiations of the same source over the same values. They give
// the same bits only because the build turns off reassociation (cpu_kernels.py: with it
// on, GCC compiled the two differently), and test_kv_tiles_8bit checks a prefill row
// against the same row decoded alone, bit for bit.
template <int D, typename CT, bool scaled = !std::is_same_v<CT, c10::BFloat16>>
__attribute__((noinline)) void fold_span(const uint32_t* q, int64_t G, float scale, float cap,
                                         const CT* const* kt, const CT* const* vt,
                                         const c10::Half* const* ks, const c10::Half* const* vs,
                                         const uint16_t* mk, int nc, kvserve_items::Trickle& tr,
                                         float* m, float* l, float* acc) {
  by_heads<D>(G, [&](auto nh, int64_t g) {
    constexpr int NH = decltype(nh)::value;
    const uint32_t* qg = q + g * (D / 2);
    float *mg = m + g, *lg = l + g, *ag = acc + g * D;
    const auto run = [&](auto nc_tag) {
      constexpr int NC = decltype(nc_tag)::value;
      span_heads<D, NH, NC, CT, scaled>(qg, scale, cap, kt, vt, ks, vs, mk, tr, mg, lg, ag);
    };
    switch (nc) {
      case 1: return run(std::integral_constant<int, 1>{});
      case 2: return run(std::integral_constant<int, 2>{});
      case 3: return run(std::integral_constant<int, 3>{});
      default: return run(std::integral_constant<int, SPAN>{});
    }
  });
}
#endif

}  // namespace kvserve_cell
