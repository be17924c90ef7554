// Cache element types for the paged attention kernels: loads of a 16/32-bit or 8-bit code
// as float, 8-bit codes as exact bf16 bits (32 at a time with AVX-512; fp8 also 64 at a
// time by byte lookup with AVX-512-VBMI), stores of a float result, and the scales of a
// quantized cache.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace kvserve_codes {

// Quantized caches: int8 has float16 scales per (slot, KV head); fp8 has float32 scales per
// KV head. Null pointers for a plain cache.
struct Scales {
  const c10::Half* k = nullptr;  // per token (int8)
  const c10::Half* v = nullptr;
  const float* k_head = nullptr;  // per head (fp8)
  const float* v_head = nullptr;
};

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const c10::Half* p, int64_t i) { return static_cast<float>(p[i]); }
inline float load(const c10::BFloat16* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float load(const int8_t* p, int64_t i) { return static_cast<float>(p[i]); }
// fp8 code -> float by bit arithmetic (vectorizes; c10's conversion does not): a normal
// code's exponent is rebased from bias B to 127, a subnormal one is a multiple of
// 2^(1-B-M). Exact for every code but NaN (never stored: writes clamp to the max).
template <int M, int B>
inline float fp8_to_f(uint8_t c) {
  constexpr float kSubUnit = 1.f / static_cast<float>(1u << (B - 1 + M));
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t em = c & 0x7Fu;
  const uint32_t nbits = (em << (23 - M)) + (static_cast<uint32_t>(127 - B) << 23);
  float normal, sub = static_cast<float>(em) * kSubUnit;
  std::memcpy(&normal, &nbits, sizeof(normal));
  uint32_t mag;
  const float v = em >= (1u << M) ? normal : sub;
  std::memcpy(&mag, &v, sizeof(mag));
  mag |= sign;
  float out;
  std::memcpy(&out, &mag, sizeof(out));
  return out;
}
inline float load(const c10::Float8_e4m3fn* p, int64_t i) {
  return fp8_to_f<3, 7>(reinterpret_cast<const uint8_t*>(p)[i]);
}
inline float load(const c10::Float8_e5m2* p, int64_t i) {
  return fp8_to_f<2, 15>(reinterpret_cast<const uint8_t*>(p)[i]);
}
// The bf16 bits of a float that bf16 holds exactly (an 8-bit code: int8, e4m3, e5m2).
inline uint16_t exact_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return static_cast<uint16_t>(bits >> 16);
}

// bf16 bits of k * 2^-s for 0 <= k < 128 (exact: k has at most 7 significant bits).
constexpr uint16_t scaled_int_bf16(int k, int s) {
  if (k == 0) return 0;
  int e = 0;
  while ((k >> (e + 1)) != 0) ++e;  // k = 2^e * 1.f
  const int mant = ((k - (1 << e)) << (7 - e)) & 0x7F;
  return static_cast<uint16_t>(((e - s + 127) << 7) | mant);
}

#ifdef __AVX512BW__
// 32 consecutive 8-bit codes (int8, e4m3, e5m2) as their exact bf16 bits. int8 codes go
// through float (two conversions, one pack); fp8 codes by bit arithmetic, a normal code's
// exponent rebased by one add, a subnormal one (exponent field 0) looked up.
template <typename ct>
inline __m512i codes32(const ct* src) {
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<ct, int8_t>) {
    const __m512 lo = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
    const __m512 hi = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  } else
#endif
  {
    static_assert(std::is_same_v<ct, c10::Float8_e4m3fn> || std::is_same_v<ct, c10::Float8_e5m2>,
                  "codes32: int8 (with AVX-512-BF16), e4m3 or e5m2 codes");
    constexpr int M = std::is_same_v<ct, c10::Float8_e4m3fn> ? 3 : 2;
    constexpr int B = std::is_same_v<ct, c10::Float8_e4m3fn> ? 7 : 15;
    alignas(64) static constexpr uint16_t kSub[32] = {
        scaled_int_bf16(0, B - 1 + M), scaled_int_bf16(1, B - 1 + M),
        scaled_int_bf16(2, B - 1 + M), scaled_int_bf16(3, B - 1 + M),
        scaled_int_bf16(4, B - 1 + M), scaled_int_bf16(5, B - 1 + M),
        scaled_int_bf16(6, B - 1 + M), scaled_int_bf16(7, B - 1 + M)};  // e5m2 uses 0..3
    const __m512i c =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    const __m512i em = _mm512_and_si512(c, _mm512_set1_epi16(0x7F));
    const __m512i normal =
        _mm512_add_epi16(_mm512_slli_epi16(em, 7 - M), _mm512_set1_epi16((127 - B) << 7));
    const __mmask32 is_sub = _mm512_cmplt_epu16_mask(em, _mm512_set1_epi16(1 << M));
    const __m512i mag = _mm512_mask_mov_epi16(
        normal, is_sub, _mm512_permutexvar_epi16(em, _mm512_load_si512(kSub)));
    const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(c, _mm512_set1_epi16(0x80)), 8);
    return _mm512_or_si512(mag, sign);
  }
}
#endif

#ifdef __AVX512VBMI__
// The bf16 bits of every fp8 magnitude (a code's low 7 bits), as codes32 computes them,
// split into high and low bytes: two 128-byte tables for vpermi2b.
template <int M, int B>
struct Fp8ByteTables {
  alignas(64) uint8_t hi[128] = {};
  alignas(64) uint8_t lo[128] = {};
  constexpr Fp8ByteTables() {
    for (int em = 0; em < 128; ++em) {
      const uint16_t bits = em < (1 << M)
                                ? scaled_int_bf16(em, B - 1 + M)
                                : static_cast<uint16_t>((em << (7 - M)) + ((127 - B) << 7));
      hi[em] = static_cast<uint8_t>(bits >> 8);
      lo[em] = static_cast<uint8_t>(bits & 0xFF);
    }
  }
};

// 64 consecutive fp8 codes as their exact bf16 bits (the same as two codes32 calls: codes
// [0, 32) in `a`, [32, 64) in `b`) by two byte lookups: ~7 instructions instead of ~20.
// The codes' 8-byte groups are reordered first so that the byte interleave of the two
// lookups (which works within 128-bit lanes) leaves the words in order.
template <typename ct>
inline void fp8_codes64(const ct* src, __m512i& a, __m512i& b) {
  static_assert(std::is_same_v<ct, c10::Float8_e4m3fn> || std::is_same_v<ct, c10::Float8_e5m2>,
                "fp8_codes64: e4m3 or e5m2 codes");
  constexpr int M = std::is_same_v<ct, c10::Float8_e4m3fn> ? 3 : 2;
  constexpr int B = std::is_same_v<ct, c10::Float8_e4m3fn> ? 7 : 15;
  static constexpr Fp8ByteTables<M, B> kTab{};
  const __m512i c = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7),
                                             _mm512_loadu_si512(src));
  const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(kTab.lo), c,
                                              _mm512_load_si512(kTab.lo + 64));
  __m512i hi = _mm512_permutex2var_epi8(_mm512_load_si512(kTab.hi), c,
                                        _mm512_load_si512(kTab.hi + 64));
  // hi | (c & 0x80): the code's sign is the bf16's
  hi = _mm512_ternarylogic_epi32(hi, c, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);
  a = _mm512_unpacklo_epi8(lo, hi);
  b = _mm512_unpackhi_epi8(lo, hi);
}
#endif

// A row of D cache codes as bf16 bits (exact): codes32 32 at a time where it applies.
template <int D, typename ct>
inline void codes_to_bf16(const ct* src, uint16_t* dst) {
#ifdef __AVX512BW__
  constexpr bool fp8 =
      std::is_same_v<ct, c10::Float8_e4m3fn> || std::is_same_v<ct, c10::Float8_e5m2>;
#ifdef __AVX512BF16__
  constexpr bool vec = D % 32 == 0 && (fp8 || std::is_same_v<ct, int8_t>);
#else
  constexpr bool vec = D % 32 == 0 && fp8;
#endif
  if constexpr (vec) {
    for (int d = 0; d < D; d += 32) _mm512_storeu_si512(dst + d, codes32(src + d));
    return;
  }
#endif
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) dst[d] = exact_bf16(load(src, d));
}
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(c10::Half* p, int64_t i, float v) { p[i] = c10::Half(v); }
inline void store(c10::BFloat16* p, int64_t i, float v) { p[i] = c10::BFloat16(v); }

}  // namespace kvserve_codes
