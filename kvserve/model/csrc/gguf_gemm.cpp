// GEMM over GGUF-quantized weights kept quantized: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// Weights (model/quantized.py repacks GGUF's Q4_0, Q4_1 and Q8_0 blocks once, at load) come
// in groups of 16 output rows, K in blocks of 32, in two kinds:
//   u4 (Q4_0, Q4_1): w = d * q + m, q in 0..15. qs [G][K/32][4 chunks][16 rows][4 bytes]:
//      chunk c, byte j of a row holds q[8c + j] (low nibble) and q[8c + 4 + j] (high);
//      d, m [G][K/32][16] fp16 (Q4_0: m = -8 d).
//   s8 (Q8_0): w = d * q, q int8. qs [G][K/32][8 chunks][16 rows][4 bytes] (chunk c holds
//      q[4c .. 4c + 3]); d [G][K/32][16] fp16; wsum [G][K/32][16] int16 = the block's sum of q.
// So one 64-byte load is 4 (or 8) consecutive K of 16 rows: the operand of vpdpbusd, with 4
// activation bytes broadcast to every lane; the 16 lanes are the 16 outputs of the group.
//
// Activations are quantized per row and block of 32 as llama.cpp's Q8_0 does: dx = amax *
// float(1/127), qx = round-to-nearest-even(x * (127 / amax)), and sx = the block's sum of qx. Per block b:
//   u4: isum = sum(q * qx) (u8 x s8);            t = dw * isum + mw * sx
//   s8: isum = sum((qx + 128) * q) - 128 * wsum; t = dw * isum
//   acc = fma(t, dx, acc)
// Contract (batch invariance): each output is one float accumulator that starts at zero and
// takes the blocks in order 0 .. K/32 - 1 with exactly these operations (explicit FMAs),
// then adds the bias, then rounds to the output dtype. The integer sums are exact, so
// neither M, nor which rows share a tile, nor the thread split changes a bit; the portable
// loop (no AVX512-VNNI, or gguf_gemm_use_vnni(false)) gives the same bits as the VNNI one.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "float_convert.h"


#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#include <immintrin.h>
#define KVSERVE_GGUF_VNNI 1
#endif

namespace {

using kvserve_cpu::from_f;
using kvserve_cpu::to_f;

constexpr int64_t kQB = 32;        // K per block
constexpr int64_t kRowChunk = 32;  // rows of x per work item
constexpr int kU4 = 0, kS8 = 1;

std::atomic<bool> g_use_vnni{true};

bool vnni_built() {
#ifdef KVSERVE_GGUF_VNNI
  return true;
#else
  return false;
#endif
}

// Sets whether the VNNI kernel runs where built; returns the previous setting (tests).
bool gguf_gemm_use_vnni(bool enable) { return g_use_vnni.exchange(enable); }

// The activations of one product, quantized (quantize_rows).
struct QAct {
  const int8_t* q;  // [M, K]
  const float* d;   // [M, K/32]
  const float* s;   // [M, K/32]
  int64_t k, nb;
};

struct QWeight {
  const uint8_t* qs;   // [G][nb][qbytes]
  const uint16_t* d;   // [G][nb][16] fp16 bits
  const void* aux;     // u4: m fp16 [G][nb][16]; s8: wsum int16 [G][nb][16]
  int64_t n, qbytes;
};

float half_to_f(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// One row: codes, scales and sums of its K/32 blocks.
template <typename T>
void quantize_row(const T* x, int64_t nb, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < nb; ++b) {
    float v[kQB], amax = 0.f;
    for (int i = 0; i < kQB; ++i) {
      v[i] = to_f(x[b * kQB + i]);
      amax = std::max(amax, std::fabs(v[i]));
    }
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int i = 0; i < kQB; ++i) {
      const int c = std::clamp(static_cast<int>(std::nearbyint(v[i] * id)), -127, 127);
      q[b * kQB + i] = static_cast<int8_t>(c);
      sum += c;
    }
    d[b] = amax * (1.f / 127.f);
    s[b] = static_cast<float>(sum);
  }
}

// Outputs [g*16, g*16 + 16) of `rows` rows: acc[r][16] + bias -> out.
template <typename O>
void store_rows(const float (*acc)[16], int rows, int64_t g, int64_t n, const float* bias,
                O* out, int64_t ldo) {
  const int64_t n0 = g * 16, cols = std::min<int64_t>(16, n - n0);
  for (int r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      const float v = bias ? acc[r][j] + bias[n0 + j] : acc[r][j];
      out[r * ldo + n0 + j] = from_f<O>(v);
    }
}

// The portable loop: rows [r0, r0 + rows) x group g.
template <int KIND>
void tile_portable(const QAct& a, int64_t r0, int rows, const QWeight& w, int64_t g,
                   float (*acc)[16]) {
  const int64_t nb = a.nb;
  const uint8_t* qs = w.qs + g * nb * w.qbytes;
  const uint16_t* dg = w.d + g * nb * 16;
  for (int r = 0; r < rows; ++r) {
    const int8_t* xq = a.q + (r0 + r) * a.k;
    const float* dx = a.d + (r0 + r) * nb;
    const float* sx = a.s + (r0 + r) * nb;
    for (int j = 0; j < 16; ++j) {
      float sum = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = qs + b * w.qbytes;
        const float dw = half_to_f(dg[b * 16 + j]);
        int32_t isum = 0;
        float t;
        if constexpr (KIND == kU4) {
          for (int c = 0; c < 4; ++c)
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = blk[c * 64 + j * 4 + i];
              isum += (byte & 15) * xq[b * kQB + 8 * c + i];
              isum += (byte >> 4) * xq[b * kQB + 8 * c + 4 + i];
            }
          const auto* m = static_cast<const uint16_t*>(w.aux) + g * nb * 16;
          t = dw * static_cast<float>(isum);
          t = std::fma(half_to_f(m[b * 16 + j]), sx[b], t);
        } else {
          const auto* q = reinterpret_cast<const int8_t*>(blk);
          for (int c = 0; c < 8; ++c)
            for (int i = 0; i < 4; ++i)
              isum += (xq[b * kQB + 4 * c + i] + 128) * q[c * 64 + j * 4 + i];
          const auto* ws = static_cast<const int16_t*>(w.aux) + g * nb * 16;
          t = dw * static_cast<float>(isum - 128 * ws[b * 16 + j]);
        }
        sum = std::fma(t, dx[b], sum);
      }
      acc[r][j] = sum;
    }
  }
}

#ifdef KVSERVE_GGUF_VNNI
inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Rows [r0, r0 + MR) x group g with vpdpbusd; the same operations as tile_portable.
template <int KIND, int MR>
void tile_vnni(const QAct& a, int64_t r0, const QWeight& w, int64_t g, float (*acc_out)[16]) {
  const int64_t nb = a.nb;
  const uint8_t* qs = w.qs + g * nb * w.qbytes;
  const uint16_t* dg = w.d + g * nb * 16;
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi32(int32_t(0x80808080u));
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = qs + b * w.qbytes;
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dg + b * 16)));
    if constexpr (KIND == kU4) {
      __m512i wv[8];
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(blk + c * 64);
        wv[2 * c] = _mm512_and_si512(v, low4);
        wv[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      const auto* m = static_cast<const uint16_t*>(w.aux) + g * nb * 16;
      const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + b * 16)));
      for (int r = 0; r < MR; ++r) {
        const int8_t* xq = a.q + (r0 + r) * a.k + b * kQB;
        __m512i isum = _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {
          isum = _mm512_dpbusd_epi32(isum, wv[2 * c], bcast4(xq + 8 * c));
          isum = _mm512_dpbusd_epi32(isum, wv[2 * c + 1], bcast4(xq + 8 * c + 4));
        }
        __m512 t = _mm512_mul_ps(dw, _mm512_cvtepi32_ps(isum));
        t = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[(r0 + r) * nb + b]), t);
        acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(a.d[(r0 + r) * nb + b]), acc[r]);
      }
    } else {
      __m512i wv[8];
      for (int c = 0; c < 8; ++c) wv[c] = _mm512_loadu_si512(blk + c * 64);
      const auto* ws = static_cast<const int16_t*>(w.aux) + g * nb * 16;
      const __m512i corr = _mm512_slli_epi32(
          _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws + b * 16))), 7);
      for (int r = 0; r < MR; ++r) {
        const int8_t* xq = a.q + (r0 + r) * a.k + b * kQB;
        __m512i isum = _mm512_setzero_si512();
        for (int c = 0; c < 8; ++c)
          isum = _mm512_dpbusd_epi32(isum, _mm512_xor_si512(bcast4(xq + 4 * c), flip), wv[c]);
        const __m512 t = _mm512_mul_ps(dw, _mm512_cvtepi32_ps(_mm512_sub_epi32(isum, corr)));
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
    case 4: tile_vnni<KIND, 4>(a, r0, w, g, acc); break;
    case 3: tile_vnni<KIND, 3>(a, r0, w, g, acc); break;
    case 2: tile_vnni<KIND, 2>(a, r0, w, g, acc); break;
    default: tile_vnni<KIND, 1>(a, r0, w, g, acc); break;
  }
}
#endif

template <int KIND, typename O>
void run(const QAct& a, int64_t m, const QWeight& w, const float* bias, O* out) {
  const int64_t groups = (w.n + 15) / 16, chunks = (m + kRowChunk - 1) / kRowChunk;
  const bool vnni = vnni_built() && g_use_vnni.load();
  // items: group-major within a chunk of rows, so a thread's run of items shares rows of x
  at::parallel_for(0, chunks * groups, 1, [&](int64_t begin, int64_t end) {
    float acc[4][16];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = item / groups, g = item % groups;
      const int64_t rend = std::min(m, (c + 1) * kRowChunk);
      for (int64_t r0 = c * kRowChunk; r0 < rend; r0 += 4) {
        const int rows = static_cast<int>(std::min<int64_t>(4, rend - r0));
#ifdef KVSERVE_GGUF_VNNI
        if (vnni) tile_vnni_rows<KIND>(a, r0, rows, w, g, acc);
        else tile_portable<KIND>(a, r0, rows, w, g, acc);
#else
        (void)vnni;
        tile_portable<KIND>(a, r0, rows, w, g, acc);
#endif
        store_rows<O>(acc, rows, g, w.n, bias, out + r0 * w.n, w.n);
      }
    }
  });
}

// x [M, K] (float32, bf16 or fp16; unit column stride), K a multiple of 32. Returns the
// quantized activations: codes int8 [M, K], scales and block sums float32 [M, K/32].
std::tuple<at::Tensor, at::Tensor, at::Tensor> gguf_quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % kQB == 0,
              "gguf_quantize_rows: x must be [M, K] with contiguous rows, K % 32 == 0");
  const int64_t m = x.size(0), k = x.size(1), nb = k / kQB;
  auto q = at::empty({m, k}, x.options().dtype(at::kChar));
  auto d = at::empty({m, nb}, x.options().dtype(at::kFloat));
  auto s = at::empty({m, nb}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gguf_q", [&] {
    const auto* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, m, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        quantize_row(xp + r * x.stride(0), nb, q.data_ptr<int8_t>() + r * k,
                     d.data_ptr<float>() + r * nb, s.data_ptr<float>() + r * nb);
    });
  });
  return {q, d, s};
}

// x [M, K] as gguf_quantize_rows takes it; qs, d, aux a repacked weight of `kind` (0: u4,
// 1: s8) with n outputs; bias [n] float32 or None. Returns [M, n] in x's dtype.
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                       const at::Tensor& aux, int64_t kind, int64_t n,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(kind == kU4 || kind == kS8, "gguf_linear: kind must be 0 (u4) or 1 (s8)");
  const int64_t qbytes = kind == kU4 ? 256 : 512;
  auto [q, dx, sx] = gguf_quantize_rows(x);
  const int64_t m = x.size(0), nb = x.size(1) / kQB, groups = (n + 15) / 16;
  TORCH_CHECK(qs.is_contiguous() && qs.scalar_type() == at::kByte && qs.dim() == 3 &&
                  qs.size(0) == groups && qs.size(1) == nb && qs.size(2) == qbytes,
              "gguf_linear: qs does not match x, n and kind");
  TORCH_CHECK(d.is_contiguous() && d.scalar_type() == at::kHalf && d.numel() == groups * nb * 16,
              "gguf_linear: d must be [G, K/32, 16] float16");
  TORCH_CHECK(aux.is_contiguous() && aux.numel() == groups * nb * 16 &&
                  aux.scalar_type() == (kind == kU4 ? at::kHalf : at::kShort),
              "gguf_linear: aux must be [G, K/32, 16] (float16 m for u4, int16 sums for s8)");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "gguf_linear: bias must be [n] float32");
    bp = bias->data_ptr<float>();
  }
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const QAct a{q.data_ptr<int8_t>(), dx.data_ptr<float>(), sx.data_ptr<float>(), x.size(1), nb};
  const QWeight w{qs.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr()),
                  aux.data_ptr(), n, qbytes};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gguf_linear", [&] {
    if (kind == kU4) run<kU4, scalar_t>(a, m, w, bp, out.data_ptr<scalar_t>());
    else run<kS8, scalar_t>(a, m, w, bp, out.data_ptr<scalar_t>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("gguf_gemm_vnni() -> bool", &vnni_built);
  m.def("gguf_gemm_use_vnni(bool enable) -> bool", &gguf_gemm_use_vnni);
  m.def("gguf_quantize_rows(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("gguf_linear(Tensor x, Tensor qs, Tensor d, Tensor aux, int kind, int n, Tensor? bias) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("gguf_quantize_rows", gguf_quantize_rows);
  m.impl("gguf_linear", gguf_linear);
}
