// Paged decode attention for the CPU: one query token per sequence, K/V read in place from
// the block cache (no gathered copy), float accumulation, GQA-aware (each KV head's rows are
// read once for all query heads that share it). Registered as torch.ops.kvserve.paged_decode.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

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
inline float load(const c10::Float8_e4m3fn* p, int64_t i) { return static_cast<float>(p[i]); }
inline float load(const c10::Float8_e5m2* p, int64_t i) { return static_cast<float>(p[i]); }
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(c10::Half* p, int64_t i, float v) { p[i] = c10::Half(v); }
inline void store(c10::BFloat16* p, int64_t i, float v) { p[i] = c10::BFloat16(v); }

// One (sequence, KV head) item at a time: a single pass over the sequence's tokens in
// chunks of 16 with an online softmax. Each K row is converted to float once and dotted
// with every query head of its group; V rows of a chunk are converted once and accumulated
// into per-head registers (D is a compile-time constant so the accumulators stay in
// registers; loop-carried sums through memory were the bottleneck of a naive version).
template <int D, typename qt, typename ct>
void decode_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out,
                   double scale, int64_t window, int64_t sinks, Scales scales) {
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
  constexpr int64_t CH = 16;
  const int64_t B = q.size(0), Hq = q.size(1);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = Hq / Hkv, MB = tables.size(1);
  const qt* qp = q.data_ptr<qt>();
  const ct* kp = k_cache.data_ptr<ct>();
  const ct* vp = v_cache.data_ptr<ct>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  qt* op = out.data_ptr<qt>();
  const int64_t row = Hkv * D;  // elements per cache slot
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), sc(G * CH), m(G), l(G);
    alignas(64) float krow[D];
    alignas(64) float vrows[CH][D];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      const float k_head_scale = scales.k_head ? scales.k_head[h] : 1.f;
      const float v_head_scale = scales.v_head ? scales.v_head[h] : 1.f;
      const int64_t len = lp[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      // attention sinks: the first tokens stay visible below the window
      const int64_t sink_end = std::min(sinks, start);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = load(qp, (b * Hq + h * G + g) * D + d) * static_cast<float>(scale);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t c0 = sink_end > 0 ? 0 : start; c0 < len;) {
        // a chunk never crosses a block boundary (nor the end of the sinks)
        const int64_t block_end = (c0 / BS + 1) * BS;
        const int64_t stop = c0 < sink_end ? sink_end : len;
        const int64_t nt = std::min({CH, stop - c0, block_end - c0});
        const int64_t slot0 = tp[b * MB + c0 / BS] * BS + c0 % BS;
        for (int64_t t = 0; t < nt; ++t) {
          const ct* src = kp + (slot0 + t) * row + h * D;
          const float ks =
              scales.k ? static_cast<float>(scales.k[(slot0 + t) * Hkv + h]) : k_head_scale;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) krow[d] = load(src, d) * ks;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += qg[d] * krow[d];
            sc[g * CH + t] = s;
          }
        }
        for (int64_t t = 0; t < nt; ++t) {
          const ct* src = vp + (slot0 + t) * row + h * D;
          const float vs =
              scales.v ? static_cast<float>(scales.v[(slot0 + t) * Hkv + h]) : v_head_scale;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) vrows[t][d] = load(src, d) * vs;
        }
        for (int64_t g = 0; g < G; ++g) {
          float* s = sc.data() + g * CH;
          float bm = m[g];
          for (int64_t t = 0; t < nt; ++t) bm = std::max(bm, s[t]);
          const float corr = std::exp(m[g] - bm);
          float sum = l[g] * corr;
          for (int64_t t = 0; t < nt; ++t) {
            s[t] = std::exp(s[t] - bm);
            sum += s[t];
          }
          l[g] = sum;
          m[g] = bm;
          float* ag = acc.data() + g * D;
          // 16 lanes at a time: one accumulator register, a dependency chain over t only
          for (int64_t d0 = 0; d0 < D; d0 += 16) {
            float a[16];
#pragma omp simd
            for (int64_t i = 0; i < 16; ++i) a[i] = ag[d0 + i] * corr;
            for (int64_t t = 0; t < nt; ++t) {
              const float p = s[t];
#pragma omp simd
              for (int64_t i = 0; i < 16; ++i) a[i] += p * vrows[t][d0 + i];
            }
#pragma omp simd
            for (int64_t i = 0; i < 16; ++i) ag[d0 + i] = a[i];
          }
        }
        c0 += nt;
        if (c0 == sink_end) c0 = std::max(c0, start);
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          store(op, (b * Hq + h * G + g) * D + d, acc[g * D + d] / l[g]);
    }
  });
}

template <typename qt, typename ct>
void dispatch_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& t, const at::Tensor& l, at::Tensor& o, double s, int64_t w,
                  int64_t sk, Scales sc) {
  switch (q.size(2)) {
    case 16: return decode_kernel<16, qt, ct>(q, k, v, t, l, o, s, w, sk, sc);
    case 32: return decode_kernel<32, qt, ct>(q, k, v, t, l, o, s, w, sk, sc);
    case 64: return decode_kernel<64, qt, ct>(q, k, v, t, l, o, s, w, sk, sc);
    case 80: return decode_kernel<80, qt, ct>(q, k, v, t, l, o, s, w, sk, sc);
    case 96: return decode_kernel<96, qt, ct>(q, k, v, t, l, o, s, w, sk, sc);
    case 128: return decode_kernel<128, qt, ct>(q, k, v, t, l, o, s, w, sk, sc);
    case 256: return decode_kernel<256, qt, ct>(q, k, v, t, l, o, s, w, sk, sc);
    default: TORCH_CHECK(false, "paged_decode: unsupported head_dim ", q.size(2));
  }
}

template <typename qt>
void dispatch_cache(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& t, const at::Tensor& l, at::Tensor& o, double s,
                    int64_t w, int64_t sk, Scales sc) {
  switch (k.scalar_type()) {
    case at::kFloat: return dispatch_dim<qt, float>(q, k, v, t, l, o, s, w, sk, sc);
    case at::kBFloat16: return dispatch_dim<qt, c10::BFloat16>(q, k, v, t, l, o, s, w, sk, sc);
    case at::kHalf: return dispatch_dim<qt, c10::Half>(q, k, v, t, l, o, s, w, sk, sc);
    case at::kChar: return dispatch_dim<qt, int8_t>(q, k, v, t, l, o, s, w, sk, sc);
    case at::kFloat8_e4m3fn:
      return dispatch_dim<qt, c10::Float8_e4m3fn>(q, k, v, t, l, o, s, w, sk, sc);
    case at::kFloat8_e5m2:
      return dispatch_dim<qt, c10::Float8_e5m2>(q, k, v, t, l, o, s, w, sk, sc);
    default: TORCH_CHECK(false, "paged_decode: unsupported cache dtype ", k.scalar_type());
  }
}

// q [B, Hq, D]; caches [num_blocks, block_size, Hkv, D]; tables [B, max_blocks] int64;
// lens [B] int64 (context length incl. the new token); window <= 0 means no window;
// with a window, the first `sinks` positions are attended as well. An int8 cache comes with
// float16 scales [slots, kv_heads] per token and head (k_scale, v_scale), an fp8 cache with
// float32 scales [kv_heads].
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& tables,
                        const at::Tensor& lens, double scale, int64_t window,
                        int64_t sinks, const std::optional<at::Tensor>& k_scale,
                        const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "paged_decode: bad rank");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_decode: CPU only");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "paged_decode: heads not divisible");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong,
              "paged_decode: tables/lens must be int64");
  auto qc = q.contiguous();
  auto kc = k_cache.contiguous();
  auto vc = v_cache.contiguous();
  auto tc = tables.contiguous();
  auto lc = lens.contiguous();
  auto out = at::empty_like(qc);
  Scales scales;
  at::Tensor ksc, vsc;  // keep contiguous copies alive for the call
  if (kc.scalar_type() == at::kChar) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value(),
                "paged_decode: an int8 cache needs k_scale and v_scale");
    ksc = k_scale->contiguous();
    vsc = v_scale->contiguous();
    TORCH_CHECK(ksc.scalar_type() == at::kHalf && vsc.scalar_type() == at::kHalf,
                "paged_decode: scales must be float16 [slots, kv_heads]");
    TORCH_CHECK(ksc.numel() == kc.size(0) * kc.size(1) * kc.size(2) &&
                vsc.numel() == ksc.numel(), "paged_decode: scale shape mismatch");
    scales.k = ksc.data_ptr<c10::Half>();
    scales.v = vsc.data_ptr<c10::Half>();
  } else if (kc.scalar_type() == at::kFloat8_e4m3fn || kc.scalar_type() == at::kFloat8_e5m2) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value(),
                "paged_decode: an fp8 cache needs k_scale and v_scale");
    ksc = k_scale->contiguous();
    vsc = v_scale->contiguous();
    TORCH_CHECK(ksc.scalar_type() == at::kFloat && vsc.scalar_type() == at::kFloat &&
                ksc.numel() == kc.size(2) && vsc.numel() == kc.size(2),
                "paged_decode: fp8 scales must be float32 [kv_heads]");
    scales.k_head = ksc.data_ptr<float>();
    scales.v_head = vsc.data_ptr<float>();
  }
  switch (qc.scalar_type()) {
    case at::kFloat: dispatch_cache<float>(qc, kc, vc, tc, lc, out, scale, window, sinks, scales); break;
    case at::kBFloat16: dispatch_cache<c10::BFloat16>(qc, kc, vc, tc, lc, out, scale, window, sinks, scales); break;
    case at::kHalf: dispatch_cache<c10::Half>(qc, kc, vc, tc, lc, out, scale, window, sinks, scales); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported query dtype ", qc.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor lens, "
        "float scale, int window, int sinks=0, Tensor? k_scale=None, "
        "Tensor? v_scale=None) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}
