// gguf_gemm.cpp's activations quantized, per row and block of QB values (32, or c8's 128),
// as llama.cpp's Q8_0 does: amax = max |x|, dx = amax * float(1/127), id = 127 / amax,
// qx = clamp(round-to-nearest-even(x * id), -127, 127), sx = the block's sum of qx, hx the
// sum of its first QB / 2.
//
// Two loops compute it: the portable one, a value at a time, and with AVX-512 16 values a
// step. They give the same bits on finite values: the same float products and roundings
// in each lane, a maximum (exact in any order), integer sums (exact in any order). With many rows and few outputs (a MoE expert's 576 x 768 at 256 rows)
// the portable loop took half the product's time.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "float_convert.h"
#include "gguf_blocks.h"

namespace kvserve_gguf {

// One row, the portable loop: codes, scales and sums of its nb blocks of QB values.
template <int QB, typename T>
void quantize_row(const T* x, int64_t nb, int8_t* q, float* d, float* s, float* h) {
  using kvserve_cpu::to_f;
  for (int64_t b = 0; b < nb; ++b) {
    float v[QB], amax = 0.f;
    for (int i = 0; i < QB; ++i) {
      v[i] = to_f(x[b * QB + i]);
      amax = std::max(amax, std::fabs(v[i]));
    }
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0, half = 0;
    for (int i = 0; i < QB; ++i) {
      const int c = std::clamp(static_cast<int>(std::nearbyint(v[i] * id)), -127, 127);
      q[b * QB + i] = static_cast<int8_t>(c);
      sum += c;
      if (i == QB / 2 - 1) half = sum;
    }
    d[b] = amax * (1.f / 127.f);
    s[b] = static_cast<float>(sum);
    h[b] = static_cast<float>(half);
  }
}

#ifdef KVSERVE_GGUF_VNNI
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  return kvserve_cpu::widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// One row, 16 values a step: quantize_row's bits.
template <int QB, typename T>
void quantize_row_simd(const T* x, int64_t nb, int8_t* q, float* d, float* s, float* h) {
  constexpr int kV = QB / 16;
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t b = 0; b < nb; ++b) {
    __m512 v[kV];
    __m512 mx = _mm512_setzero_ps();
    for (int i = 0; i < kV; ++i) {
      v[i] = load16(x + b * QB + 16 * i);
      mx = _mm512_max_ps(_mm512_abs_ps(v[i]), mx);
    }
    const float amax = _mm512_reduce_max_ps(mx);
    const __m512 id = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m512i sum = _mm512_setzero_si512(), half = _mm512_setzero_si512();
    for (int i = 0; i < kV; ++i) {
      const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v[i], id),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i c = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(r), lo), hi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * QB + 16 * i), _mm512_cvtepi32_epi8(c));
      sum = _mm512_add_epi32(sum, c);
      if (i == kV / 2 - 1) half = sum;
    }
    d[b] = amax * (1.f / 127.f);
    s[b] = static_cast<float>(_mm512_reduce_add_epi32(sum));
    h[b] = static_cast<float>(_mm512_reduce_add_epi32(half));
  }
}
#endif

// Row r of x in blocks of QB values, by the SIMD loop where built and asked for.
template <int QB, typename T>
void quantize_one(const T* xr, int64_t nb, int8_t* q, float* d, float* s, float* h,
                  bool simd) {
#ifdef KVSERVE_GGUF_VNNI
  if constexpr (!std::is_same_v<T, double>)
    if (simd) return quantize_row_simd<QB>(xr, nb, q, d, s, h);
#endif
  (void)simd;
  quantize_row<QB>(xr, nb, q, d, s, h);
}

// Quantizes x [M, K] into q [M, K], d, s and h [M, K/qb]: blocks of qb values (32, or
// c8's 128: gguf_c8.h's c8_block); simd: the AVX-512 loop where built. Rows in
// parallel from 8 rows on: a decode step's call costs no thread wake-up.
inline void quantize_rows(const at::Tensor& x, int8_t* q, float* d, float* s, float* h,
                          int64_t qb, bool simd) {
  TORCH_CHECK(qb == kQB || qb == 128, "gguf: activation blocks of ", qb);
  const int64_t m = x.size(0), k = x.size(1), nb = k / qb;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gguf_q", [&] {
    const auto* xp = x.data_ptr<scalar_t>();
    auto rows = [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const auto* xr = xp + r * x.stride(0);
        int8_t* qr = q + r * k;
        const int64_t o = r * nb;
        if (qb == 128) quantize_one<128>(xr, nb, qr, d + o, s + o, h + o, simd);
        else quantize_one<kQB>(xr, nb, qr, d + o, s + o, h + o, simd);
      }
    };
    if (m < 8) rows(0, m);
    else at::parallel_for(0, m, 8, rows);
  });
}

}  // namespace kvserve_gguf
