// The first pass of an RMSNorm over a row, shared by Llama's (fused_ops.cpp) and Gemma's
// (gemma_ops.cpp) norms so that both round the residual and sum alike.
#pragma once

#include <cstdint>
#include <type_traits>

#include "float_convert.h"

namespace kvserve_cpu {

// Where row r of x starts: x is [outer, inner, n] with strides (s0, s1, 1) (2-D: inner 1).
// The norms read q/k views of a qkv projection's output in place this way.
struct Rows {
  int64_t inner, s0, s1;
  int64_t at(int64_t r) const { return (r / inner) * s0 + (r % inner) * s1; }
};

// With `add`, x = T(x + add), stored in x; returns the sum of x² over the row in float, in
// a fixed order whatever the batch (bf16 with AVX-512-BF16: 16 lanes, then their sum).
template <typename T>
inline float add_sum_squares(T* x, const T* add, int64_t n) {
#ifdef KVSERVE_AVX512_BF16
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = first_lanes(n - i);
      __m512 xv = widen_bf16(_mm256_maskz_loadu_epi16(m, x + i));
      if (add) {
        const __m256i r = (__m256i)_mm512_cvtneps_pbh(
            _mm512_add_ps(xv, widen_bf16(_mm256_maskz_loadu_epi16(m, add + i))));
        _mm256_mask_storeu_epi16(x + i, m, r);
        xv = widen_bf16(r);
      }
      ss = _mm512_fmadd_ps(xv, xv, ss);
    }
    return _mm512_reduce_add_ps(ss);
  }
#endif
  if (add) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] = from_f<T>(to_f(x[i]) + to_f(add[i]));
  }
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_f(x[i]);
    ss += v * v;
  }
  return ss;
}

}  // namespace kvserve_cpu
