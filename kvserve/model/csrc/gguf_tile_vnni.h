// gguf_gemm.cpp's AVX512-VNNI tile: rows [r0, r0 + MR) of x times one group of 16 weight
// rows, every kind, with the same operations (and so the same bits) as tile_portable.
#pragma once

#include "gguf_blocks.h"

#ifdef KVSERVE_GGUF_VNNI
#include <cstring>

namespace kvserve_gguf {

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// A row's exact sum over one block: the 8 weight vectors wv (4 values of 16 rows each,
// s8's lane order) against the row's 32 codes xq, in four chains of two.
inline __m512i dot_block(const __m512i* wv, const int8_t* xq) {
  const __m512i z = _mm512_setzero_si512();
  __m512i s0 = _mm512_dpbusd_epi32(z, wv[0], bcast4(xq));
  __m512i s1 = _mm512_dpbusd_epi32(z, wv[1], bcast4(xq + 4));
  __m512i s2 = _mm512_dpbusd_epi32(z, wv[2], bcast4(xq + 8));
  __m512i s3 = _mm512_dpbusd_epi32(z, wv[3], bcast4(xq + 12));
  s0 = _mm512_dpbusd_epi32(s0, wv[4], bcast4(xq + 16));
  s1 = _mm512_dpbusd_epi32(s1, wv[5], bcast4(xq + 20));
  s2 = _mm512_dpbusd_epi32(s2, wv[6], bcast4(xq + 24));
  s3 = _mm512_dpbusd_epi32(s3, wv[7], bcast4(xq + 28));
  return _mm512_add_epi32(_mm512_add_epi32(s0, s1), _mm512_add_epi32(s2, s3));
}

// Rows [r0, r0 + MR) x group g with vpdpbusd; the same operations as tile_portable.
template <int KIND, int MR>
void tile_vnni(const QAct& a, int64_t r0, const QWeight& w, int64_t g, float (*acc_out)[16]) {
  const int64_t nb = a.nb;
  const uint8_t* qs = w.qs + g * nb * w.qbytes;
  const uint16_t* dg = w.d + g * nb * 16;
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F), high4 = _mm512_set1_epi8(int8_t(0xF0));
  auto half16 = [](const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  __m512 sup = _mm512_setzero_ps(), negmin = _mm512_setzero_ps();  // k4, k6: per 256
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = qs + b * w.qbytes;
    __m512 dw, mw = _mm512_setzero_ps();
    if constexpr (KIND == kK4 || KIND == kK5 || KIND == kK6) {
      if (b % 8 == 0) {  // a new super-block: its D (and k4/k5's -Dmin, an exact negation)
        const int64_t lanes = KIND == kK6 ? 16 : 32;
        const uint16_t* p = w.d + (g * (nb / 8) + b / 8) * lanes;
        sup = half16(p);
        if constexpr (KIND != kK6) {
          const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
          negmin = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(half16(p + 16)), sign));
        }
      }
    }
    if constexpr (KIND == kK4 || KIND == kK5) {  // D * sc, -(Dmin * mn) = -Dmin * mn: exact
      const uint8_t* sm = static_cast<const uint8_t*>(w.aux) + (g * nb + b) * 32;
      auto byte16 = [](const uint8_t* p) {
        return _mm512_cvtepi32_ps(
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
      };
      dw = _mm512_mul_ps(sup, byte16(sm));
      mw = _mm512_mul_ps(negmin, byte16(sm + 16));
    } else if constexpr (KIND == kK6) {
      dw = sup;
    } else {
      dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dg + b * 16)));
    }
    if constexpr (KIND == kK5) {
      // the 5-bit codes of u4's chunks, lanes as s8's (wv[2c]: values 8c + j, wv[2c + 1]:
      // 8c + 4 + j): low 4 bits from the nibbles, the fifth from H's bits 2c and 2c + 1
      __m512i wv[8];
      const __m512i n4 = _mm512_set1_epi8(0x0F), five = _mm512_set1_epi8(0x1F);
      const __m512i h = _mm512_loadu_si512(blk + 256);
      const __m512i hs[8] = {_mm512_slli_epi16(h, 4), _mm512_slli_epi16(h, 3),
                             _mm512_slli_epi16(h, 2), _mm512_slli_epi16(h, 1), h,
                             _mm512_srli_epi16(h, 1), _mm512_srli_epi16(h, 2),
                             _mm512_srli_epi16(h, 3)};  // bit e moved to bit 4
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(blk + c * 64);
        // (v & 0x0F) | (bit 4 of the shifted H), the bits above cleared (0xCA: A ? B : C)
        wv[2 * c] = _mm512_and_si512(_mm512_ternarylogic_epi32(n4, v, hs[2 * c], 0xCA), five);
        wv[2 * c + 1] = _mm512_and_si512(
            _mm512_ternarylogic_epi32(n4, _mm512_srli_epi16(v, 4), hs[2 * c + 1], 0xCA), five);
      }
      for (int r = 0; r < MR; ++r) {
        const __m512i isum = dot_block(wv, a.q + (r0 + r) * a.k + b * kQB);
        const __m512 sx = _mm512_set1_ps(a.s[(r0 + r) * nb + b]);
        const __m512 t = _mm512_fmadd_ps(mw, sx, _mm512_mul_ps(dw, _mm512_cvtepi32_ps(isum)));
        acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(a.d[(r0 + r) * nb + b]), acc[r]);
      }
    } else if constexpr (KIND == kK6) {
      const auto* scp = static_cast<const int8_t*>(w.aux) + (g * nb + b) * 32;
      auto int8x16 = [](const int8_t* p) {
        return _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
      };
      const __m512 sca = int8x16(scp), scb = int8x16(scp + 16);
      // the 6-bit codes of u4's chunks, lanes as s8's: wv[2c] the values 8c + j, wv[2c + 1]
      // the values 8c + 4 + j (j < 4): low 4 bits from the nibbles, high 2 from H0 / H1
      __m512i wv[8];
      const __m512i n4 = _mm512_set1_epi8(0x0F), six = _mm512_set1_epi8(0x3F);
      for (int p = 0; p < 2; ++p) {
        const __m512i h = _mm512_loadu_si512(blk + 256 + p * 64);
        for (int e = 0; e < 2; ++e) {
          const int c = 2 * p + e;
          const __m512i v = _mm512_loadu_si512(blk + c * 64);
          // high bits of the low set at 4e, of the high set at 4e + 2, moved to bits 4-5
          const __m512i hl = e ? h : _mm512_slli_epi16(h, 4);
          const __m512i hh = e ? _mm512_srli_epi16(h, 2) : _mm512_slli_epi16(h, 2);
          // (v & 0x0F) | (hl & ~0x0F), then the top two bits cleared (0xCA: A ? B : C)
          wv[2 * c] = _mm512_and_si512(_mm512_ternarylogic_epi32(n4, v, hl, 0xCA), six);
          wv[2 * c + 1] = _mm512_and_si512(
              _mm512_ternarylogic_epi32(n4, _mm512_srli_epi16(v, 4), hh, 0xCA), six);
        }
      }
      const __m512 k128 = _mm512_set1_ps(32.f);  // the codes' offset
      for (int r = 0; r < MR; ++r) {
        const int8_t* xq = a.q + (r0 + r) * a.k + b * kQB;
        __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
        __m512i b0 = _mm512_setzero_si512(), b1 = _mm512_setzero_si512();
        a0 = _mm512_dpbusd_epi32(a0, wv[0], bcast4(xq));
        a1 = _mm512_dpbusd_epi32(a1, wv[1], bcast4(xq + 4));
        b0 = _mm512_dpbusd_epi32(b0, wv[4], bcast4(xq + 16));
        b1 = _mm512_dpbusd_epi32(b1, wv[5], bcast4(xq + 20));
        a0 = _mm512_dpbusd_epi32(a0, wv[2], bcast4(xq + 8));
        a1 = _mm512_dpbusd_epi32(a1, wv[3], bcast4(xq + 12));
        b0 = _mm512_dpbusd_epi32(b0, wv[6], bcast4(xq + 24));
        b1 = _mm512_dpbusd_epi32(b1, wv[7], bcast4(xq + 28));
        const float hxs = a.h[(r0 + r) * nb + b];
        const __m512 hx = _mm512_set1_ps(hxs);
        const __m512 rest = _mm512_set1_ps(a.s[(r0 + r) * nb + b] - hxs);  // exact
        const __m512 fa = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1)),
                                        _mm512_mul_ps(k128, hx));
        const __m512 fb = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(b0, b1)),
                                        _mm512_mul_ps(k128, rest));
        const __m512 t = _mm512_mul_ps(dw, _mm512_fmadd_ps(sca, fa, _mm512_mul_ps(scb, fb)));
        acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(a.d[(r0 + r) * nb + b]), acc[r]);
      }
    } else if constexpr (KIND == kS8) {
      __m512i wv[8];  // q + 128
      for (int c = 0; c < 8; ++c) wv[c] = _mm512_loadu_si512(blk + c * 64);
      for (int r = 0; r < MR; ++r) {
        const __m512i s01 = dot_block(wv, a.q + (r0 + r) * a.k + b * kQB);
        const __m512 sx = _mm512_set1_ps(a.s[(r0 + r) * nb + b]);
        const __m512 isum = _mm512_sub_ps(_mm512_cvtepi32_ps(s01),
                                          _mm512_mul_ps(_mm512_set1_ps(128.f), sx));
        const __m512 t = _mm512_mul_ps(dw, isum);
        acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(a.d[(r0 + r) * nb + b]), acc[r]);
      }
    } else {
      __m512i lo[4], hi[4];  // hi: the high nibbles in place, i.e. 16 q
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(blk + c * 64);
        lo[c] = _mm512_and_si512(v, low4);
        hi[c] = _mm512_and_si512(v, high4);
      }
      if constexpr (KIND == kU4) {
        const auto* m = static_cast<const uint16_t*>(w.aux) + g * nb * 16;
        mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + b * 16)));
      }
      for (int r = 0; r < MR; ++r) {
        const int8_t* xq = a.q + (r0 + r) * a.k + b * kQB;
        // four chains of two (one row alone has no other work to hide their latency)
        const __m512i z = _mm512_setzero_si512();
        __m512i l0 = _mm512_dpbusd_epi32(z, lo[0], bcast4(xq));
        __m512i l1 = _mm512_dpbusd_epi32(z, lo[1], bcast4(xq + 8));
        __m512i h0 = _mm512_dpbusd_epi32(z, hi[0], bcast4(xq + 4));
        __m512i h1 = _mm512_dpbusd_epi32(z, hi[1], bcast4(xq + 12));
        l0 = _mm512_dpbusd_epi32(l0, lo[2], bcast4(xq + 16));
        l1 = _mm512_dpbusd_epi32(l1, lo[3], bcast4(xq + 24));
        h0 = _mm512_dpbusd_epi32(h0, hi[2], bcast4(xq + 20));
        h1 = _mm512_dpbusd_epi32(h1, hi[3], bcast4(xq + 28));
        const __m512i sl = _mm512_add_epi32(l0, l1), sh = _mm512_add_epi32(h0, h1);
        const __m512i isum = _mm512_add_epi32(sl, _mm512_srai_epi32(sh, 4));  // sh = 16 x its sum
        const __m512 sx = _mm512_set1_ps(a.s[(r0 + r) * nb + b]);
        __m512 t;
        if constexpr (KIND == kU4 || KIND == kK4) {
          t = _mm512_fmadd_ps(mw, sx, _mm512_mul_ps(dw, _mm512_cvtepi32_ps(isum)));
        } else {
          const __m512 diff = _mm512_sub_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(_mm512_set1_ps(8.f), sx));
          t = _mm512_mul_ps(dw, diff);
        }
        acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(a.d[(r0 + r) * nb + b]), acc[r]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(acc_out[r], acc[r]);
}

template <int KIND>
void tile_vnni_rows(const QAct& a, int64_t r0, int rows, const QWeight& w, int64_t g,
                    float (*acc)[16]) {
  switch (rows) {
    case 8: tile_vnni<KIND, 8>(a, r0, w, g, acc); break;
    case 7: tile_vnni<KIND, 7>(a, r0, w, g, acc); break;
    case 6: tile_vnni<KIND, 6>(a, r0, w, g, acc); break;
    case 5: tile_vnni<KIND, 5>(a, r0, w, g, acc); break;
    case 4: tile_vnni<KIND, 4>(a, r0, w, g, acc); break;
    case 3: tile_vnni<KIND, 3>(a, r0, w, g, acc); break;
    case 2: tile_vnni<KIND, 2>(a, r0, w, g, acc); break;
    default: tile_vnni<KIND, 1>(a, r0, w, g, acc); break;
  }
}
}  // namespace kvserve_gguf
#endif
