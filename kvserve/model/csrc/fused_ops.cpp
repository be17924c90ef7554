// Fused element-wise ops for the CPU decode/prefill path. Each replaces 5-10 small ATen ops
// (and their dispatch overhead and temporaries). Rounding follows the unfused PyTorch code
// exactly: every intermediate that PyTorch would store in the input dtype is rounded to it.
// Registered as torch.ops.kvserve.{rms_norm, add_rms_norm, silu_and_mul, rope, argmax_rows}. bf16
// norms and silu_and_mul run 16 lanes at a time on AVX-512-BF16 (silu with the attention
// kernels' exp).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "attention_cell.h"
#include "float_convert.h"
#include "rms16.h"
#include "ops.h"
#include "silu16.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using kvserve_cpu::from_f;
using kvserve_cpu::to_f;

template <typename T>
inline float rnd(float v) {  // round to T and back, as storing in a T tensor would
  return to_f(from_f<T>(v));
}


// out = w * T(x * rsqrt(mean(x^2) + eps)), statistics in float32 (HF LlamaRMSNorm). With
// `add`, first x += add (rounded to T, stored in x): the residual update and the norm of a
// row in one pass and one parallel region (x is written only then).
#ifdef KVSERVE_AVX512_BF16
// One bf16 row of rms_rows, 16 lanes at a time: the same roundings (the residual, then
// x * inv, then the product with w, each to bf16); the sum of squares in 16 lanes.
inline void rms_row_bf16(c10::BFloat16* x, const c10::BFloat16* add, const c10::BFloat16* w,
                         c10::BFloat16* out, int64_t n, float eps) {
  using kvserve_cpu::first_lanes;
  using kvserve_cpu::widen_bf16;
  const float ss = kvserve_cpu::add_sum_squares(x, add, n);
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(ss / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = first_lanes(n - i);
    const __m512 xv = widen_bf16(_mm256_maskz_loadu_epi16(m, x + i));
    const __m512 normed = widen_bf16((__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(xv, inv)));
    const __m512 wv = widen_bf16(_mm256_maskz_loadu_epi16(m, w + i));
    _mm256_mask_storeu_epi16(out + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(wv, normed)));
  }
}
#endif

// One row of n values: out = rms_norm(x) (with `add`: x += add first, stored in x).
template <typename T>
inline void rms_row(T* x, const T* add, const T* w, T* out, int64_t n, float eps) {
#ifdef KVSERVE_AVX512_BF16
  if constexpr (std::is_same_v<T, c10::BFloat16>) return rms_row_bf16(x, add, w, out, n, eps);
#endif
  const float ss = kvserve_cpu::add_sum_squares(x, add, n);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = from_f<T>(to_f(w[i]) * rnd<T>(to_f(x[i]) * inv));
}

template <typename T>
void rms_rows(T* x, const T* add, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      rms_row<T>(x + r * n, add ? add + r * n : nullptr, w, out + r * n, n, eps);
  });
}

// x contiguous, or [T, H, D] with unit stride in its last dimension (Qwen3's q/k views of
// the qkv projection's output: each head's row normed alone). Returns a new contiguous
// tensor of x's shape; a row's bits are the same in either layout.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(w.is_contiguous(), "rms_norm: contiguous inputs");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "rms_norm: dtype mismatch");
  TORCH_CHECK(x.is_contiguous() || (x.dim() == 3 && x.stride(2) == 1),
              "rms_norm: x must be contiguous, or [T, H, D] with contiguous rows");
  auto out = at::empty(x.sizes(), x.options());
  KVSERVE_DISPATCH_FLOAT(x.scalar_type(), "rms_norm", {
    const T* wp = w.data_ptr<T>();
    kvserve_cpu::each_row<T>(x, out, [&](T* xr, T* orow, int64_t n) {
      rms_row<T>(xr, nullptr, wp, orow, n, static_cast<float>(eps));
    });
  });
  return out;
}

// residual += x (rounded to T), returns rms_norm(residual).
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& w,
                        double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous(), "add_rms_norm: contiguous");
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_rms_norm: shape mismatch");
  auto out = at::empty_like(x);
  const int64_t n = x.size(-1), rows = x.numel() / n;
  KVSERVE_DISPATCH_FLOAT(x.scalar_type(), "add_rms_norm",
              rms_rows<T>(residual.data_ptr<T>(), x.data_ptr<T>(), w.data_ptr<T>(),
                          out.data_ptr<T>(), rows, n, static_cast<float>(eps)));
  return out;
}

#ifdef KVSERVE_AVX512_BF16
// One row, 16 lanes at a time: the same roundings as the scalar loop below (silu rounded to
// bf16, then the product), with the kernels' polynomial exp instead of libm's (~1 ulp).
inline void silu_mul_row_bf16(const c10::BFloat16* g, const c10::BFloat16* u,
                              c10::BFloat16* o, int64_t inter) {
  using kvserve_cpu::widen_bf16;
  for (int64_t i = 0; i < inter; i += 16) {
    const __mmask16 m = kvserve_cpu::first_lanes(inter - i);
    const __m512 prod = kvserve_cpu::silu_mul16(widen_bf16(_mm256_maskz_loadu_epi16(m, g + i)),
                                                widen_bf16(_mm256_maskz_loadu_epi16(m, u + i)));
    _mm256_mask_storeu_epi16(o + i, m, (__m256i)_mm512_cvtneps_pbh(prod));
  }
}
#endif

template <typename T>
void silu_mul_rows(const T* in, T* op, int64_t rows, int64_t inter) {
#ifdef KVSERVE_AVX512_BF16
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        silu_mul_row_bf16(in + r * 2 * inter, in + r * 2 * inter + inter, op + r * inter, inter);
    });
    return;
  }
#endif
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    std::vector<float> buf(inter);
    for (int64_t r = b; r < e; ++r) {
      const T* g = in + r * 2 * inter;
      const T* u = g + inter;
      T* o = op + r * inter;
      float* f = buf.data();
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) f[i] = to_f(g[i]);
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) f[i] = f[i] / (1.f + std::exp(-f[i]));
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) o[i] = from_f<T>(rnd<T>(f[i]) * to_f(u[i]));
    }
  });
}

// gate_up [T, 2I] → T(T(silu(gate)) * up) [T, I]
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.dim() == 2, "silu_and_mul: 2-D contiguous");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({rows, inter}, gate_up.options());
  KVSERVE_DISPATCH_FLOAT(gate_up.scalar_type(), "silu_and_mul",
              silu_mul_rows<T>(gate_up.data_ptr<T>(), out.data_ptr<T>(), rows, inter));
  return out;
}

#ifdef KVSERVE_AVX512_BF16
// One bf16 head of rope_rows, 16 lanes at a time: the same roundings (each product to bf16,
// then the sum); x1 * c - x2 * s as a1 - bf16(x2 * s), which is a1 + bf16(-x2 * s) exactly.
inline void rope_head_bf16(c10::BFloat16* x, const c10::BFloat16* c, const c10::BFloat16* s,
                           int64_t half) {
  using kvserve_cpu::first_lanes;
  using kvserve_cpu::widen_bf16;
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = first_lanes(half - i);
    const auto load = [&](const c10::BFloat16* p) {
      return widen_bf16(_mm256_maskz_loadu_epi16(m, p));
    };
    const auto round = [](__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); };
    const __m512 x1 = load(x + i), x2 = load(x + i + half);
    const __m512 a1 = widen_bf16(round(_mm512_mul_ps(x1, load(c + i))));
    const __m512 b1 = widen_bf16(round(_mm512_mul_ps(x2, load(s + i))));
    const __m512 a2 = widen_bf16(round(_mm512_mul_ps(x2, load(c + i + half))));
    const __m512 b2 = widen_bf16(round(_mm512_mul_ps(x1, load(s + i + half))));
    _mm256_mask_storeu_epi16(x + i, m, round(_mm512_sub_ps(a1, b1)));
    _mm256_mask_storeu_epi16(x + i + half, m, round(_mm512_add_ps(a2, b2)));
  }
}
#endif

template <typename T>
void rope_rows(T* base, int64_t stride_t, int64_t heads, int64_t D, const T* c, const T* s) {
  const int64_t half = D / 2;
#ifdef KVSERVE_AVX512_BF16
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (int64_t h = 0; h < heads; ++h) rope_head_bf16(base + h * D, c, s, half);
    return;
  }
#endif
  for (int64_t h = 0; h < heads; ++h) {
    T* x = base + h * D;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
      const float a1 = rnd<T>(x1 * to_f(c[i]));
      const float b1 = rnd<T>(-x2 * to_f(s[i]));
      const float a2 = rnd<T>(x2 * to_f(c[i + half]));
      const float b2 = rnd<T>(x1 * to_f(s[i + half]));
      x[i] = from_f<T>(a1 + b1);
      x[i + half] = from_f<T>(a2 + b2);
    }
  }
}

template <typename T>
void rope_impl(const int64_t* pos, at::Tensor& q, at::Tensor& k, const T* cp, const T* sp) {
  const int64_t D = q.size(2);
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  at::parallel_for(0, q.size(0), 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const T* c = cp + pos[t] * D;
      const T* s = sp + pos[t] * D;
      rope_rows<T>(qp + t * q.stride(0), q.stride(0), q.size(1), D, c, s);
      rope_rows<T>(kp + t * k.stride(0), k.stride(0), k.size(1), D, c, s);
    }
  });
}

// In place on q [T, Hq, D] and k [T, Hk, D] (row stride may exceed H*D: views of a fused
// QKV output), "rotate half" layout: x*cos + rotate(x)*sin, each product rounded to T.
at::Tensor rope(const at::Tensor& positions, at::Tensor q, at::Tensor k, const at::Tensor& cos,
                const at::Tensor& sin) {
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) &&
                  k.stride(1) == k.size(2),
              "rope: heads must be contiguous");
  TORCH_CHECK(cos.scalar_type() == q.scalar_type() && cos.is_contiguous() && sin.is_contiguous(),
              "rope: cos/sin must be contiguous in the query dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "rope: positions must be contiguous int64");
  const int64_t* pos = positions.data_ptr<int64_t>();
  KVSERVE_DISPATCH_FLOAT(q.scalar_type(), "rope",
              rope_impl<T>(pos, q, k, cos.data_ptr<T>(), sin.data_ptr<T>()));
  return q;
}

#ifdef KVSERVE_AVX512_BF16
// 16 values of a row from x + i (lanes past `live` are -inf), widened to float.
inline __m512 argmax_load(const float* x, __mmask16 live) {
  return _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, x);
}
inline __m512 argmax_load(const c10::BFloat16* x, __mmask16 live) {
  return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live,
                            kvserve_cpu::widen_bf16(_mm256_maskz_loadu_epi16(live, x)));
}
#endif

// Index of the first maximum of x[0, n) (n >= 1), as torch.argmax: a NaN counts as the
// maximum (the first NaN wins); an all -inf row gives 0. A bf16 row gives the index its
// float32 conversion (exact) would.
template <typename T>
inline int64_t argmax_row(const T* x, int64_t n) {
#ifdef KVSERVE_AVX512_BF16
  const __m512i step = _mm512_set1_epi32(16);
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), inf_bits = _mm512_set1_epi32(0x7F800000);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i best_idx = idx;
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = argmax_load(x + i, kvserve_cpu::first_lanes(n - i));
    nan |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), abs_mask), inf_bits);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strictly: first wins
    best = _mm512_mask_mov_ps(best, gt, v);
    best_idx = _mm512_mask_mov_epi32(best_idx, gt, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  if (nan == 0) {
    const float top = _mm512_reduce_max_ps(best);
    const __mmask16 at = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    const __m512i cand = _mm512_mask_mov_epi32(_mm512_set1_epi32(INT32_MAX), at, best_idx);
    return _mm512_reduce_min_epi32(cand);
  }
#endif
  int64_t arg = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_f(x[i]);
    if (kvserve_cpu::is_nan(v)) return i;
    if (v > to_f(x[arg])) arg = i;
  }
  return arg;
}

// x [R, V] float32 or bf16 with unit column stride, V >= 1 (V < 2^31) -> int64 [R]: each
// row's torch.argmax, rows in parallel.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.stride(1) == 1,
              "argmax_rows: x must be [R, V] float32 or bf16 with contiguous rows");
  TORCH_CHECK(x.size(1) >= 1 && x.size(1) < INT32_MAX, "argmax_rows: bad row length");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const auto each_row = [&](const auto* xp) {
    at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) op[r] = argmax_row(xp + r * stride, n);
    });
  };
  if (x.scalar_type() == at::kFloat) each_row(x.data_ptr<float>());
  else each_row(x.data_ptr<c10::BFloat16>());
  return out;
}

}  // namespace


namespace kvserve {  // entry points for C++ callers (ops.h)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return ::rms_norm(x, w, eps);
}
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& w,
                        double eps) {
  return ::add_rms_norm(x, std::move(residual), w, eps);
}
void rope(const at::Tensor& positions, at::Tensor q, at::Tensor k, const at::Tensor& cos,
          const at::Tensor& sin) {
  ::rope(positions, std::move(q), std::move(k), cos, sin);
}
at::Tensor silu_and_mul(const at::Tensor& gate_up) { return ::silu_and_mul(gate_up); }
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor w, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rope(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.impl("silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(silu_and_mul));
  m.impl("rope", c10::DispatchKey::CPU, TORCH_FN(rope));
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.impl("argmax_rows", c10::DispatchKey::CPU, TORCH_FN(argmax_rows));
}
