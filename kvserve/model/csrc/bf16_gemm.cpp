// bf16 GEMM for CPUs with AVX-512-BF16: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), bf16 out.
//
// The weight is packed once (bf16_pack_weight) into blocks of 16 output columns by pairs of
// K: [ceil(N/16)][K/2][16][2], so one 64-byte load is the (k, k+1) pair of 16 columns, the
// operand layout of vdpbf16ps. A micro-kernel keeps an 8-row x 48-column tile of float
// accumulators in 24 registers and walks K once, two K values per instruction.
//
// The MLP's gate/up projection can run fused with SiLU-and-mul (bf16_linear_silu_mul): its
// weight is packed with gate and up blocks interleaved (gate block b, then up block b), a
// micro-kernel takes 12 rows x (one gate + one up block), and its epilogue writes
// bf16(bf16(silu(g)) * u) from the bf16-rounded g and u: bit for bit the unfused product
// followed by silu_and_mul, without writing and re-reading the [M, 2I] intermediate.
//
// Contract (what the engine's batch invariance rests on): every output element is one
// float accumulator that starts at zero and takes the K pairs in order 0, 1, ..., K/2 - 1;
// bias is added after the last pair, then the value is rounded to bf16 (nearest even).
// Nothing of that depends on M, on which rows share a tile or on how the work is split
// over threads, so row i of an M-row product is bit for bit the row computed alone.
//
// Why not oneDNN: at decode sizes (M <= 64) its call costs ~20 us of fixed overhead and
// its kernels reach 0.23-0.34 TFLOP/s here against 0.39-0.42 for this one; at prefill sizes
// the two are at parity (benchmarks/gemm_prepack.py). Where the CPU has AMX and the kernel
// grants the tile state, the products run on tiles instead (bf16_gemm_amx.cpp).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "float_convert.h"
#include "gemm_items.h"
#include "ops.h"
#include "silu16.h"

namespace {

constexpr int64_t kRowTile = 8;    // rows per micro-kernel call
constexpr int64_t kPanel = 3;      // 16-column blocks per micro-kernel call
constexpr int64_t kRowChunk = 64;  // rows that share one pass over a weight panel
// The fused gate/up + SiLU kernel: 12 rows x (gate, up) blocks, the same 24 accumulators.
constexpr int64_t kSiluRowTile = 12;
constexpr int64_t kSiluPanel = 2;
constexpr int64_t kSiluRowChunk = 60;

#ifdef KVSERVE_AVX512_BF16
using kvserve_gemm::Problem;

// Rows [0, MR) of the tile at `a`/`c`, blocks [nb0, nb0 + NR). `pf` (or nullptr) is the
// next panel: the blocks of it set in `pf_blocks` are prefetched into L2 while this tile is
// computed (the weights come from DRAM; one line per block per K pair, so the row tiles of
// a panel share the prefetching instead of issuing it in one burst the memory cannot take).
// With SILU (NR = 2: blocks nb0, nb0 + 1 are the gate and up halves of 16 output columns),
// the tile's output is bf16(bf16(silu(g)) * u) at columns nb0 / 2 * 16 of a row of p.n.
template <int MR, int NR, int NP, bool SILU>
inline void micro(const Problem& p, const uint16_t* a, uint16_t* c, int64_t nb0,
                  const uint16_t* pf, unsigned pf_blocks) {
  static_assert(!SILU || NR == 2, "the SiLU epilogue takes one (gate, up) pair of blocks");
  const int64_t bstride = p.k2 * 32;
  const uint16_t* b0 = p.w + nb0 * bstride;
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < p.k2; ++k) {
    if (pf != nullptr)
      for (int j = 0; j < NP; ++j)
        if (pf_blocks & (1u << j))
          _mm_prefetch(reinterpret_cast<const char*>(pf + j * bstride + k * 32), _MM_HINT_T1);
    __m512bh b[NR];
    for (int j = 0; j < NR; ++j)
      b[j] = (__m512bh)_mm512_loadu_si512(b0 + j * bstride + k * 32);
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, a + i * p.lda + 2 * k, sizeof(pair));
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], av, b[j]);
    }
  }
  if constexpr (SILU) {
    using kvserve_cpu::widen_bf16;
    const int64_t col = nb0 / 2 * 16;  // p.n (the SiLU output width) is a multiple of 16
    const __m512 bg = p.bias ? _mm512_loadu_ps(p.bias + nb0 * 16) : _mm512_setzero_ps();
    const __m512 bu = p.bias ? _mm512_loadu_ps(p.bias + nb0 * 16 + 16) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) {
      const __m512 g = p.bias ? _mm512_add_ps(acc[i][0], bg) : acc[i][0];
      const __m512 u = p.bias ? _mm512_add_ps(acc[i][1], bu) : acc[i][1];
      const __m512 prod = kvserve_cpu::silu_mul16(widen_bf16((__m256i)_mm512_cvtneps_pbh(g)),
                                                  widen_bf16((__m256i)_mm512_cvtneps_pbh(u)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + i * p.n + col),
                          (__m256i)_mm512_cvtneps_pbh(prod));
    }
    return;
  }
  for (int j = 0; j < NR; ++j) {
    const int64_t col = (nb0 + j) * 16;
    const int64_t left = p.n - col;  // 1..16: only the last block is partial
    const __mmask16 m = kvserve_cpu::first_lanes(left);
    const __m512 bv = p.bias ? _mm512_maskz_loadu_ps(m, p.bias + col) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) {
      const __m512 v = p.bias ? _mm512_add_ps(acc[i][j], bv) : acc[i][j];
      _mm256_mask_storeu_epi16(c + i * p.n + col, m, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

template <int NR, int NP, bool SILU>
inline void tile(int64_t rows, const Problem& p, const uint16_t* a, uint16_t* c, int64_t nb0,
                 const uint16_t* pf, unsigned pf_blocks) {
  constexpr int64_t kMaxRows = SILU ? kSiluRowTile : kRowTile;  // larger tiles: not built
  switch (rows) {
#define KVSERVE_ROWS(r)                                                 \
  case r:                                                               \
    if constexpr (r <= kMaxRows) micro<r, NR, NP, SILU>(p, a, c, nb0, pf, pf_blocks); \
    break;
    KVSERVE_ROWS(1) KVSERVE_ROWS(2) KVSERVE_ROWS(3) KVSERVE_ROWS(4)
    KVSERVE_ROWS(5) KVSERVE_ROWS(6) KVSERVE_ROWS(7) KVSERVE_ROWS(8)
    KVSERVE_ROWS(9) KVSERVE_ROWS(10) KVSERVE_ROWS(11) KVSERVE_ROWS(12)
#undef KVSERVE_ROWS
  }
}

// Prefetches, for writing, the lines of out rows [m, m + rows) that columns [col, col + width)
// fall in. A tile's stores otherwise meet these lines cold (a fresh output, or one evicted by
// the weights' stream) and stall on them: at prefill sizes the plain products ran ~1.5 %
// slower without this (the SiLU product, a third of the columns a tile, showed nothing).
inline void prefetch_out(const Problem& p, int64_t m, int64_t rows, int64_t col, int64_t width) {
  for (int64_t r = 0; r < rows; ++r) {
    const auto b = reinterpret_cast<uintptr_t>(p.c + (m + r) * p.n + col);
    for (uintptr_t line = b & ~uintptr_t(63); line < b + 2 * width; line += 64)
      __builtin_prefetch(reinterpret_cast<const void*>(line), 1, 3);
  }
}

// One work item: rows [m0, m1) against the panel of blocks [nb0, nb0 + NP) (fewer at the
// end), in tiles of RT rows. The plain product prefetches each next tile's output lines.
template <int NP, int RT, bool SILU>
void run_item(const Problem& p, int64_t nblocks, int64_t m0, int64_t m1, int64_t nb0) {
  const int64_t nr = std::min<int64_t>(NP, nblocks - nb0);
  const uint16_t* next = nb0 + NP < nblocks ? p.w + (nb0 + NP) * p.k2 * 32 : nullptr;
  const int64_t tiles = (m1 - m0 + RT - 1) / RT;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t m = m0 + t * RT;
    const int64_t rows = std::min<int64_t>(RT, m1 - m);
    const uint16_t* a = p.a + m * p.lda;
    uint16_t* c = p.c + m * p.n;
    unsigned pf_blocks = 0;  // block j of the next panel is prefetched by tile j % tiles
    for (int j = 0; j < NP; ++j)
      if (j % tiles == t) pf_blocks |= 1u << j;
    const uint16_t* pf = pf_blocks ? next : nullptr;
    if (!SILU && t + 1 < tiles)
      prefetch_out(p, m + RT, std::min<int64_t>(RT, m1 - m - RT), nb0 * 16,
                   std::min<int64_t>(nr * 16, p.n - nb0 * 16));
    if constexpr (SILU) {
      tile<2, NP, true>(rows, p, a, c, nb0, pf, pf_blocks);
    } else {
      if (nr == 3) tile<3, NP, false>(rows, p, a, c, nb0, pf, pf_blocks);
      else if (nr == 2) tile<2, NP, false>(rows, p, a, c, nb0, pf, pf_blocks);
      else tile<1, NP, false>(rows, p, a, c, nb0, pf, pf_blocks);
    }
  }
}

// All items of a product (kvserve_gemm::for_items), each computed whole by one thread.
template <int NP, int RT, int RC, bool SILU>
void run_all(const Problem& p, int64_t m, int64_t nblocks) {
  kvserve_gemm::for_items<NP, RT, RC>(
      m, nblocks,
      [&](int64_t m0, int64_t m1, int64_t nb0) {
        run_item<NP, RT, SILU>(p, nblocks, m0, m1, nb0);
      },
      [] {});
}
#endif

bool bf16_gemm_available() {
#ifdef KVSERVE_AVX512_BF16
  return true;
#else
  return false;
#endif
}

// Whether products take the AMX kernel where it can run; tests turn it off to check the
// AVX-512-BF16 kernel on an AMX machine.
std::atomic<bool> g_use_amx{true};

bool use_amx() { return g_use_amx.load() && kvserve_amx::ready(); }

// Sets whether the AMX kernel may run; returns the previous setting. The two kernels may
// differ in a last bit, so a switch while an engine runs breaks its batch invariance.
bool bf16_gemm_use_amx(bool enable) { return g_use_amx.exchange(enable); }

// True where kvserve's GEMM is the faster choice than oneDNN: AVX-512-BF16 without AMX in
// the build, or with AMX where the kernel granted the tile state (the dot products alone
// run at a quarter of oneDNN's AMX kernels there).
bool bf16_gemm_preferred() {
#ifdef KVSERVE_AVX512_BF16
  return kvserve_amx::ready() || !kvserve_amx::built();
#else
  return false;
#endif
}

// w [N, K] bf16 (K even) -> [ceil(N/16), K/2, 32] bf16, the layout described above;
// columns past N are zero.
at::Tensor bf16_pack_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "bf16 [N, K] weight expected");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(k % 2 == 0, "bf16_pack_weight: K must be even, got ", k);
  const int64_t nb = (n + 15) / 16;
  auto padded = at::zeros({nb * 16, k}, w.options());
  padded.narrow(0, 0, n).copy_(w);
  return padded.view({nb, 16, k / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({nb, k / 2, 32});
}

// What both products check and run: x [M, K] bf16 with unit column stride; wp packed
// (bf16_pack_weight) with `blocks` blocks of 16 columns; bias [bias_n] float32 or None.
// Returns a new [M, n] bf16 tensor.
template <int NP, int RT, int RC, bool SILU>
at::Tensor checked_linear(const char* name, const at::Tensor& x, const at::Tensor& wp,
                          const c10::optional<at::Tensor>& bias, int64_t n, int64_t blocks,
                          int64_t bias_n) {
  TORCH_CHECK(bf16_gemm_available(), name, " needs a build with AVX-512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, name,
              ": x must be [M, K] bf16 with contiguous rows");
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == 32 && wp.is_contiguous() &&
                  x.size(1) == 2 * wp.size(1) && wp.size(0) == blocks,
              name, ": packed weight does not match x or n");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == bias_n, name, ": bias must be [", bias_n, "] float32");
    bp = bias->data_ptr<float>();
  }
  const int64_t m = x.size(0);
  auto out = at::empty({m, n}, x.options());
#ifdef KVSERVE_AVX512_BF16
  if (m == 0) return out;
  const Problem p{reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0),
                  reinterpret_cast<const uint16_t*>(wp.data_ptr()), wp.size(1),
                  reinterpret_cast<uint16_t*>(out.data_ptr()), n, bp};
  if (use_amx()) kvserve_amx::run(p, m, blocks, SILU);
  else run_all<NP, RT, RC, SILU>(p, m, blocks);
#endif
  return out;
}

// x [M, K] bf16 with unit column stride; wp from bf16_pack_weight; bias [n] float32 or
// None. Returns a new [M, n] bf16 tensor.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& wp,
                       const c10::optional<at::Tensor>& bias, int64_t n) {
  return checked_linear<kPanel, kRowTile, kRowChunk, false>("bf16_linear", x, wp, bias, n,
                                                            (n + 15) / 16, n);
}

// The gate/up projection and SiLU-and-mul in one: wp packs [2 * inter, K] with gate and up
// blocks interleaved (gate block b at 2b, up block b at 2b + 1; bias, if any, [2 * inter]
// float32 in the same order); inter a multiple of 16. Returns [M, inter] bf16, equal bit
// for bit to silu_and_mul(bf16_linear(x, W_gate_up)).
at::Tensor bf16_linear_silu_mul(const at::Tensor& x, const at::Tensor& wp,
                                const c10::optional<at::Tensor>& bias, int64_t inter) {
  TORCH_CHECK(inter > 0 && inter % 16 == 0, "bf16_linear_silu_mul: inter must be a positive "
              "multiple of 16, got ", inter);
  return checked_linear<kSiluPanel, kSiluRowTile, kSiluRowChunk, true>(
      "bf16_linear_silu_mul", x, wp, bias, inter, inter / 8, 2 * inter);
}

}  // namespace


namespace kvserve {  // entry points for C++ callers (ops.h)
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& wp,
                       const std::optional<at::Tensor>& bias, int64_t n) {
  return ::bf16_linear(x, wp, bias, n);
}
at::Tensor bf16_linear_silu_mul(const at::Tensor& x, const at::Tensor& wp,
                                const std::optional<at::Tensor>& bias, int64_t inter) {
  return ::bf16_linear_silu_mul(x, wp, bias, inter);
}
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("bf16_gemm_available() -> bool", &bf16_gemm_available);  // no tensors: catch-all
  m.def("bf16_gemm_preferred() -> bool", &bf16_gemm_preferred);
  m.def("bf16_gemm_use_amx(bool enable) -> bool", &bf16_gemm_use_amx);
  m.def("bf16_gemm_amx() -> bool", &kvserve_amx::ready);
  m.def("bf16_pack_weight(Tensor w) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor wp, Tensor? bias, int n) -> Tensor");
  m.def("bf16_linear_silu_mul(Tensor x, Tensor wp, Tensor? bias, int inter) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("bf16_pack_weight", bf16_pack_weight);
  m.impl("bf16_linear", bf16_linear);
  m.impl("bf16_linear_silu_mul", bf16_linear_silu_mul);
}
