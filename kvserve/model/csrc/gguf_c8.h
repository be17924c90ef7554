// gguf_gemm.cpp's kind c8: int8 weights with one scale per output channel (what
// `--quantization int8` serves from a float checkpoint, model/quantized.pack_int8), against
// int8 activations quantized as every kind's (dx = amax * float(1/127), qx = rne(x * (127 /
// amax)), sx = the sum of qx) but per block of 128 values where K is a multiple of 128,
// else per 32 (c8_block).
//
// Weights: qs as s8's ([G][K/32][8 chunks][16 rows][4 bytes], q + 128 as unsigned bytes),
// d [G][16] float32: row j's scale dw. Per activation block B, with the integer sum exact
// (|isum| <= 127 * 127 * 128 < 2^24, so its float is exact too),
//   isum = sum((q + 128) * qx) - 128 sx        (-128 sx: QAct.si, the chains' start)
//   acc = fma(float(isum), dx, acc)            (blocks in order, from zero)
// and at the end y = acc * dw. Two float operations per 128 products of a row where Q8_0
// needs four per 32 (a weight scale per block): the VNNI tile spends its time in vpdpbusd.
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
// Values per activation block: 128 where K allows, else 32. (96-value blocks where K is a
// multiple of 96, tried: a 288-wide expert down projection at 256 rows 161 -> 87 us, but
// SmolLM2-135M's perplexity +0.96 % over bf16 where 32-value blocks give +0.33 %.)
inline int64_t c8_block(int64_t k) { return k % 128 == 0 ? 128 : kQB; }

// The portable loop: rows [r0, r0 + rows) x group g.
inline void tile_c8_portable(const QAct& a, int64_t r0, int rows, const QWeight& w, int64_t g,
                             float (*acc)[16]) {
  const uint8_t* qs = w.qs + g * a.nb * 512;
  const float* dw = reinterpret_cast<const float*>(w.d) + g * 16;
  const int64_t nab = a.nb / a.ab;
  for (int r = 0; r < rows; ++r) {
    const int8_t* xq = a.q + (r0 + r) * a.k;
    const float* dx = a.d + (r0 + r) * nab;
    const int32_t* si = a.si + (r0 + r) * nab;
    for (int j = 0; j < 16; ++j) {
      float sum = 0.f;
      for (int64_t B = 0; B < nab; ++B) {
        int32_t isum = si[B];
        for (int64_t b = B * a.ab; b < (B + 1) * a.ab; ++b)
          for (int c = 0; c < 8; ++c)
            for (int i = 0; i < 4; ++i)
              isum += qs[b * 512 + c * 64 + j * 4 + i] * xq[b * kQB + 4 * c + i];
        sum = std::fma(static_cast<float>(isum), dx[B], sum);
      }
      acc[r][j] = sum * dw[j];
    }
  }
}

#ifdef KVSERVE_GGUF_VNNI
// Rows [r0, r0 + MR) x group g: per activation block two vpdpbusd chains a row (the first
// starting at -128 sx) over its AB weight blocks, then one convert and one FMA.
template <int MR, int AB>
void tile_c8_vnni(const QAct& a, int64_t r0, const QWeight& w, int64_t g, float (*acc_out)[16]) {
  const uint8_t* qs = w.qs + g * a.nb * 512;
  const int64_t nab = a.nb / AB;
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t B = 0; B < nab; ++B) {
    __m512i s0[MR], s1[MR];
    for (int r = 0; r < MR; ++r) {
      s0[r] = _mm512_set1_epi32(a.si[(r0 + r) * nab + B]);
      s1[r] = _mm512_setzero_si512();
    }
    for (int sub = 0; sub < AB; ++sub) {
      const int64_t b = B * AB + sub;
      const uint8_t* blk = qs + b * 512;
      __m512i wv[8];
      for (int c = 0; c < 8; ++c) wv[c] = _mm512_loadu_si512(blk + c * 64);
      for (int r = 0; r < MR; ++r) {
        const int8_t* xq = a.q + (r0 + r) * a.k + b * kQB;
        for (int c = 0; c < 8; c += 2) {
          int32_t lo, hi;
          std::memcpy(&lo, xq + 4 * c, 4);
          std::memcpy(&hi, xq + 4 * c + 4, 4);
          s0[r] = _mm512_dpbusd_epi32(s0[r], wv[c], _mm512_set1_epi32(lo));
          s1[r] = _mm512_dpbusd_epi32(s1[r], wv[c + 1], _mm512_set1_epi32(hi));
        }
      }
    }
    for (int r = 0; r < MR; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0[r], s1[r])),
                               _mm512_set1_ps(a.d[(r0 + r) * nab + B]), acc[r]);
  }
  const __m512 dw = _mm512_loadu_ps(reinterpret_cast<const float*>(w.d) + g * 16);
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(acc_out[r], _mm512_mul_ps(acc[r], dw));
}

template <int AB>
void tile_c8_vnni_ab(const QAct& a, int64_t r0, int rows, const QWeight& w, int64_t g,
                     float (*acc)[16]) {
  switch (rows) {
    case 8: tile_c8_vnni<8, AB>(a, r0, w, g, acc); break;
    case 7: tile_c8_vnni<7, AB>(a, r0, w, g, acc); break;
    case 6: tile_c8_vnni<6, AB>(a, r0, w, g, acc); break;
    case 5: tile_c8_vnni<5, AB>(a, r0, w, g, acc); break;
    case 4: tile_c8_vnni<4, AB>(a, r0, w, g, acc); break;
    case 3: tile_c8_vnni<3, AB>(a, r0, w, g, acc); break;
    case 2: tile_c8_vnni<2, AB>(a, r0, w, g, acc); break;
    default: tile_c8_vnni<1, AB>(a, r0, w, g, acc); break;
  }
}

inline void tile_c8_vnni_rows(const QAct& a, int64_t r0, int rows, const QWeight& w,
                              int64_t g, float (*acc)[16]) {
  if (a.ab == 4) tile_c8_vnni_ab<4>(a, r0, rows, w, g, acc);
  else tile_c8_vnni_ab<1>(a, r0, rows, w, g, acc);
}
#endif

}  // namespace kvserve_gguf
