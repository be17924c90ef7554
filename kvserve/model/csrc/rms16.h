// The first pass of an RMSNorm over a bf16 row, shared by Llama's (fused_ops.cpp) and
// Gemma's (gemma_ops.cpp) norms so that both round the residual and sum alike.
#pragma once

#include "float_convert.h"

namespace kvserve_cpu {

#ifdef KVSERVE_AVX512_BF16
// With `add`, x = bf16(x + add), stored in x; returns the sum of x² over the row (16 lanes,
// then their sum: a fixed order, whatever the batch).
inline float add_sum_squares_bf16(c10::BFloat16* x, const c10::BFloat16* add, int64_t n) {
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

}  // namespace kvserve_cpu
