// Quantized KV writes for the CPU: one call per layer and K|V quantizes a step's new
// vectors with one float16 scale per (token, KV head) and stores codes and scales at their
// slots (replacing ~10 ATen ops and their temporaries). Registered as
// torch.ops.kvserve.quantize_kv; torch.ops.kvserve.write_kv stores a plain cache's K and V.
//
// int8: scale = max|x| / 127, code = round(x / scale) (round half to even).
// fp8 (e4m3fn, e5m2): the scale is the one of `candidates` scales
//   max|x| / fp8_max * 2^(i / candidates), i = 0 .. candidates-1,
// whose decoded vector is nearest to x (squared error; the first on a tie). A float
// format's error depends on where each element falls between two powers of two, so
// shifting the whole vector by a fraction of a binade picks the placement that rounds it
// best; the stored meaning (value = code * scale) is the same as with the plain scale.
//
// With a shift ([H, D] float32, K smoothing: kvserve/model/kv_smoothing.py) each vector is
// quantized as x - shift[h], the difference taken in float.
//
// Each (token, head) vector is quantized on its own: the result never depends on the
// batch, the chunking or the thread (the determinism rule of paged_attention.cpp).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "kv_tiles.h"
#include "float_convert.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

using kvserve_cpu::to_f;

inline uint32_t bits_of(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return u;
}
inline float float_of(uint32_t u) {
  float v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

// x / s rounded to float as an exact division would be, under -ffast-math (which turns a
// float division into a multiplication by a rounded reciprocal): bfloat16 inputs over
// float16 scales often land exactly between two fp8 or int8 values, and the rounded
// reciprocal breaks those ties upward (measured: +0.2 % perplexity) where PyTorch's exact
// quotient rounds them to even. In double the product is within 2^-52 of the quotient,
// which rounds to the same float for these inputs (at most 24 + 11 significant bits).
inline float quotient(float x, double inv_s) {
  return static_cast<float>(static_cast<double>(x) * inv_s);
}

// Round y (|y| <= the format's max) to an fp8 format with M mantissa bits and exponent bias
// B, round to nearest even: the code and the value it decodes to. Bit for bit what
// c10::Float8_e4m3fn / Float8_e5m2 construction gives for these inputs.
template <int M, int B>
inline float round_fp8(float y, uint8_t* code) {
  constexpr float kMinNormal = 1.f / static_cast<float>(1u << (B - 1));  // 2^(1-B)
  constexpr float kSubUnit = kMinNormal / static_cast<float>(1u << M);    // 2^(1-B-M)
  const uint32_t u = bits_of(y);
  const uint32_t sign = u & 0x80000000u;
  const uint32_t au = u & 0x7FFFFFFFu;
  const float a = float_of(au);
  // normal: drop 23 - M mantissa bits, to nearest even
  uint32_t ru = au + ((1u << (22 - M)) - 1u) + ((au >> (23 - M)) & 1u);
  ru &= ~((1u << (23 - M)) - 1u);
  const uint32_t ncode = (ru >> (23 - M)) - (static_cast<uint32_t>(127 - B) << M);
  // subnormal: a multiple of the smallest step (2^M of them reach the smallest normal)
  const float sq = std::nearbyint(a / kSubUnit);
  const bool normal = a >= kMinNormal;
  *code = static_cast<uint8_t>((sign >> 24) | (normal ? ncode : static_cast<uint32_t>(sq)));
  const float mag = normal ? float_of(ru) : sq * kSubUnit;
  return float_of(bits_of(mag) | sign);
}

#ifdef __AVX512F__
// |x| / sf rounded to fp8, 16 lanes (magnitudes, as floats). The quotient is x * RN(1/sf)
// corrected by one FMA step (Markstein): RN(x / sf) exactly, as quotient() gives, at
// float's width. Rounding to fp8 adds and takes away c = 2^(e + 23 - M) for an input of
// binade e (2^(1 - B + 23) at least, the subnormal step's): float addition rounds the sum
// to the format's step there, to nearest even, as round_fp8 does. The explicit rounding
// forms keep -ffast-math from folding (a + c) - c to a. `clamp`: whether |x / sf| can
// exceed qmax (only the first candidate's can).
template <int M, int B>
inline __m512 fp8_mag16(__m512 ax, __m512 vs, __m512 vr, __m512 vq, bool clamp) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 q0 = _mm512_mul_ps(ax, vr);
  __m512 a = _mm512_fmadd_ps(_mm512_fnmadd_ps(q0, vs, ax), vr, q0);
  if (clamp) a = _mm512_min_ps(a, vq);
  const __m512i c = _mm512_max_epi32(
      _mm512_add_epi32(_mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7F800000)),
                       _mm512_set1_epi32((23 - M) << 23)),
      _mm512_set1_epi32((1 - B - M + 23 + 127) << 23));
  const __m512 cf = _mm512_castsi512_ps(c);
  return _mm512_sub_round_ps(_mm512_add_round_ps(a, cf, kRound), cf, kRound);
}

// The squared error of scale sf's fp8 codes for x (D floats, D % 16 == 0), without keeping
// the codes. Magnitudes only: a code has its input's sign, so the error's square is the
// same.
template <int M, int B>
inline float fp8_error16(const float* x, int64_t D, float sf, float qmax, bool clamp) {
  const __m512 vs = _mm512_set1_ps(sf), vr = _mm512_set1_ps(1.f / sf), vq = _mm512_set1_ps(qmax);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 ax = _mm512_abs_ps(_mm512_loadu_ps(x + d));
    const __m512 e = _mm512_sub_ps(_mm512_mul_ps(fp8_mag16<M, B>(ax, vs, vr, vq, clamp), vs), ax);
    acc = _mm512_fmadd_ps(e, e, acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// The fp8 codes of x / sf (D % 16 == 0), as round_fp8 gives them: a normal magnitude's
// code is its float bits re-biased, a subnormal's its count of smallest steps; the sign is
// x's.
template <int M, int B>
inline void fp8_codes16(const float* x, int64_t D, float sf, float qmax, uint8_t* out) {
  const __m512 vs = _mm512_set1_ps(sf), vr = _mm512_set1_ps(1.f / sf), vq = _mm512_set1_ps(qmax);
  const __m512 units = _mm512_set1_ps(static_cast<float>(1u << (B - 1 + M)));
  const __m512 min_normal = _mm512_set1_ps(1.f / static_cast<float>(1u << (B - 1)));
  const __m512i rebias = _mm512_set1_epi32((127 - B) << M);
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 xv = _mm512_loadu_ps(x + d);
    const __m512 mag = fp8_mag16<M, B>(_mm512_abs_ps(xv), vs, vr, vq, true);
    const __m512i normal_code =
        _mm512_sub_epi32(_mm512_srli_epi32(_mm512_castps_si512(mag), 23 - M), rebias);
    const __m512i sub_code = _mm512_cvtps_epi32(_mm512_mul_ps(mag, units));
    __m512i code = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(mag, min_normal, _CMP_GE_OQ),
                                           sub_code, normal_code);
    code = _mm512_or_si512(code, _mm512_srli_epi32(
        _mm512_and_si512(_mm512_castps_si512(xv), _mm512_set1_epi32(INT32_MIN)), 24));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + d), _mm512_cvtepi32_epi8(code));
  }
}
#endif

// The float16 scale candidate i gives (never below float16's smallest normal: an all-zero
// vector gets that, not 0).
inline float fp8_scale(float amax, float qmax, float step) {
  const float raw = std::max(amax / qmax * step, 1e-8f);
  return std::max(static_cast<float>(c10::Half(raw)), 6.103515625e-05f);
}

template <int M, int B>
float fp8_vector(const float* x, int64_t D, float amax, float qmax, const std::vector<float>& steps,
                 uint8_t* out, uint8_t* tmp) {
  float best_err = 0.f, best_scale = 0.f;  // (-ffast-math: no infinities)
#ifdef __AVX512F__
  if (D % 16 == 0) {  // each candidate's error 16 lanes at a time, the winner's codes once
    best_scale = fp8_scale(amax, qmax, steps[0]);
    for (size_t i = 1; i < steps.size(); ++i) {
      if (i == 1) best_err = fp8_error16<M, B>(x, D, best_scale, qmax, true);
      const float sf = fp8_scale(amax, qmax, steps[i]);
      const float err = fp8_error16<M, B>(x, D, sf, qmax, false);
      if (err < best_err) best_err = err, best_scale = sf;
    }
    fp8_codes16<M, B>(x, D, best_scale, qmax, out);
    return best_scale;
  }
#endif
  for (size_t i = 0; i < steps.size(); ++i) {
    const float sf = fp8_scale(amax, qmax, steps[i]);
    const double inv = 1.0 / static_cast<double>(sf);
    float err = 0.f;
#pragma omp simd reduction(+ : err)
    for (int64_t d = 0; d < D; ++d) {
      const float y = std::min(std::max(quotient(x[d], inv), -qmax), qmax);
      const float e = round_fp8<M, B>(y, tmp + d) * sf - x[d];
      err += e * e;
    }
    if (i == 0 || err < best_err) {
      best_err = err, best_scale = sf;
      std::memcpy(out, tmp, D);
    }
  }
  return best_scale;
}

float int8_vector(const float* x, int64_t D, float amax, uint8_t* out) {
  const float sf = static_cast<float>(c10::Half(std::max(amax / 127.f, 1e-8f)));
  const double inv = sf > 0.f ? 1.0 / static_cast<double>(sf) : 0.0;  // 0: a zero vector
  for (int64_t d = 0; d < D; ++d) {
    const float y = std::min(std::max(quotient(x[d], inv), -127.f), 127.f);
    out[d] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(y)));
  }
  return sf;
}

// Where a quantized vector goes: rows (data [slots, H, D], scale [slots, H]) or tiles
// (kv_tiles.h: data [slots / 16, H, 16, D] in K's or V's order, scale [slots / 16, H, 16]).
struct Dest {
  uint8_t* data;
  c10::Half* scale;
  int64_t part;  // -1 rows; tiles: 0 K, 1 V
};

template <typename T>
void quantize_rows(const at::Tensor& x, const int64_t* slots, Dest dest, int64_t kind,
                   int64_t candidates, const float* shift) {
  const int64_t T_ = x.size(0), H = x.size(1), D = x.size(2), stride = x.stride(0);
  const T* xp = x.data_ptr<T>();
  std::vector<float> steps(candidates);  // the scale multipliers 2^(i / candidates)
  for (int64_t i = 0; i < candidates; ++i)
    steps[i] = std::exp2(static_cast<float>(i) / static_cast<float>(candidates));
  at::parallel_for(0, T_ * H, 16, [&](int64_t b, int64_t e) {
    std::vector<float> xf(D);
    std::vector<uint8_t> tmp(D), codes(D);
    for (int64_t i = b; i < e; ++i) {
      const int64_t t = i / H, h = i % H;
      const T* src = xp + t * stride + h * D;
      float amax = 0.f;
      for (int64_t d = 0; d < D; ++d) xf[d] = to_f(src[d]);
      if (shift != nullptr)
        for (int64_t d = 0; d < D; ++d) xf[d] -= shift[h * D + d];
      for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(xf[d]));
      const int64_t slot = slots[t];
      uint8_t* dst = dest.part < 0 ? dest.data + (slot * H + h) * D : codes.data();
      float sf;
      if (kind == 0)
        sf = int8_vector(xf.data(), D, amax, dst);
      else if (kind == 1)
        sf = fp8_vector<3, 7>(xf.data(), D, amax, 448.f, steps, dst, tmp.data());
      else
        sf = fp8_vector<2, 15>(xf.data(), D, amax, 57344.f, steps, dst, tmp.data());
      if (dest.part < 0) {
        dest.scale[slot * H + h] = c10::Half(sf);
        continue;
      }
      if (dest.part == 0) kvserve_tiles::put_k(dst, slot, h, H, D, dest.data);
      else kvserve_tiles::put_v(dst, slot, h, H, D, dest.data);
      dest.scale[kvserve_tiles::scale_index(slot, h, H)] = c10::Half(sf);
    }
  });
}

// x [T, H, D] (float, bfloat16 or float16; rows may be strided, heads contiguous), slots
// [T] int64; data [num_slots, H, D] uint8 (a view of the int8/fp8 cache's K or V part) and
// scale [num_slots, H] float16, or a tiled part (kv_tiles.h): data [num_slots / 16, H, 16, D]
// in the order of `part` (0 K, 1 V) and scale [num_slots / 16, H, 16]. kind: 0 int8,
// 1 fp8_e4m3fn, 2 fp8_e5m2; candidates: the number of fp8 scales tried (1 = max|x| /
// fp8_max only); shift: None, or float32 [H, D] subtracted from every vector first. Writes
// the codes and scales of `slots`.
void quantize_kv(const at::Tensor& x, const at::Tensor& slots, at::Tensor data, at::Tensor scale,
                 int64_t kind, int64_t candidates, const std::optional<at::Tensor>& shift,
                 int64_t part) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "quantize_kv: x must be [T, H, D] with contiguous heads");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.numel() == x.size(0), "quantize_kv: slots must be int64 [T]");
  const bool tiled = data.dim() == 4;
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() &&
                  (data.dim() == 3 || (tiled && data.size(2) == kvserve_tiles::TILE &&
                                       x.size(2) % 2 == 0 && (part == 0 || part == 1))) &&
                  data.size(1) == x.size(1) && data.size(-1) == x.size(2),
              "quantize_kv: data must be uint8 [slots, H, D], or [slots / 16, H, 16, D] (tiles, "
              "D even) with part 0 (K) or 1 (V)");
  const int64_t num_slots = data.size(0) * (tiled ? kvserve_tiles::TILE : 1);
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.is_contiguous() &&
                  scale.dim() == data.dim() - 1 && scale.numel() == num_slots * data.size(1),
              "quantize_kv: scale must be float16 [slots, H] ([slots / 16, H, 16] for tiles)");
  TORCH_CHECK(kind >= 0 && kind <= 2 && candidates >= 1, "quantize_kv: bad kind/candidates");
  const float* shp = nullptr;
  if (shift.has_value()) {
    TORCH_CHECK(shift->scalar_type() == at::kFloat && shift->is_contiguous() &&
                    shift->dim() == 2 && shift->size(0) == x.size(1) && shift->size(1) == x.size(2),
                "quantize_kv: shift must be float32 [H, D]");
    shp = shift->data_ptr<float>();
  }
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "quantize_kv: slot out of range");
  const Dest dest{data.data_ptr<uint8_t>(), scale.data_ptr<c10::Half>(), tiled ? part : -1};
  switch (x.scalar_type()) {
    case at::kFloat: return quantize_rows<float>(x, sp, dest, kind, candidates, shp);
    case at::kBFloat16: return quantize_rows<c10::BFloat16>(x, sp, dest, kind, candidates, shp);
    case at::kHalf: return quantize_rows<c10::Half>(x, sp, dest, kind, candidates, shp);
    default: TORCH_CHECK(false, "quantize_kv: unsupported dtype ", x.scalar_type());
  }
}

// k, v [T, H, D] (rows may be strided, heads contiguous), slots [T] int64, cache
// [2, num_slots, H, D] of k's dtype, contiguous: cache[0][slots[t]] = k[t] and
// cache[1][slots[t]] = v[t], as two index_copy_ calls would, in one call.
// A plain cache's K and V rows: cache [2, slots, H, D] (rows, copied) or
// [2, slots / 16, H, 16, D] of 16-bit elements (tiles: each slot's elements scattered into
// its tile's order, kv_tiles.h).
void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
              at::Tensor cache) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "write_kv: k and v must be [T, H, D]");
  for (const at::Tensor* x : {&k, &v})
    TORCH_CHECK(x->stride(2) == 1 && x->stride(1) == x->size(2) &&
                    x->scalar_type() == cache.scalar_type(),
                "write_kv: k and v need contiguous heads and the cache's dtype");
  const bool tiled = cache.dim() == 5;
  TORCH_CHECK((cache.dim() == 4 || (tiled && cache.size(3) == kvserve_tiles::TILE &&
                                    cache.element_size() == 2 && k.size(2) % 2 == 0)) &&
                  cache.size(0) == 2 && cache.is_contiguous() && cache.size(2) == k.size(1) &&
                  cache.size(-1) == k.size(2),
              "write_kv: cache must be contiguous [2, slots, H, D] or 16-bit "
              "[2, slots / 16, H, 16, D] (tiles, D even)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.numel() == k.size(0), "write_kv: slots must be int64 [T]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t n = cache.size(1) * (tiled ? kvserve_tiles::TILE : 1), T_ = k.size(0);
  for (int64_t t = 0; t < T_; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < n, "write_kv: slot out of range");
  const int64_t es = static_cast<int64_t>(cache.element_size()), row = k.size(1) * k.size(2) * es;
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(cache.data_ptr());
  char* vc = kc + n * row;
  const int64_t ks = k.stride(0) * es, vs = v.stride(0) * es, H = k.size(1), D = k.size(2);
  // A tiled slot's K is spread over D / 2 lines (one per dimension pair), each a miss when
  // a decode token opens its tile: two threads take half the tokens each (30 layers of
  // SmolLM2 at 32 tokens: 1.45 -> 0.77 ms a step; prefetching the lines did not help)
  at::parallel_for(0, T_, tiled ? 8 : 256, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      if (!tiled) {
        std::memcpy(kc + sp[t] * row, kp + t * ks, row);
        std::memcpy(vc + sp[t] * row, vp + t * vs, row);
        continue;
      }
      const auto* ksrc = reinterpret_cast<const uint16_t*>(kp + t * ks);
      const auto* vsrc = reinterpret_cast<const uint16_t*>(vp + t * vs);
      for (int64_t h = 0; h < H; ++h)
        kvserve_tiles::put_slot(ksrc + h * D, vsrc + h * D, sp[t], h, H, D,
                                reinterpret_cast<uint16_t*>(kc), reinterpret_cast<uint16_t*>(vc));
    }
  });
}

}  // namespace


namespace kvserve {  // entry points for C++ callers (ops.h)
void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
              at::Tensor cache) {
  ::write_kv(k, v, slots, std::move(cache));
}
void quantize_kv(const at::Tensor& x, const at::Tensor& slots, at::Tensor data,
                 at::Tensor scale, int64_t kind, int64_t candidates,
                 const std::optional<at::Tensor>& shift, int64_t part) {
  ::quantize_kv(x, slots, std::move(data), std::move(scale), kind, candidates, shift, part);
}
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("write_kv(Tensor k, Tensor v, Tensor slots, Tensor(a!) cache) -> ()");
  m.impl("write_kv", c10::DispatchKey::CPU, TORCH_FN(write_kv));
  m.def("quantize_kv(Tensor x, Tensor slots, Tensor(a!) data, Tensor(b!) scale, int kind, "
        "int candidates, Tensor? shift=None, int part=0) -> ()");
  m.impl("quantize_kv", c10::DispatchKey::CPU, TORCH_FN(quantize_kv));
}
