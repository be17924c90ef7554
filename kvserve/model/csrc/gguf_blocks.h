// The shared parts of csrc/gguf_gemm.cpp (its header comment describes the layouts): the
// kinds, the quantized activations and weights of one product, and k4's scales.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#include <immintrin.h>
#define KVSERVE_GGUF_VNNI 1
#endif

namespace kvserve_gguf {

constexpr int64_t kQB = 32;  // K per block
constexpr int kU4 = 0, kS8 = 1, kZ4 = 2, kK4 = 3, kK6 = 4, kK5 = 5;

// The activations of one product, quantized (quantize_rows).
struct QAct {
  const int8_t* q;  // [M, K]
  const float* d;   // [M, K/32]
  const float* s;   // [M, K/32]
  const float* h;   // [M, K/32]: the sums of each block's first 16 codes
  int64_t k, nb;
  const int32_t* si = nullptr;  // c8 only: -128 x s as integers, per activation block
  int64_t ab = 1;               // 32-value blocks per activation block (c8: 1 or 4)
};

struct QWeight {
  const uint8_t* qs;   // [G][nb][qbytes]
  const uint16_t* d;   // [G][nb][16] fp16 bits (k4, k5: [G][nb/8][32], D and Dmin; k6:
                       // [G][nb/8][16], D)
  const void* aux;     // u4: m fp16 [G][nb][16]; k4, k5: sc, mn uint8 [G][nb][32]; k6: sc
                       // int8 [G][nb][32]; s8, z4: unused
  int64_t n, qbytes;
};

inline float half_to_f(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// k4, k5: lane j's (dw, mw) of block b of group g.
inline void k4_scales(const QWeight& w, int64_t nb, int64_t g, int64_t b, int j, float& dw,
                      float& mw) {
  const uint16_t* sup = w.d + (g * (nb / 8) + b / 8) * 32;
  const uint8_t* sm = static_cast<const uint8_t*>(w.aux) + (g * nb + b) * 32;
  dw = half_to_f(sup[j]) * static_cast<float>(sm[j]);
  mw = -(half_to_f(sup[16 + j]) * static_cast<float>(sm[16 + j]));
}

}  // namespace kvserve_gguf
