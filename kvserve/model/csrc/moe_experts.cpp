// A mixture-of-experts layer's routed experts in one call (model/mlp.py: SparseMoE).
//
// x holds the layer's routed rows grouped by expert (counts[e] rows for expert e, experts
// in order). Each group goes through its expert's fused gate/up GEMM with SiLU-and-mul
// (or, with swiglu_limit > 0, gpt-oss's: the gate/up GEMM, then clamped_swiglu) and its
// down GEMM: the very kernel functions (bf16_gemm.cpp) the Python loop over
// KernelGateUpSilu / KernelLinear modules calls, so a row gets the same bits either way
// (each GEMM item is computed whole by one thread: neither the thread nor the chunking
// changes a row). What this saves is the loop's Python: ~1000 expert calls a decode step
// on a 64-expert model, each a module call, two slices and an allocation.
//
// Decode-sized groups (at most kFewRows rows each) run expert-parallel: each thread takes
// whole experts, streaming their weights, in one parallel region for the layer (the GEMMs'
// own parallel loops then run inline on that thread). Larger groups run one expert after
// another, each GEMM parallel over its columns as usual.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ops.h"

namespace {

constexpr int64_t kFewRows = 64;

// gpt-oss's expert activation over rows [gate (inter) | up (inter)] of bf16: the gate
// clamped above at `limit`, up to ±limit, then gate · sigmoid(alpha · gate) · (up + 1),
// in float and rounded once to bf16. Element by element: a row never depends on another.
at::Tensor clamped_swiglu(const at::Tensor& gate_up, double alpha, double limit) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kBFloat16 &&
                  gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "clamped_swiglu: gate_up must be bf16 [rows, 2 * inter] with contiguous rows");
  const int64_t m = gate_up.size(0), inter = gate_up.size(1) / 2, ld = gate_up.stride(0);
  auto out = at::empty({m, inter}, gate_up.options());
  const auto* in = gate_up.data_ptr<c10::BFloat16>();
  auto* o = out.data_ptr<c10::BFloat16>();
  const float a = static_cast<float>(alpha), lim = static_cast<float>(limit);
  for (int64_t r = 0; r < m; ++r) {
    const c10::BFloat16* row = in + r * ld;
    for (int64_t i = 0; i < inter; ++i) {
      const float g = std::min(static_cast<float>(row[i]), lim);
      const float u = std::min(std::max(static_cast<float>(row[inter + i]), -lim), lim);
      o[r * inter + i] = static_cast<c10::BFloat16>(g / (1.f + std::exp(-a * g)) * (u + 1.f));
    }
  }
  return out;
}

at::Tensor moe_experts(const at::Tensor& x, at::IntArrayRef counts, at::TensorList gate_up,
                       const c10::List<std::optional<at::Tensor>>& gate_up_bias,
                       at::TensorList down,
                       const c10::List<std::optional<at::Tensor>>& down_bias, int64_t inter,
                       int64_t hidden, double swiglu_alpha, double swiglu_limit) {
  const int64_t experts = static_cast<int64_t>(counts.size());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "moe_experts: x must be contiguous bf16 [rows, in]");
  TORCH_CHECK(static_cast<int64_t>(gate_up.size()) == experts &&
                  static_cast<int64_t>(down.size()) == experts &&
                  static_cast<int64_t>(gate_up_bias.size()) == experts &&
                  static_cast<int64_t>(down_bias.size()) == experts,
              "moe_experts: one gate/up and one down weight (and bias entry) per expert");
  std::vector<int64_t> start(experts + 1, 0);
  int64_t most = 0;
  for (int64_t e = 0; e < experts; ++e) {
    TORCH_CHECK(counts[e] >= 0, "moe_experts: negative count for expert ", e);
    start[e + 1] = start[e] + counts[e];
    most = std::max(most, counts[e]);
  }
  TORCH_CHECK(start[experts] == x.size(0), "moe_experts: counts sum to ", start[experts],
              ", x has ", x.size(0), " rows");
  auto out = at::empty({x.size(0), hidden}, x.options());
  std::vector<int64_t> hit;  // the experts with rows
  for (int64_t e = 0; e < experts; ++e)
    if (counts[e]) hit.push_back(e);
  // the pool's threads do not inherit the caller's inference mode: each takes it on
  const bool inference = c10::InferenceMode::is_enabled();
  char* dst = static_cast<char*>(out.data_ptr());
  const int64_t row_bytes = hidden * out.element_size();
  auto run = [&](int64_t e) {
    const auto rows = x.narrow(0, start[e], counts[e]);
    const auto g =
        swiglu_limit > 0
            ? clamped_swiglu(kvserve::bf16_linear(rows, gate_up[e], gate_up_bias.get(e), 2 * inter),
                             swiglu_alpha, swiglu_limit)
            : kvserve::bf16_linear_silu_mul(rows, gate_up[e], gate_up_bias.get(e), inter);
    const auto y = kvserve::bf16_linear(g, down[e], down_bias.get(e), hidden);
    std::memcpy(dst + start[e] * row_bytes, y.data_ptr(), counts[e] * row_bytes);
  };
  const int64_t n = static_cast<int64_t>(hit.size());
  if (most <= kFewRows && n >= 2 * at::get_num_threads()) {
    at::parallel_for(0, n, 1, [&](int64_t i0, int64_t i1) {
      c10::InferenceMode guard(inference);
      for (int64_t i = i0; i < i1; ++i) run(hit[i]);
    });
  } else {
    for (int64_t e : hit) run(e);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("moe_experts(Tensor x, int[] counts, Tensor[] gate_up, Tensor?[] gate_up_bias, "
        "Tensor[] down, Tensor?[] down_bias, int inter, int hidden, float swiglu_alpha=1., "
        "float swiglu_limit=0.) -> Tensor");
  m.impl("moe_experts", c10::DispatchKey::CPU, TORCH_FN(moe_experts));
  m.def("clamped_swiglu(Tensor gate_up, float alpha, float limit) -> Tensor");
  m.impl("clamped_swiglu", c10::DispatchKey::CPU, TORCH_FN(clamped_swiglu));
}
