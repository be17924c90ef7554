// One cell of paged attention (up to CELL = 16 keys of one KV head, in float) folded into
// the online-softmax state of a query row's G heads. Keys sit in lanes by position: the key
// at position p is lane p % CELL, so a lane's place never depends on which other rows or
// keys share the cell, and a row's arithmetic is a function of its own visible keys only
// (the determinism rule in paged_attention.cpp).
//
// Scores are computed lane-parallel over keys from K stored transposed, kT[d][lane]: a
// broadcast query element times one row of kT per step, no horizontal sum per key. With
// AVX-512 the routines are written in intrinsics (explicit FMAs, a fixed reduction tree);
// elsewhere the same algorithm runs as portable loops.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace kvserve_cell {

constexpr int CELL = 16;            // keys per cell = lanes of one AVX-512 float register
constexpr float NEG_BIG = -1e30f;   // finite "minus infinity" (the build uses -ffast-math)

// What a query row's accumulator is multiplied by at the end: 1 / l; with a sink logit
// (gpt-oss: a learned score per head, one more softmax column whose value is dropped) the
// row's state (m, l) merged with the sink's (sink, 1): e^(m - M) / (l e^(m - M) + e^(sink - M)),
// M = max(m, sink). Per row: it never depends on other rows.
inline float row_scale(float m, float l, const float* sink) {
  if (sink == nullptr) return 1.f / l;
  const float top = std::max(m, *sink);
  const float corr = std::exp(m - top);
  return corr / (l * corr + std::exp(*sink - top));
}

// out[j * CELL + i] = rows[i][j] for j < W, i < CELL: one cell's rows, transposed. The
// elements are 32-bit (a float, or a pair of bf16), moved as bits.
template <int W>
inline void transpose_cell(const uint32_t* const* rows, uint32_t* out) {
  static_assert(W % 16 == 0, "transpose_cell: W must be a multiple of 16");
#ifdef __AVX512F__
  for (int c = 0; c < W; c += 16) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_castsi512_ps(_mm512_loadu_si512(rows[i] + c));
    for (int i = 0; i < 8; ++i) {  // [a0 b0 a1 b1] and [a2 b2 a3 b3] per 128-bit lane
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // r[4i + j], lane k: column 4k + j of rows 4i .. 4i+3
      const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
      const __m512d e = _mm512_castps_pd(t[4 * i + 2]), f = _mm512_castps_pd(t[4 * i + 3]);
      r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, e));
      r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, e));
      r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, f));
      r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, f));
    }
    float* o = reinterpret_cast<float*>(out);
    for (int j = 0; j < 4; ++j) {  // gather the four row groups' lane k into column 4k + j
      const __m512 a88 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
      const __m512 add = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
      const __m512 b88 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
      const __m512 bdd = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
      _mm512_storeu_ps(o + (c + j) * CELL, _mm512_shuffle_f32x4(a88, b88, 0x88));
      _mm512_storeu_ps(o + (c + j + 8) * CELL, _mm512_shuffle_f32x4(a88, b88, 0xdd));
      _mm512_storeu_ps(o + (c + j + 4) * CELL, _mm512_shuffle_f32x4(add, bdd, 0x88));
      _mm512_storeu_ps(o + (c + j + 12) * CELL, _mm512_shuffle_f32x4(add, bdd, 0xdd));
    }
  }
#else
  for (int i = 0; i < CELL; ++i)
    for (int j = 0; j < W; ++j) out[j * CELL + i] = rows[i][j];
#endif
}

#ifdef __AVX512F__
// e^x for 16 lanes: 2^n · e^r with r = x - n·ln2 (two-part ln2) and the Cephes expf
// polynomial (~1 ulp); inputs below -103 give 0.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-103.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// Attention logit soft-capping (Gemma 2): cap · tanh(s / cap) for 16 scores, with
// tanh(x) = (e - 1) / (e + 1), e = exp16(2x), x clamped to ±9 (where tanh is 1 in float).
// Lane by lane, so a score's value never depends on its neighbours.
inline __m512 softcap16(__m512 s, float cap) {
  const __m512 c = _mm512_set1_ps(cap), one = _mm512_set1_ps(1.f);
  __m512 x = _mm512_div_ps(s, c);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(9.f)), _mm512_set1_ps(-9.f));
  const __m512 e = exp16(_mm512_add_ps(x, x));
  return _mm512_mul_ps(c, _mm512_div_ps(_mm512_sub_ps(e, one), _mm512_add_ps(e, one)));
}
#endif

// The portable loops' soft-capping: the same formula, lane by lane (cap > 0).
inline float softcap1(float s, float cap) {
  const float x = std::min(std::max(s / cap, -9.f), 9.f);
  const float e = std::exp(x + x);
  return cap * ((e - 1.f) / (e + 1.f));
}

#ifdef __AVX512F__
// Heads folded together: their scores share each load of K, their accumulators each load
// of V. At most 24 accumulator registers: 4 heads for D <= 96, 3 for 128, 1 for 256.
template <int D>
constexpr int heads_per_pass() {
  return D / 16 * 4 <= 24 ? 4 : (D / 16 * 3 <= 24 ? 3 : 1);
}

// Calls f(std::integral_constant<int, n>, g) for consecutive groups of n heads covering
// [0, G): n = heads_per_pass<D>() but for a last, smaller group. The grouping is a function
// of G and D alone.
template <int D, typename F>
inline void by_heads(int64_t G, F&& f) {
  constexpr int NH = heads_per_pass<D>();
  for (int64_t g = 0; g < G;) {
    const int64_t n = std::min<int64_t>(NH, G - g);
    if (n >= 4) f(std::integral_constant<int, (NH >= 4 ? 4 : 1)>{}, g);
    else if (n == 3) f(std::integral_constant<int, (NH >= 3 ? 3 : 1)>{}, g);
    else if (n == 2) f(std::integral_constant<int, 2>{}, g);
    else f(std::integral_constant<int, 1>{}, g);
    g += n;  // n <= NH, so every branch taken is instantiated with n itself
  }
}

// Scores of NH heads, q [NH][D] float (already scaled), against kT [D][CELL] float: two
// chains per head over d (even, odd).
template <int D, int NH>
inline void scores_f32(const float* q, const float* kT, __m512* s) {
  __m512 se[NH], so[NH];
  for (int h = 0; h < NH; ++h) se[h] = so[h] = _mm512_setzero_ps();
  for (int d = 0; d < D; d += 2) {
    const __m512 ke = _mm512_loadu_ps(kT + d * CELL), ko = _mm512_loadu_ps(kT + (d + 1) * CELL);
    for (int h = 0; h < NH; ++h) {
      se[h] = _mm512_fmadd_ps(_mm512_set1_ps(q[h * D + d]), ke, se[h]);
      so[h] = _mm512_fmadd_ps(_mm512_set1_ps(q[h * D + d + 1]), ko, so[h]);
    }
  }
  for (int h = 0; h < NH; ++h) s[h] = _mm512_add_ps(se[h], so[h]);
}

#ifdef __AVX512BF16__
// Scores of NH heads, q [NH][D] bf16 as pairs (unscaled), against kTp [D / 2][CELL] bf16
// pairs: exact bf16 products summed in float (vdpbf16ps), two chains per head, then scaled.
template <int D, int NH>
inline void scores_bf16(const uint32_t* q, float scale, const uint32_t* kTp, __m512* s) {
  __m512 se[NH], so[NH];
  for (int h = 0; h < NH; ++h) se[h] = so[h] = _mm512_setzero_ps();
  for (int j = 0; j < D / 2; j += 2) {
    const __m512bh ke = (__m512bh)_mm512_loadu_si512(kTp + j * CELL);
    const __m512bh ko = (__m512bh)_mm512_loadu_si512(kTp + (j + 1) * CELL);
    for (int h = 0; h < NH; ++h) {
      const uint32_t* qh = q + h * (D / 2);
      se[h] = _mm512_dpbf16_ps(se[h], (__m512bh)_mm512_set1_epi32(static_cast<int>(qh[j])), ke);
      so[h] =
          _mm512_dpbf16_ps(so[h], (__m512bh)_mm512_set1_epi32(static_cast<int>(qh[j + 1])), ko);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int h = 0; h < NH; ++h) s[h] = _mm512_mul_ps(_mm512_add_ps(se[h], so[h]), sc);
}
#endif

// Online-softmax update of NH heads from their scores s (lanes outside `mask` ignored):
// masked lanes set to NEG_BIG before the max and to 0 after the exp. Updates m and l and
// returns the weights e[h] and each head's rescale factor corr[h] for its accumulator.
template <int NH>
inline void softmax_weights(const __m512* s, __mmask16 mask, float* m, float* l, __m512* e,
                            float* corr) {
  for (int h = 0; h < NH; ++h) {
    const __m512 sm = _mm512_mask_mov_ps(_mm512_set1_ps(NEG_BIG), mask, s[h]);
    const float bm = std::max(m[h], _mm512_reduce_max_ps(sm));
    corr[h] = bm == m[h] ? 1.f : std::exp(m[h] - bm);  // exp(0) is 1: the libm call skipped
    e[h] = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(sm, _mm512_set1_ps(bm))));
    l[h] = l[h] * corr[h] + _mm512_reduce_add_ps(e[h]);
    m[h] = bm;
  }
}

// acc [NH][D] into registers, rescaled unless the max held (x * 1 is x: skipped).
template <int D, int NH>
inline void load_rescaled(const float* acc, const float* corr, __m512 (*a)[D / 16]) {
  for (int h = 0; h < NH; ++h) {
    const __m512 cv = _mm512_set1_ps(corr[h]);
    for (int c = 0; c < D / 16; ++c) {
      const __m512 x = _mm512_loadu_ps(acc + h * D + 16 * c);
      a[h][c] = corr[h] == 1.f ? x : _mm512_mul_ps(x, cv);
    }
  }
}

template <int D, int NH>
inline void store_acc(const __m512 (*a)[D / 16], float* acc) {
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(acc + h * D + 16 * c, a[h][c]);
}

// The online-softmax update, then acc += p · V with V in float, vb [CELL][D].
template <int D, int NH>
inline void softmax_pv(const __m512* s, const float* vb, int t0, int t1, __mmask16 mask,
                       float* m, float* l, float* acc) {
  alignas(64) float p[NH][CELL];
  __m512 e[NH];
  float corr[NH];
  softmax_weights<NH>(s, mask, m, l, e, corr);
  for (int h = 0; h < NH; ++h) _mm512_store_ps(p[h], e[h]);
  __m512 a[NH][D / 16];
  load_rescaled<D, NH>(acc, corr, a);
  for (int t = t0; t < t1; ++t)  // NH * D / 16 independent chains over t
    for (int c = 0; c < D / 16; ++c) {
      const __m512 v = _mm512_loadu_ps(vb + t * D + 16 * c);
      for (int h = 0; h < NH; ++h) a[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[h][t]), v, a[h][c]);
    }
  store_acc<D, NH>(a, acc);
}

#ifdef __AVX512BF16__
// Key `lane`'s V row (D bf16) into its half of the cell's key pairs vp [CELL / 2][D]:
// vp[j][d] holds keys 2j (low half) and 2j + 1 (high half) at dimension d, for vdpbf16ps
// over key pairs. The other half of each pair is left as it is.
template <int D>
inline void put_v_pair(const uint16_t* src, int64_t lane, uint32_t* vp) {
  uint32_t* dst = vp + lane / 2 * D;
  const bool high = lane % 2;
  const __mmask32 half = high ? 0xAAAAAAAAu : 0x55555555u;
  for (int d = 0; d < D; d += 16) {
    __m512i x =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d)));
    if (high) x = _mm512_slli_epi32(x, 16);
    _mm512_mask_storeu_epi16(dst + d, half, x);
  }
}

// The online-softmax update, then acc += p · V with V as bf16 key pairs (put_v_pair): the
// weights (times the keys' V scales `vs` with kVScaled) are rounded to bf16 and each
// vdpbf16ps takes two keys (a masked lane's weight is 0, so a pair half outside [t0, t1)
// adds 0 times a finite value).
template <int D, int NH, bool kVScaled>
inline void softmax_pv_bf16(const __m512* s, const uint32_t* vp, __m512 vs, int t0, int t1,
                            __mmask16 mask, float* m, float* l, float* acc) {
  alignas(64) uint32_t p[NH][CELL / 2];  // bf16 weights, lane pairs
  __m512 e[NH];
  float corr[NH];
  softmax_weights<NH>(s, mask, m, l, e, corr);
  for (int h = 0; h < NH; ++h) {
    const __m512 w = kVScaled ? _mm512_mul_ps(e[h], vs) : e[h];
    _mm256_store_si256(reinterpret_cast<__m256i*>(p[h]), (__m256i)_mm512_cvtneps_pbh(w));
  }
  __m512 a[NH][D / 16];
  load_rescaled<D, NH>(acc, corr, a);
  for (int j = t0 / 2; j < (t1 + 1) / 2; ++j)
    for (int c = 0; c < D / 16; ++c) {
      const __m512bh v = (__m512bh)_mm512_loadu_si512(vp + j * D + 16 * c);
      for (int h = 0; h < NH; ++h) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[h][j]));
        a[h][c] = _mm512_dpbf16_ps(a[h][c], w, v);
      }
    }
  store_acc<D, NH>(a, acc);
}
#endif

inline __mmask16 lanes(int t0, int t1) {
  return static_cast<__mmask16>(((1u << t1) - 1u) & ~((1u << t0) - 1u));
}
#endif

// Fold lanes [t0, t1) of one cell — kT [D][CELL] (transposed keys, scaled), vb [CELL][D]
// (values, scaled) — into the online softmax state of one query row's G heads: running
// max `m`, sum `l`, accumulator `acc` [G][D]. `q` [G][D] is already multiplied by the
// softmax scale; `cap` > 0 soft-caps the scores (softcap16), 0 leaves them. Never inlined:
// every caller runs exactly this code, so a row's arithmetic cannot depend on the context
// it was called from (heads are grouped by G and D alone).
template <int D>
__attribute__((noinline)) void fold(const float* q, int64_t G, float cap, const float* kT,
                                    const float* vb, int t0, int t1, float* m, float* l,
                                    float* acc) {
#ifdef __AVX512F__
  const __mmask16 mask = lanes(t0, t1);
  by_heads<D>(G, [&](auto nh, int64_t g) {
    constexpr int NH = decltype(nh)::value;
    __m512 s[NH];
    scores_f32<D, NH>(q + g * D, kT, s);
    if (cap > 0.f)
      for (int h = 0; h < NH; ++h) s[h] = softcap16(s[h], cap);
    softmax_pv<D, NH>(s, vb, t0, t1, mask, m + g, l + g, acc + g * D);
  });
#else
  float s[CELL];
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * D;
    for (int i = 0; i < CELL; ++i) s[i] = 0.f;
    for (int d = 0; d < D; ++d)
#pragma omp simd
      for (int i = 0; i < CELL; ++i) s[i] += qg[d] * kT[d * CELL + i];
    if (cap > 0.f)
      for (int i = 0; i < CELL; ++i) s[i] = softcap1(s[i], cap);
    float bm = m[g];
    for (int t = t0; t < t1; ++t) bm = std::max(bm, s[t]);
    const float corr = std::exp(m[g] - bm);
    float sum = l[g] * corr;
    for (int t = t0; t < t1; ++t) {
      s[t] = std::exp(s[t] - bm);
      sum += s[t];
    }
    l[g] = sum;
    m[g] = bm;
    float* ag = acc + g * D;
    for (int d = 0; d < D; ++d) ag[d] *= corr;
    for (int t = t0; t < t1; ++t)
#pragma omp simd
      for (int d = 0; d < D; ++d) ag[d] += s[t] * vb[t * D + d];
  }
#endif
}

#ifdef __AVX512BF16__
constexpr bool kBf16Scores = true;
// fold for a bf16 query against bf16 keys and values: `q` [G][D / 2] bf16 pairs, unscaled
// (scaled after the dot product); kTp [D / 2][CELL] pairs of the cell's keys and vp
// [CELL / 2][D] key pairs of its values (put_v_pair); weights rounded to bf16 for P·V;
// otherwise as fold. With kLaneScales (an 8-bit cache, its codes exact in bf16), key
// lane i's scores are multiplied by ks[i] and its weights by vs[i] (the dequantization
// scales); without, ks and vs are not read. `cap` soft-caps the scaled scores as in fold.
// Never inlined, for the same reason.
template <int D, bool kLaneScales>
__attribute__((noinline)) void fold_bf16(const uint32_t* q, int64_t G, float scale, float cap,
                                         const uint32_t* kTp, const uint32_t* vp,
                                         const float* ks, const float* vs, int t0, int t1,
                                         float* m, float* l, float* acc) {
  const __mmask16 mask = lanes(t0, t1);
  const __m512 ksv = kLaneScales ? _mm512_loadu_ps(ks) : _mm512_setzero_ps();
  const __m512 vsv = kLaneScales ? _mm512_loadu_ps(vs) : _mm512_setzero_ps();
  by_heads<D>(G, [&](auto nh, int64_t g) {
    constexpr int NH = decltype(nh)::value;
    __m512 s[NH];
    scores_bf16<D, NH>(q + g * (D / 2), scale, kTp, s);
    if constexpr (kLaneScales)
      for (int h = 0; h < NH; ++h) s[h] = _mm512_mul_ps(s[h], ksv);
    if (cap > 0.f)
      for (int h = 0; h < NH; ++h) s[h] = softcap16(s[h], cap);
    softmax_pv_bf16<D, NH, kLaneScales>(s, vp, vsv, t0, t1, mask, m + g, l + g, acc + g * D);
  });
}
#else
constexpr bool kBf16Scores = false;
template <int D, bool kLaneScales>  // never called (kBf16Scores is false): keeps callers uniform
void fold_bf16(const uint32_t*, int64_t, float, float, const uint32_t*, const uint32_t*,
               const float*, const float*, int, int, float*, float*, float*) {}
template <int D>
void put_v_pair(const uint16_t*, int64_t, uint32_t*) {}
#endif

}  // namespace kvserve_cell
