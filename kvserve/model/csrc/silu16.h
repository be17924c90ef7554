// SiLU-and-mul on 16 bf16 lanes, shared by the element-wise op (fused_ops.cpp) and the
// gate/up GEMM's epilogue (bf16_gemm.cpp), so both round exactly alike: silu of the bf16
// gate (the attention kernels' polynomial exp, ~1 ulp), rounded to bf16, times the bf16
// up value, rounded to bf16 by the caller's store.
#pragma once

#include "attention_cell.h"
#include "float_convert.h"

namespace kvserve_cpu {

#ifdef KVSERVE_AVX512_BF16
// g, u: bf16 values widened to float. Returns silu(g) rounded to bf16, times u, in float.
inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 e = kvserve_cell::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  return _mm512_mul_ps(widen_bf16((__m256i)_mm512_cvtneps_pbh(silu)), u);
}
#endif

}  // namespace kvserve_cpu
