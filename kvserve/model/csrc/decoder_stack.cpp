// Every decoder layer of a Llama-family model in one call (torch.ops.kvserve.decoder_stack):
// the same kernels, in the same order and on the same tensors, as the Python layers call one
// by one (kvserve/model/llama.py with CpuKernelOps, CpuPagedAttention and kvserve's bf16
// GEMM), so the result is equal bit for bit. What it saves is the Python between them: per
// layer ~10 op calls from Python, their views and the nn.Module calls (~70 µs a layer).
//
// Per layer l: h = add_rms_norm(x, residual, in_norm) (layer 0: residual = x,
// h = rms_norm(x)); qkv = linear(h); q and k normed per head when qk_norms[2l],
// qk_norms[2l + 1] are given (Qwen3); rope on q, k; K/V written to the cache (copied,
// or quantized with per-token scales and K's shift); o = paged_attention;
// h = add_rms_norm(linear(o), residual, post_norm); x = down(gate_up_silu(h)).
// The linears, the K/V write and the attention are stack_parts.h's (gate/up: bf16_linear_silu_mul,
// or a quantized linear then silu_and_mul).
// Returns (x, residual); the stack's output is norm(x + residual), left to the caller.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "ops.h"
#include "stack_parts.h"

namespace {

using kvserve_stack::Dims;
using kvserve_stack::LayerCache;
using kvserve_stack::Linears;

constexpr int64_t kWeightsPerLayer = 6;  // in_norm, qkv, o, post_norm, gate_up, down
constexpr int64_t kBiasesPerLayer = 4;   // qkv, o, gate_up, down (each may be None)

// Linear i (a gate/up projection) with SiLU-and-mul: fused into the bf16 GEMM, or after it.
at::Tensor gate_up_silu(const Linears& linear, int64_t i, const at::Tensor& x,
                        const at::Tensor& w, const std::optional<at::Tensor>& bias,
                        int64_t inter) {
  if (linear.kinds[i] < 0) return kvserve::bf16_linear_silu_mul(x, w, bias, inter);
  return kvserve::silu_and_mul(linear(i, x, w, bias, 2 * inter));
}

std::tuple<at::Tensor, at::Tensor> decoder_stack(
    const at::Tensor& x_in, const at::Tensor& positions, const at::Tensor& cos,
    const at::Tensor& sin, at::TensorList weights,
    const c10::List<std::optional<at::Tensor>>& biases, at::TensorList caches,
    const c10::List<std::optional<at::Tensor>>& scales,
    const c10::List<std::optional<at::Tensor>>& k_shifts, const at::Tensor& slots,
    const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& query_start,
    c10::IntArrayRef dims, double eps, double scale, int64_t window, int64_t sinks,
    int64_t kv_kind, int64_t candidates, const c10::List<std::optional<at::Tensor>>& qscales,
    c10::IntArrayRef kinds, const c10::List<std::optional<at::Tensor>>& tails,
    c10::IntArrayRef tail_kinds, c10::IntArrayRef tail_rows,
    const c10::List<std::optional<at::Tensor>>& qk_norms) {
  const Dims dm = kvserve_stack::read_dims("decoder_stack", dims);
  const int64_t layers = static_cast<int64_t>(caches.size());
  TORCH_CHECK(layers > 0, "decoder_stack: no layers");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kWeightsPerLayer * layers &&
                  static_cast<int64_t>(biases.size()) == kBiasesPerLayer * layers &&
                  static_cast<int64_t>(scales.size()) == layers &&
                  static_cast<int64_t>(k_shifts.size()) == layers,
              "decoder_stack: ", layers, " caches need ", kWeightsPerLayer * layers,
              " weights, ", kBiasesPerLayer * layers, " biases and ", layers,
              " scales and shifts");
  const Linears linear{qscales, kinds, tails, tail_kinds, tail_rows};
  kvserve_stack::check_stack("decoder_stack", layers, linear, qk_norms, x_in, dm, kv_kind);
  const int64_t t = x_in.size(0), qs = dm.q_size();
  at::Tensor x = x_in, residual, h;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = &weights[kWeightsPerLayer * l];
    const int64_t b = kBiasesPerLayer * l;
    if (l == 0) {
      residual = x;
      h = kvserve::rms_norm(x, w[0], eps);
    } else {
      h = kvserve::add_rms_norm(x, residual, w[0], eps);
    }
    const at::Tensor qkv = linear(b, h, w[1], biases.get(b), dm.qkv_size());
    auto [q, k, v] = kvserve_stack::split_qkv(qkv, dm);
    if (const auto q_norm = qk_norms.get(2 * l); q_norm.has_value()) {  // Qwen3
      q = kvserve::rms_norm(q, *q_norm, eps);
      k = kvserve::rms_norm(k, *qk_norms.get(2 * l + 1), eps);
    }
    kvserve::rope(positions, q, k, cos, sin);
    const LayerCache cache{caches[l], scales.get(l), k_shifts.get(l), kv_kind, candidates};
    cache.write(k, v, slots);
    at::Tensor o = cache.attend(q, dm, tables, lens, query_start, scale, window, sinks);
    o = linear(b + 1, o.view({t, qs}), w[2], biases.get(b + 1), dm.hidden);
    h = kvserve::add_rms_norm(o, residual, w[3], eps);
    at::Tensor g = gate_up_silu(linear, b + 2, h, w[4], biases.get(b + 2), dm.inter);
    x = linear(b + 3, g, w[5], biases.get(b + 3), dm.hidden);
  }
  return {x, residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("decoder_stack(Tensor(c!) x, Tensor positions, Tensor cos, Tensor sin, Tensor[] weights, "
        "Tensor?[] biases, Tensor(a!)[] caches, Tensor(b!)?[] scales, Tensor?[] k_shifts, "
        "Tensor slots, Tensor tables, Tensor lens, Tensor query_start, int[] dims, float eps, "
        "float scale, int window, int sinks, int kv_kind, int candidates, Tensor?[] qscales, "
        "int[] kinds, Tensor?[] tails, int[] tail_kinds, int[] tail_rows, Tensor?[] qk_norms) "
        "-> (Tensor, Tensor)");
  m.impl("decoder_stack", c10::DispatchKey::CPU, TORCH_FN(decoder_stack));
}
