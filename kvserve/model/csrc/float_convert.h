// Float conversions shared by the CPU kernels, written to vectorize: bf16 <-> float by bit
// shifts (round to nearest even, the same result as c10::BFloat16; NaN stays NaN); Half
// goes through c10 (rare on CPU). With AVX-512, 16-lane helpers (some also need its bf16
// instructions: KVSERVE_AVX512_BF16).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

// AVX-512 with the bf16 instructions and the 256-bit masked forms the kernels use.
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#define KVSERVE_AVX512_BF16 1
#endif

// Runs __VA_ARGS__ with T the element type of `dtype` (float32, bf16 or fp16); any other
// dtype is an error naming the op NAME.
#define KVSERVE_DISPATCH_FLOAT(dtype, NAME, ...)                               \
  switch (dtype) {                                                             \
    case at::kFloat: { using T = float; __VA_ARGS__; break; }                  \
    case at::kBFloat16: { using T = c10::BFloat16; __VA_ARGS__; break; }       \
    case at::kHalf: { using T = c10::Half; __VA_ARGS__; break; }               \
    default: TORCH_CHECK(false, NAME ": unsupported dtype ", dtype);           \
  }

namespace kvserve_cpu {

inline float to_f(float v) { return v; }
inline float to_f(c10::Half v) { return static_cast<float>(v); }
inline float to_f(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// NaN by its bits: the build's -ffast-math lets the compiler assume std::isnan is false.
inline bool nan_bits(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }
inline bool is_nan(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return nan_bits(u);
}

template <typename T>
inline T from_f(float v) {
  return static_cast<T>(v);
}
template <>
inline c10::BFloat16 from_f<c10::BFloat16>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  const bool nan = nan_bits(u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  const uint16_t bits = nan ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(u >> 16);
  return c10::BFloat16(bits, c10::BFloat16::from_bits());
}

#ifdef KVSERVE_AVX512_BF16
// The first min(n, 16) lanes (n >= 1): the mask of a row's last, partial vector.
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}
#endif

#ifdef __AVX512F__
// 16 bf16 values (as loaded, or as _mm512_cvtneps_pbh rounded them) -> float. Plain
// AVX-512 (the VNNI kernels use it on CPUs without the bf16 instructions too).
inline __m512 widen_bf16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#endif

}  // namespace kvserve_cpu
