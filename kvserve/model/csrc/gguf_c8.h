// gguf_gemm.cpp's kind c8: int8 weights with one scale per output channel (what
// `--quantization int8` serves from a float checkpoint, model/quantized.pack_int8), against
// the activations every kind uses (int8 per block of 32, dx and sx per block).
//
// Weights: qs as s8's ([G][K/32][8 chunks][16 rows][4 bytes], q + 128 as unsigned bytes),
// d [G][16] float32: row j's scale dw. Per block b, with the integer sum exact,
//   isum = sum((q + 128) * qx) - 128 sx        (-128 sx: QAct.si, the chain's start)
//   acc = fma(float(isum), dx, acc)            (blocks in order, from zero)
// and at the end y = acc * dw. Two float operations a block and row instead of Q8_0's
// four (no weight scale per block), and the zmm chains need no zeroing.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "float_convert.h"
#include "gguf_blocks.h"

namespace kvserve_gguf {

constexpr int kC8 = 6;

// The portable loop: rows [r0, r0 + rows) x group g.
inline void tile_c8_portable(const QAct& a, int64_t r0, int rows, const QWeight& w, int64_t g,
                             float (*acc)[16]) {
  const uint8_t* qs = w.qs + g * a.nb * 512;
  const float* dw = reinterpret_cast<const float*>(w.d) + g * 16;
  for (int r = 0; r < rows; ++r) {
    const int8_t* xq = a.q + (r0 + r) * a.k;
    const float* dx = a.d + (r0 + r) * a.nb;
    const int32_t* si = a.si + (r0 + r) * a.nb;
    for (int j = 0; j < 16; ++j) {
      float sum = 0.f;
      for (int64_t b = 0; b < a.nb; ++b) {
        int32_t isum = si[b];
        for (int c = 0; c < 8; ++c)
          for (int i = 0; i < 4; ++i)
            isum += qs[b * 512 + c * 64 + j * 4 + i] * xq[b * kQB + 4 * c + i];
        sum = std::fma(static_cast<float>(isum), dx[b], sum);
      }
      acc[r][j] = sum * dw[j];
    }
  }
}

#ifdef KVSERVE_GGUF_VNNI
// Rows [r0, r0 + MR) x group g: per block two vpdpbusd chains a row, the first starting at
// -128 sx, then one convert and one FMA.
template <int MR>
void tile_c8_vnni(const QAct& a, int64_t r0, const QWeight& w, int64_t g, float (*acc_out)[16]) {
  const uint8_t* qs = w.qs + g * a.nb * 512;
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = qs + b * 512;
    __m512i wv[8];
    for (int c = 0; c < 8; ++c) wv[c] = _mm512_loadu_si512(blk + c * 64);
    for (int r = 0; r < MR; ++r) {
      const int64_t rb = (r0 + r) * a.nb + b;
      const int8_t* xq = a.q + (r0 + r) * a.k + b * kQB;
      __m512i s0 = _mm512_set1_epi32(a.si[rb]), s1 = _mm512_setzero_si512();
      for (int c = 0; c < 8; c += 2) {
        int32_t lo, hi;
        std::memcpy(&lo, xq + 4 * c, 4);
        std::memcpy(&hi, xq + 4 * c + 4, 4);
        s0 = _mm512_dpbusd_epi32(s0, wv[c], _mm512_set1_epi32(lo));
        s1 = _mm512_dpbusd_epi32(s1, wv[c + 1], _mm512_set1_epi32(hi));
      }
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)),
                               _mm512_set1_ps(a.d[rb]), acc[r]);
    }
  }
  const __m512 dw = _mm512_loadu_ps(reinterpret_cast<const float*>(w.d) + g * 16);
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(acc_out[r], _mm512_mul_ps(acc[r], dw));
}

inline void tile_c8_vnni_rows(const QAct& a, int64_t r0, int rows, const QWeight& w,
                              int64_t g, float (*acc)[16]) {
  switch (rows) {
    case 8: tile_c8_vnni<8>(a, r0, w, g, acc); break;
    case 7: tile_c8_vnni<7>(a, r0, w, g, acc); break;
    case 6: tile_c8_vnni<6>(a, r0, w, g, acc); break;
    case 5: tile_c8_vnni<5>(a, r0, w, g, acc); break;
    case 4: tile_c8_vnni<4>(a, r0, w, g, acc); break;
    case 3: tile_c8_vnni<3>(a, r0, w, g, acc); break;
    case 2: tile_c8_vnni<2>(a, r0, w, g, acc); break;
    default: tile_c8_vnni<1>(a, r0, w, g, acc); break;
  }
}
#endif

}  // namespace kvserve_gguf
