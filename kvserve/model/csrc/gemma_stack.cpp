// Every decoder layer of a Gemma 2 / Gemma 3 model in one call (torch.ops.kvserve.gemma_stack):
// the kernels kvserve/model/gemma.py's layers call with CpuKernelOps and CpuPagedAttention,
// in their order and on the same tensors, so the result equals the Python loop's bit for bit.
// It saves the Python between them: a Gemma layer makes ~15 op calls (four norms, q/k norms,
// GeGLU) and the nn.Module calls around them.
//
// Per layer l (weights[8l .. 8l + 7]: in_norm, qkv, o, post_attn_norm, pre_ffn_norm, gate_up,
// down, post_ffn_norm; every norm Gemma's (1 + w) RMSNorm):
//   h = add_norm(x, residual, in_norm) (layer 0: residual = x, h = norm(x)); qkv = linear(h);
//   q, k normed per head when qk_norms[2l], qk_norms[2l + 1] are given (Gemma 3); rope on q, k
//   with the global tables (rope[0], rope[1]) or the sliding layers' (rope[2], rope[3]);
//   K/V written to the cache of the layer's KV group; o = paged_attention with the layer's
//   window and sinks and the model's score soft-cap; h = norm(linear(o), post_attn_norm);
//   h = add_norm(h, residual, pre_ffn_norm); x = norm(down(gelu_tanh_and_mul(gate_up(h))),
//   post_ffn_norm).
// layer_info[4l .. 4l + 3]: the layer's KV group (its slots[g] and tables[g]: the hybrid
// layout's per-group block tables, model/kv_groups.py), 1 if it rotates with the sliding
// tables, its window (0: all) and its sinks. Linears and caches are stack_parts.h's.
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

constexpr int64_t kWeightsPerLayer = 8;
constexpr int64_t kBiasesPerLayer = 4;  // qkv, o, gate_up, down (each may be None)
constexpr int64_t kInfoPerLayer = 4;    // group, local rope, window, sinks

void check_lists(int64_t layers, at::TensorList rope, at::TensorList weights,
                 const c10::List<std::optional<at::Tensor>>& biases,
                 const c10::List<std::optional<at::Tensor>>& scales,
                 const c10::List<std::optional<at::Tensor>>& k_shifts, at::TensorList slots,
                 at::TensorList tables, c10::IntArrayRef info) {
  TORCH_CHECK(layers > 0, "gemma_stack: no layers");
  TORCH_CHECK(rope.size() == 4, "gemma_stack: rope must be [cos, sin, local cos, local sin]");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kWeightsPerLayer * layers &&
                  static_cast<int64_t>(biases.size()) == kBiasesPerLayer * layers &&
                  static_cast<int64_t>(scales.size()) == layers &&
                  static_cast<int64_t>(k_shifts.size()) == layers &&
                  static_cast<int64_t>(info.size()) == kInfoPerLayer * layers,
              "gemma_stack: ", layers, " caches need ", kWeightsPerLayer * layers, " weights, ",
              kBiasesPerLayer * layers, " biases, ", layers, " scales and shifts and ",
              kInfoPerLayer * layers, " layer_info values");
  TORCH_CHECK(!slots.empty() && slots.size() == tables.size(),
              "gemma_stack: one slot mapping and one block table per KV group");
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t g = info[kInfoPerLayer * l];
    TORCH_CHECK(g >= 0 && g < static_cast<int64_t>(slots.size()), "gemma_stack: layer ", l,
                "'s KV group ", g, " has no block table");
  }
}

std::tuple<at::Tensor, at::Tensor> gemma_stack(
    const at::Tensor& x_in, const at::Tensor& positions, at::TensorList rope,
    at::TensorList weights, const c10::List<std::optional<at::Tensor>>& qk_norms,
    const c10::List<std::optional<at::Tensor>>& biases, at::TensorList caches,
    const c10::List<std::optional<at::Tensor>>& scales,
    const c10::List<std::optional<at::Tensor>>& k_shifts, at::TensorList slots,
    at::TensorList tables, const at::Tensor& lens, const at::Tensor& query_start,
    c10::IntArrayRef dims, c10::IntArrayRef layer_info, double eps, double scale, double softcap,
    int64_t kv_kind, int64_t candidates, const c10::List<std::optional<at::Tensor>>& qscales,
    c10::IntArrayRef kinds, const c10::List<std::optional<at::Tensor>>& tails,
    c10::IntArrayRef tail_kinds, c10::IntArrayRef tail_rows) {
  const Dims dm = kvserve_stack::read_dims("gemma_stack", dims);
  const int64_t layers = static_cast<int64_t>(caches.size());
  check_lists(layers, rope, weights, biases, scales, k_shifts, slots, tables, layer_info);
  const Linears linear{qscales, kinds, tails, tail_kinds, tail_rows};
  kvserve_stack::check_stack("gemma_stack", layers, linear, qk_norms, x_in, dm, kv_kind);
  const int64_t t = x_in.size(0), qs = dm.q_size();
  at::Tensor x = x_in, residual, h;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = &weights[kWeightsPerLayer * l];
    const int64_t b = kBiasesPerLayer * l;
    const int64_t* info = &layer_info[kInfoPerLayer * l];
    if (l == 0) {
      residual = x;
      h = kvserve::gemma_rms_norm(x, w[0], eps);
    } else {
      h = kvserve::gemma_add_rms_norm(x, residual, w[0], eps);
    }
    const at::Tensor qkv = linear(b, h, w[1], biases.get(b), dm.qkv_size());
    auto [q, k, v] = kvserve_stack::split_qkv(qkv, dm);
    const std::optional<at::Tensor> q_norm = qk_norms.get(2 * l);
    if (q_norm.has_value()) {
      q = kvserve::gemma_rms_norm(q, *q_norm, eps);
      k = kvserve::gemma_rms_norm(k, *qk_norms.get(2 * l + 1), eps);
    }
    const int64_t r = info[1] ? 2 : 0;
    kvserve::rope(positions, q, k, rope[r], rope[r + 1]);
    const int64_t g = info[0];
    const LayerCache cache{caches[l], scales.get(l), k_shifts.get(l), kv_kind, candidates};
    cache.write(k, v, slots[g]);
    at::Tensor o = cache.attend(q, dm, tables[g], lens, query_start, scale, info[2], info[3],
                                softcap);
    o = linear(b + 1, o.view({t, qs}), w[2], biases.get(b + 1), dm.hidden);
    h = kvserve::gemma_rms_norm(o, w[3], eps);
    h = kvserve::gemma_add_rms_norm(h, residual, w[4], eps);
    at::Tensor gu = linear(b + 2, h, w[5], biases.get(b + 2), 2 * dm.inter);
    at::Tensor down = linear(b + 3, kvserve::gelu_tanh_and_mul(gu), w[6], biases.get(b + 3),
                             dm.hidden);
    x = kvserve::gemma_rms_norm(down, w[7], eps);
  }
  return {x, residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("gemma_stack(Tensor(c!) x, Tensor positions, Tensor[] rope, Tensor[] weights, "
        "Tensor?[] qk_norms, Tensor?[] biases, Tensor(a!)[] caches, Tensor(b!)?[] scales, "
        "Tensor?[] k_shifts, Tensor[] slots, Tensor[] tables, Tensor lens, Tensor query_start, "
        "int[] dims, int[] layer_info, float eps, float scale, float softcap, int kv_kind, "
        "int candidates, Tensor?[] qscales, int[] kinds, Tensor?[] tails, int[] tail_kinds, "
        "int[] tail_rows) -> (Tensor, Tensor)");
  m.impl("gemma_stack", c10::DispatchKey::CPU, TORCH_FN(gemma_stack));
}
