// Float conversions shared by the CPU kernels, written to vectorize: bf16 <-> float by bit
// shifts (round to nearest even, the same result as c10::BFloat16; NaN stays NaN); Half
// goes through c10 (rare on CPU).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace kvserve_cpu {

inline float to_f(float v) { return v; }
inline float to_f(c10::Half v) { return static_cast<float>(v); }
inline float to_f(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
inline T from_f(float v) {
  return static_cast<T>(v);
}
template <>
inline c10::BFloat16 from_f<c10::BFloat16>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  const bool nan = (u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu);
  u += 0x7FFFu + ((u >> 16) & 1u);
  const uint16_t bits = nan ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(u >> 16);
  return c10::BFloat16(bits, c10::BFloat16::from_bits());
}

}  // namespace kvserve_cpu
