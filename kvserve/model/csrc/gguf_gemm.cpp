// GEMM over GGUF-quantized weights kept quantized: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// Weights (model/quantized.py repacks GGUF's Q4_0, Q4_1 and Q8_0 blocks once, at load) come
// in groups of 16 output rows, K in blocks of 32, in three kinds:
//   u4 (Q4_1): w = d * q + m, q in 0..15. qs [G][K/32][4 chunks][16 rows][4 bytes]: chunk
//      c, byte j of a row holds q[8c + j] (low nibble) and q[8c + 4 + j] (high nibble);
//      d, m [G][K/32][16] fp16.
//   z4 (Q4_0): w = d * (q - 8), qs as u4; d [G][K/32][16] fp16, no m.
//   s8 (Q8_0): w = d * q, q int8, stored as q + 128 (unsigned bytes). qs [G][K/32][8
//      chunks][16 rows][4 bytes] (chunk c holds q[4c .. 4c + 3]); d [G][K/32][16] fp16.
//   k4 (Q4_K): w = (D * sc) * q - Dmin * mn, q in 0..15, qs as u4; per block of 32 a 6-bit
//      scale sc and min mn, aux [G][K/32][32] uint8 (lanes 0-15 sc, 16-31 mn); per 256 the
//      fp16 D and Dmin, d [G][K/256][32] (lanes 0-15 D, 16-31 Dmin). The block's dw = D * sc
//      and mw = -(Dmin * mn) are exact float products, then it runs as u4.
//   k5 (Q5_K): k4 with a fifth bit, q in 0..31: qs [G][K/32][320], u4's 256 bytes of low 4
//      bits, then one 64-byte vector H [16 rows][4 bytes]: bit 2c of byte j holds q[8c + j]'s
//      fifth bit, bit 2c + 1 q[8c + 4 + j]'s (the lanes of u4's chunk c); d and aux as k4's.
//   k6 (Q6_K): w = D * sc * (q - 32), q in 0..63 in 6 bits: qs [G][K/32][384], the low 4
//      bits as u4's 256 bytes, then the high 2 bits in two 64-byte vectors H0, H1 [16 rows][4
//      bytes]: byte j of a row in Hp holds, from bit 0 up, those of q[16p + j], q[16p + 4 + j],
//      q[16p + 8 + j] and q[16p + 12 + j] (the lanes of u4's chunks 2p and 2p + 1); per 16
//      values an int8 scale, aux [G][K/32][32] int8 (lanes 0-15 the block's first 16
//      values' scale, 16-31 its last 16's); per 256 the fp16 D, d [G][K/256][16].
// So one 64-byte load is 4 (or 8) consecutive K of 16 rows: the operand of vpdpbusd, with 4
// activation bytes broadcast to every lane; the 16 lanes are the 16 outputs of the group.
//
// Activations are quantized per row and block of 32 as llama.cpp's Q8_0 does: dx = amax *
// float(1/127), qx = round-to-nearest-even(x * (127 / amax)), and sx = the block's sum of qx.
// Per block b, with isum = sum(q * qx) computed exactly in integers (u4/z4: low and high
// nibbles in two vpdpbusd chains, the high one against q * 16, shifted back; s8: the
// stored q + 128 against qx, less 128 sx, an exact float difference):
//   u4, k4, k5: t = fma(mw, sx, dw * isum)  z4: t = dw * (isum - 8 sx)      s8: t = dw * isum
//   k6: with ia, ib the exact sums of (q - 32) qx over the block's two halves (q qx less 32
//      times qx's sums; hx the first half's),
//      t = D * fma(sca, ia, scb * ib), every step before the product by D exact
// The activations are always vpdpbusd's signed operand, so their 4 bytes are broadcast
// from memory within the instruction.
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
#include <vector>

#include "float_convert.h"
#include "gguf_act.h"
#include "gguf_amx.h"
#include "gguf_blocks.h"
#include "gguf_tile_vnni.h"
#include "gguf_c8.h"

namespace {

using namespace kvserve_gguf;  // NOLINT: this file is the blocks' one user
using kvserve_cpu::from_f;
using kvserve_cpu::to_f;

constexpr int64_t kRowChunk = 256;  // rows of x per work item
constexpr int64_t kRowTile = 8;     // rows sharing one pass over a group's weights
constexpr int64_t kL2Weights = 512 * 1024;  // bytes of a work item's groups (kept in L2)

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
        float dw, mw = 0.f;
        if constexpr (KIND == kK4 || KIND == kK5) k4_scales(w, nb, g, b, j, dw, mw);
        else if constexpr (KIND == kK6) dw = half_to_f(w.d[(g * (nb / 8) + b / 8) * 16 + j]);
        else dw = half_to_f(dg[b * 16 + j]);
        int32_t isum = 0;
        float t;
        if constexpr (KIND == kK6) {
          int32_t ia = 0, ib = 0;  // q in 0..63
          for (int c = 0; c < 4; ++c)
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = blk[c * 64 + j * 4 + i];
              const uint8_t hb = blk[256 + (c / 2) * 64 + j * 4 + i];
              const int sh = 4 * (c % 2);
              const int qlo = (byte & 15) | (((hb >> sh) & 3) << 4);
              const int qhi = (byte >> 4) | (((hb >> (sh + 2)) & 3) << 4);
              (c < 2 ? ia : ib) += qlo * xq[b * kQB + 8 * c + i] + qhi * xq[b * kQB + 8 * c + 4 + i];
            }
          const auto* sc = static_cast<const int8_t*>(w.aux) + (g * nb + b) * 32;
          const float hx = a.h[(r0 + r) * nb + b];
          const float fa = static_cast<float>(ia) - 32.f * hx;  // exact differences
          const float fb = static_cast<float>(ib) - 32.f * (sx[b] - hx);
          t = dw * std::fma(static_cast<float>(sc[j]), fa, static_cast<float>(sc[16 + j]) * fb);
        } else if constexpr (KIND == kS8) {
          for (int c = 0; c < 8; ++c)
            for (int i = 0; i < 4; ++i)  // blk holds q + 128
              isum += blk[c * 64 + j * 4 + i] * xq[b * kQB + 4 * c + i];
          t = dw * (static_cast<float>(isum) - 128.f * sx[b]);  // exact difference
        } else {
          for (int c = 0; c < 4; ++c)
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = blk[c * 64 + j * 4 + i];
              isum += (byte & 15) * xq[b * kQB + 8 * c + i];
              isum += (byte >> 4) * xq[b * kQB + 8 * c + 4 + i];
              if constexpr (KIND == kK5) {  // the fifth bits
                const uint8_t hb = blk[256 + j * 4 + i];
                isum += (((hb >> (2 * c)) & 1) << 4) * xq[b * kQB + 8 * c + i];
                isum += (((hb >> (2 * c + 1)) & 1) << 4) * xq[b * kQB + 8 * c + 4 + i];
              }
            }
          if constexpr (KIND == kU4 || KIND == kK4 || KIND == kK5) {
            if constexpr (KIND == kU4)
              mw = half_to_f(static_cast<const uint16_t*>(w.aux)[(g * nb + b) * 16 + j]);
            t = dw * static_cast<float>(isum);
            t = std::fma(mw, sx[b], t);
          } else {
            t = dw * (static_cast<float>(isum) - 8.f * sx[b]);  // exact difference
          }
        }
        sum = std::fma(t, dx[b], sum);
      }
      acc[r][j] = sum;
    }
  }
}


// Runs tile(r0, rows, u) over every row tile of RT rows and every unit u < units (a group,
// or a pair of groups), item by item in parallel: an item is a chunk of up to rc rows times
// a span of units whose weights stay in L2 while every row tile of the chunk passes over
// them. Each thread calls done() after its items. Which item, tile or thread computes a
// row changes none of its bits.
template <int64_t RT, class Tile, class Done>
void each_tile(int64_t m, int64_t rc, int64_t units, int64_t span, const Tile& tile,
               const Done& done) {
  const int64_t chunks = (m + rc - 1) / rc, spans = (units + span - 1) / span;
  at::parallel_for(0, chunks * spans, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = item / spans, u0 = item % spans * span;
      const int64_t rend = std::min(m, (c + 1) * rc), uend = std::min(units, u0 + span);
      for (int64_t r0 = c * rc; r0 < rend; r0 += RT) {
        const int rows = static_cast<int>(std::min<int64_t>(RT, rend - r0));
        for (int64_t u = u0; u < uend; ++u) tile(r0, rows, u);
      }
    }
    done();
  });
}

// The s8 and c8 kinds on AMX-INT8 tiles (gguf_amx.h): 32 rows x a pair of groups a tile
// pass. Spans, then chunks, narrow until each thread has 4 items where the product allows
// (a MoE expert's 576 x 768 at 256 rows was 3 items: one thread did two). The same bits as
// the VNNI tile's.
template <typename O>
void run_amx(int kind, const QAct& a, int64_t m, const QWeight& w, const float* bias, O* out) {
  const int64_t groups = (w.n + 15) / 16, pairs = (groups + 1) / 2;
  int64_t span = std::clamp<int64_t>(kL2Weights / (2 * a.nb * (w.qbytes + 64)), 1, 8);
  int64_t rc = kRowChunk;  // a multiple of kAmxRows
  const int64_t want = 4 * at::get_num_threads();
  auto items = [&] { return (m + rc - 1) / rc * ((pairs + span - 1) / span); };
  while (items() < want && span > 1) span = (span + 1) / 2;
  while (items() < want && rc > kAmxRows) rc /= 2;
  each_tile<kAmxRows>(m, rc, pairs, span, [&](int64_t r0, int rows, int64_t p) {
    float acc[kAmxGroups][kAmxRows][16];
    const int ng = static_cast<int>(std::min<int64_t>(2, groups - 2 * p));
    // a chunk's first row tile brings the next pair's weights into L2, as the bf16 AMX
    // kernel does (weights streamed from DRAM, a 1B layer's gate/up: 32 rows 2.9 -> 2.5
    // ms, 256 rows 13.3 -> 11.0; benchmarks/history/notebook.md)
    const bool next = r0 % rc == 0 && 2 * p + 3 < groups;
    const uint8_t* pf = next ? w.qs + (2 * p + 2) * a.nb * w.qbytes : nullptr;
    tile_amx(kind, a, r0, rows, w, 2 * p, ng, acc, pf);
    for (int j = 0; j < ng; ++j)
      store_rows<O>(acc[j], rows, 2 * p + j, w.n, bias, out + r0 * w.n, w.n);
  }, amx_release);
}

template <int KIND, typename O>
void run(const QAct& a, int64_t m, const QWeight& w, const float* bias, O* out) {
  if (g_use_vnni.load() && amx_int8_takes(KIND, m)) return run_amx<O>(KIND, a, m, w, bias, out);
  const int64_t groups = (w.n + 15) / 16;
  const bool vnni = vnni_built() && g_use_vnni.load();
  // Items of kRowChunk rows x a span of groups (at least 4 items a thread where the matrix
  // allows; one group an item when one tile holds every row: nothing to reuse).
  const int64_t per_group = a.nb * (w.qbytes + 64);
  const int64_t want =
      m <= kRowTile ? 1 : std::max<int64_t>(1, groups / (4 * at::get_num_threads()));
  const int64_t span =
      std::clamp<int64_t>(kL2Weights / per_group, 1, std::min<int64_t>(16, want));
  each_tile<kRowTile>(m, kRowChunk, groups, span, [&](int64_t r0, int rows, int64_t g) {
    float acc[kRowTile][16];
    if constexpr (KIND == kC8) {
#ifdef KVSERVE_GGUF_VNNI
      if (vnni) tile_c8_vnni_rows(a, r0, rows, w, g, acc);
      else tile_c8_portable(a, r0, rows, w, g, acc);
#else
      tile_c8_portable(a, r0, rows, w, g, acc);
#endif
    } else {
#ifdef KVSERVE_GGUF_VNNI
      if (vnni) tile_vnni_rows<KIND>(a, r0, rows, w, g, acc);
      else tile_portable<KIND>(a, r0, rows, w, g, acc);
#else
      tile_portable<KIND>(a, r0, rows, w, g, acc);
#endif
    }
    (void)vnni;
    store_rows<O>(acc, rows, g, w.n, bias, out + r0 * w.n, w.n);
  }, [] {});
}

// x [M, K] (float32, bf16 or fp16; unit column stride), K a multiple of 32; qs, d, aux a
// repacked weight of `kind` (0: u4, 1: s8, 2: z4, 3: k4, 4: k6, 5: k5, 6: c8 (gguf_c8.h);
// all but s8, z4, c8 read aux)
// with n outputs; bias [n] float32 or None. Returns
// [M, n] in x's dtype.
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                       const at::Tensor& aux, int64_t kind, int64_t n,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(kind >= kU4 && kind <= kC8,
              "gguf_linear: kind must be 0 (u4), 1 (s8), 2 (z4), 3 (k4), 4 (k6), 5 (k5) or 6 (c8)");
  const int64_t qbytes =
      kind == kS8 || kind == kC8 ? 512 : kind == kK6 ? 384 : kind == kK5 ? 320 : 256;
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % kQB == 0,
              "gguf_linear: x must be [M, K] with contiguous rows, K % 32 == 0");
  const int64_t m = x.size(0), nb = x.size(1) / kQB, groups = (n + 15) / 16;
  TORCH_CHECK(qs.is_contiguous() && qs.scalar_type() == at::kByte && qs.dim() == 3 &&
                  qs.size(0) == groups && qs.size(1) == nb && qs.size(2) == qbytes,
              "gguf_linear: qs does not match x, n and kind");
  if (kind == kK4 || kind == kK5) {
    TORCH_CHECK(nb % 8 == 0 && d.is_contiguous() && d.scalar_type() == at::kHalf &&
                    d.numel() == groups * (nb / 8) * 32,
                "gguf_linear: k4/k5's d must be [G, K/256, 32] float16 (K % 256 == 0)");
    TORCH_CHECK(aux.is_contiguous() && aux.scalar_type() == at::kByte &&
                    aux.numel() == groups * nb * 32,
                "gguf_linear: k4/k5's aux must be [G, K/32, 32] uint8 (scales, mins)");
  } else if (kind == kK6) {
    TORCH_CHECK(nb % 8 == 0 && d.is_contiguous() && d.scalar_type() == at::kHalf &&
                    d.numel() == groups * (nb / 8) * 16,
                "gguf_linear: k6's d must be [G, K/256, 16] float16 (K % 256 == 0)");
    TORCH_CHECK(aux.is_contiguous() && aux.scalar_type() == at::kChar &&
                    aux.numel() == groups * nb * 32,
                "gguf_linear: k6's aux must be [G, K/32, 32] int8 (scales)");
  } else if (kind == kC8) {
    TORCH_CHECK(d.is_contiguous() && d.scalar_type() == at::kFloat && d.numel() == groups * 16,
                "gguf_linear: c8's d must be [G, 16] float32 (a scale per row)");
  } else {
    TORCH_CHECK(d.is_contiguous() && d.scalar_type() == at::kHalf && d.numel() == groups * nb * 16,
                "gguf_linear: d must be [G, K/32, 16] float16");
  }
  TORCH_CHECK(kind != kU4 || (aux.is_contiguous() && aux.numel() == groups * nb * 16 &&
                              aux.scalar_type() == at::kHalf),
              "gguf_linear: aux must be [G, K/32, 16] float16 (u4's offsets)");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "gguf_linear: bias must be [n] float32");
    bp = bias->data_ptr<float>();
  }
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  // the activations' codes in this thread's buffers (no tensor allocations per call)
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> dx, sx, hx;
  q.resize(m * x.size(1));
  dx.resize(m * nb);
  sx.resize(m * nb);
  hx.resize(m * nb);
  const int64_t qb = kind == kC8 ? c8_block(x.size(1)) : kQB;  // values an activation block
  quantize_rows(x, q.data(), dx.data(), sx.data(), hx.data(), qb, g_use_vnni.load());
  const int64_t nab = nb / (qb / kQB);  // activation blocks a row
  thread_local std::vector<int32_t> si;  // c8's chains start at -128 sx (exact integers)
  if (kind == kC8) {
    si.resize(m * nab);
    for (int64_t i = 0; i < m * nab; ++i) si[i] = -128 * static_cast<int32_t>(sx[i]);
  }
  const QAct a{q.data(), dx.data(), sx.data(), hx.data(), x.size(1), nb, si.data(),
               nb / nab};
  const QWeight w{qs.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr()),
                  aux.data_ptr(), n, qbytes};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gguf_linear", [&] {
    if (kind == kU4) run<kU4, scalar_t>(a, m, w, bp, out.data_ptr<scalar_t>());
    else if (kind == kZ4) run<kZ4, scalar_t>(a, m, w, bp, out.data_ptr<scalar_t>());
    else if (kind == kK4) run<kK4, scalar_t>(a, m, w, bp, out.data_ptr<scalar_t>());
    else if (kind == kK6) run<kK6, scalar_t>(a, m, w, bp, out.data_ptr<scalar_t>());
    else if (kind == kK5) run<kK5, scalar_t>(a, m, w, bp, out.data_ptr<scalar_t>());
    else if (kind == kC8) run<kC8, scalar_t>(a, m, w, bp, out.data_ptr<scalar_t>());
    else run<kS8, scalar_t>(a, m, w, bp, out.data_ptr<scalar_t>());
  });
  return out;
}

}  // namespace

namespace kvserve {  // entry point for C++ callers (ops.h)
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                       const at::Tensor& aux, int64_t kind, int64_t n,
                       const std::optional<at::Tensor>& bias) {
  return ::gguf_linear(x, qs, d, aux, kind, n, bias);
}
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("gguf_gemm_vnni() -> bool", &vnni_built);
  m.def("gguf_gemm_use_vnni(bool enable) -> bool", &gguf_gemm_use_vnni);
  m.def("gguf_gemm_amx() -> bool", &amx_int8_ready);  // the AMX-INT8 tiles (gguf_amx.h)
  m.def("gguf_gemm_use_amx(bool enable) -> bool", &amx_int8_enable);
  m.def("gguf_linear(Tensor x, Tensor qs, Tensor d, Tensor aux, int kind, int n, Tensor? bias) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("gguf_linear", gguf_linear);
}
