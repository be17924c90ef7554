// The first pass of an RMSNorm over a row, shared by Llama's (fused_ops.cpp) and Gemma's
// (gemma_ops.cpp) norms so that both round the residual and sum alike.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "float_convert.h"

namespace kvserve_cpu {

// Where row r of x starts: x is [outer, inner, n] with strides (s0, s1, 1) (2-D: inner 1).
// The norms read q/k views of a qkv projection's output in place this way.
struct Rows {
  int64_t inner, s0, s1;
  int64_t at(int64_t r) const { return (r / inner) * s0 + (r % inner) * s1; }

  // x's rows: x contiguous (any rank), or 2-D / 3-D with unit stride in its last dimension.
  static Rows of(const at::Tensor& x) {
    if (x.dim() == 3) return {x.size(1), x.stride(0), x.stride(1)};
    return {1, x.dim() == 2 ? x.stride(0) : x.size(-1), 0};
  }
};

// A norm's rows: row(x's row r read in place, out's row r, n) for every row r of x (laid
// out as Rows::of takes it) into out, a contiguous tensor of x's shape; 16 rows a work item.
// Which thread runs a row changes none of its bits.
template <typename T, typename Row>
void each_row(const at::Tensor& x, at::Tensor& out, const Row& row) {
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  const Rows at_row = Rows::of(x);
  T* xp = const_cast<T*>(x.data_ptr<T>());  // read only: the norms' `add` is null
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) row(xp + at_row.at(r), op + r * n, n);
  });
}

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
