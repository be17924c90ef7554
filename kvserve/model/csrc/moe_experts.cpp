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
// moe_experts_quantized does the same for experts kept quantized (GGUF blocks,
// --quantization int8), through gguf_linear (gguf_gemm.cpp) and silu_and_mul.
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

// Every expert with rows through fn(e, its rows) -> [counts[e], hidden] of x's dtype, into
// one [rows, hidden] tensor in x's row order. Decode-sized groups run expert-parallel.
template <typename Fn>
at::Tensor each_expert(const char* name, const at::Tensor& x, at::IntArrayRef counts,
                       int64_t hidden, const Fn& fn) {
  const int64_t experts = static_cast<int64_t>(counts.size());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, ": x must be contiguous [rows, in]");
  std::vector<int64_t> start(experts + 1, 0);
  int64_t most = 0;
  for (int64_t e = 0; e < experts; ++e) {
    TORCH_CHECK(counts[e] >= 0, name, ": negative count for expert ", e);
    start[e + 1] = start[e] + counts[e];
    most = std::max(most, counts[e]);
  }
  TORCH_CHECK(start[experts] == x.size(0), name, ": counts sum to ", start[experts],
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
    const auto y = fn(e, x.narrow(0, start[e], counts[e]));
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

at::Tensor moe_experts(const at::Tensor& x, at::IntArrayRef counts, at::TensorList gate_up,
                       const c10::List<std::optional<at::Tensor>>& gate_up_bias,
                       at::TensorList down,
                       const c10::List<std::optional<at::Tensor>>& down_bias, int64_t inter,
                       int64_t hidden, double swiglu_alpha, double swiglu_limit) {
  const auto experts = counts.size();
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "moe_experts: x must be bf16");
  TORCH_CHECK(gate_up.size() == experts && down.size() == experts &&
                  gate_up_bias.size() == experts && down_bias.size() == experts,
              "moe_experts: one gate/up and one down weight (and bias entry) per expert");
  return each_expert("moe_experts", x, counts, hidden, [&](int64_t e, const at::Tensor& rows) {
    const auto g =
        swiglu_limit > 0
            ? clamped_swiglu(kvserve::bf16_linear(rows, gate_up[e], gate_up_bias.get(e), 2 * inter),
                             swiglu_alpha, swiglu_limit)
            : kvserve::bf16_linear_silu_mul(rows, gate_up[e], gate_up_bias.get(e), inter);
    return kvserve::bf16_linear(g, down[e], down_bias.get(e), hidden);
  });
}

// Experts kept quantized (model/quantized.py: a GGUF file's, or --quantization int8's):
// each expert's gate/up is parts = gate_up_ns.size() parts stacked along its outputs
// (GGUFLinear.parts: part p of kind gate_up_kinds[p], gate_up_ns[p] outputs, its tensors
// gate_up[3 (e parts + p) ...] = qs, d, aux, its bias gate_up_bias[e parts + p]), and its
// down one part (down[3e ...], down_kind, down_bias[e]). Per expert: gguf_linear of each
// part, concatenated, the activation (silu_and_mul, or clamped_swiglu), gguf_linear of
// down: what the loop over the GGUFLinear modules computes, bit for bit.
at::Tensor moe_experts_quantized(
    const at::Tensor& x, at::IntArrayRef counts, at::TensorList gate_up,
    at::IntArrayRef gate_up_kinds, at::IntArrayRef gate_up_ns,
    const c10::List<std::optional<at::Tensor>>& gate_up_bias, at::TensorList down,
    int64_t down_kind, const c10::List<std::optional<at::Tensor>>& down_bias, int64_t inter,
    int64_t hidden, double swiglu_alpha, double swiglu_limit) {
  const auto experts = counts.size(), parts = gate_up_ns.size();
  int64_t outs = 0;
  for (const int64_t n : gate_up_ns) outs += n;
  TORCH_CHECK(parts >= 1 && gate_up_kinds.size() == parts && outs == 2 * inter,
              "moe_experts_quantized: gate/up parts must have a kind each and 2 * inter "
              "outputs in all");
  TORCH_CHECK(gate_up.size() == 3 * parts * experts && gate_up_bias.size() == parts * experts &&
                  down.size() == 3 * experts && down_bias.size() == experts,
              "moe_experts_quantized: qs, d, aux (and a bias entry) per part per expert");
  return each_expert("moe_experts_quantized", x, counts, hidden,
                     [&](int64_t e, const at::Tensor& rows) {
    std::vector<at::Tensor> ys;
    for (size_t p = 0; p < parts; ++p) {
      const size_t i = e * parts + p;
      ys.push_back(kvserve::gguf_linear(rows, gate_up[3 * i], gate_up[3 * i + 1],
                                        gate_up[3 * i + 2], gate_up_kinds[p], gate_up_ns[p],
                                        gate_up_bias.get(i)));
    }
    const auto y = parts == 1 ? ys[0] : at::cat(ys, 1);
    const auto g = swiglu_limit > 0 ? clamped_swiglu(y, swiglu_alpha, swiglu_limit)
                                    : kvserve::silu_and_mul(y);
    return kvserve::gguf_linear(g, down[3 * e], down[3 * e + 1], down[3 * e + 2], down_kind,
                                hidden, down_bias.get(e));
  });
}

// The experts' outputs back to their tokens: out[t] = T(sum over slots s < k, in order,
// of float(h[pos(t, s)]) * weights[t, s]), where pos inverts `order` (order[i] = the flat
// (token, slot) index t * k + s whose expert output is h's row i). A token's sum reads only
// its own rows, in slot order: it does not depend on the other tokens. h [n * k, hidden]
// bf16/fp16/float32 with contiguous rows, weights [n, k] float32, order [n * k] int64 (a
// permutation). Returns [n, hidden] of h's dtype.
at::Tensor moe_combine(const at::Tensor& h, const at::Tensor& weights, const at::Tensor& order) {
  TORCH_CHECK(weights.dim() == 2 && weights.is_contiguous() && weights.scalar_type() == at::kFloat,
              "moe_combine: weights must be contiguous float32 [tokens, k]");
  const int64_t n = weights.size(0), k = weights.size(1), rows = n * k;
  TORCH_CHECK(h.dim() == 2 && h.size(0) == rows && h.stride(1) == 1 && order.dim() == 1 &&
                  order.size(0) == rows && order.scalar_type() == at::kLong,
              "moe_combine: h must be [tokens * k, hidden] with contiguous rows, order [tokens * k] "
              "int64");
  const int64_t hidden = h.size(1), ld = h.stride(0);
  const auto ord = order.contiguous();
  const int64_t* op = ord.data_ptr<int64_t>();
  std::vector<int64_t> pos(rows, -1);
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(op[i] >= 0 && op[i] < rows && pos[op[i]] < 0, "moe_combine: order is not a "
                "permutation");
    pos[op[i]] = i;
  }
  auto out = at::empty({n, hidden}, h.options());
  const float* w = weights.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "moe_combine", [&] {
    const scalar_t* hp = h.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> acc(hidden);
      for (int64_t t = t0; t < t1; ++t) {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t s = 0; s < k; ++s) {
          const scalar_t* row = hp + pos[t * k + s] * ld;
          const float ws = w[t * k + s];
          for (int64_t j = 0; j < hidden; ++j) acc[j] += static_cast<float>(row[j]) * ws;
        }
        for (int64_t j = 0; j < hidden; ++j) o[t * hidden + j] = static_cast<scalar_t>(acc[j]);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("moe_experts(Tensor x, int[] counts, Tensor[] gate_up, Tensor?[] gate_up_bias, "
        "Tensor[] down, Tensor?[] down_bias, int inter, int hidden, float swiglu_alpha=1., "
        "float swiglu_limit=0.) -> Tensor");
  m.impl("moe_experts", c10::DispatchKey::CPU, TORCH_FN(moe_experts));
  m.def("moe_experts_quantized(Tensor x, int[] counts, Tensor[] gate_up, int[] gate_up_kinds, "
        "int[] gate_up_ns, Tensor?[] gate_up_bias, Tensor[] down, int down_kind, "
        "Tensor?[] down_bias, int inter, int hidden, float swiglu_alpha=1., "
        "float swiglu_limit=0.) -> Tensor");
  m.impl("moe_experts_quantized", c10::DispatchKey::CPU, TORCH_FN(moe_experts_quantized));
  m.def("moe_combine(Tensor h, Tensor weights, Tensor order) -> Tensor");
  m.impl("moe_combine", c10::DispatchKey::CPU, TORCH_FN(moe_combine));
  m.def("clamped_swiglu(Tensor gate_up, float alpha, float limit) -> Tensor");
  m.impl("clamped_swiglu", c10::DispatchKey::CPU, TORCH_FN(clamped_swiglu));
}
