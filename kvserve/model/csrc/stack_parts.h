// The parts every one-call decoder stack shares (decoder_stack.cpp: Llama's layer order;
// gemma_stack.cpp: Gemma's): the model's sizes, a layer's K/V write, its attention over the
// paged cache, and its linears (kvserve's bf16 GEMM or GGUF blocks kept quantized). Each
// calls the same kernel, on the same tensors, as the Python layers do one by one.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "kv_tiles.h"
#include "ops.h"

namespace kvserve_stack {

// dims: {num_heads, num_kv_heads, head_dim, hidden, inter, block_size}
struct Dims {
  int64_t heads, kv_heads, head_dim, hidden, inter, block_size;
  int64_t q_size() const { return heads * head_dim; }
  int64_t kv_size() const { return kv_heads * head_dim; }
  int64_t qkv_size() const { return q_size() + 2 * kv_size(); }
};

inline Dims read_dims(const char* op, c10::IntArrayRef d) {
  TORCH_CHECK(d.size() == 6, op, ": dims must be [heads, kv_heads, head_dim, hidden, "
              "inter, block_size]");
  for (int64_t v : d) TORCH_CHECK(v > 0, op, ": dims must be positive");
  return Dims{d[0], d[1], d[2], d[3], d[4], d[5]};
}

// A layer's q, k, v [tokens, heads, head_dim]: views of its qkv projection's output
// [tokens, (heads + 2 kv_heads) head_dim].
struct QKV {
  at::Tensor q, k, v;
};

inline QKV split_qkv(const at::Tensor& qkv, const Dims& dm) {
  const int64_t t = qkv.size(0), qs = dm.q_size(), kvs = dm.kv_size();
  return {qkv.narrow(1, 0, qs).view({t, dm.heads, dm.head_dim}),
          qkv.narrow(1, qs, kvs).view({t, dm.kv_heads, dm.head_dim}),
          qkv.narrow(1, qs + kvs, kvs).view({t, dm.kv_heads, dm.head_dim})};
}

// One layer's cache: a plain one [2, slots, H, D] (or its tiles, kv_tiles.h) of the
// activations' dtype (kind < 0), or the codes [2, slots, H, D] of a token-scale int8/fp8
// cache with scales [2, slots, H] float16 (or both tiled: [2, slots / 16, H, 16, D] and
// [2, slots / 16, H, 16]), quantize_kv's kind and candidates, and K's shift (None, or
// [H, D] float32).
struct LayerCache {
  at::Tensor cache;
  std::optional<at::Tensor> scales, shift;
  int64_t kind, candidates;

  // Stores the step's k, v [tokens, kv_heads, head_dim] at slots (copied, or quantized
  // with per-token scales and K's shift).
  void write(const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) const {
    if (kind < 0) {
      kvserve::write_kv(k, v, slots, cache);
      return;
    }
    TORCH_CHECK(scales.has_value(), "decoder stack: a quantized cache needs its scales");
    kvserve::quantize_kv(k, slots, cache.select(0, 0).view(at::kByte), scales->select(0, 0),
                         kind, candidates, shift, 0);
    kvserve::quantize_kv(v, slots, cache.select(0, 1).view(at::kByte), scales->select(0, 1),
                         kind, candidates, std::nullopt, 1);
  }

  // paged_attention of q [tokens, heads, head_dim] over this cache, read as blocks of rows
  // [-1, block_size, H, D] or of tiles [-1, block_size / 16, H, 16, D].
  at::Tensor attend(const at::Tensor& q, const Dims& dm, const at::Tensor& tables,
                    const at::Tensor& lens, const at::Tensor& query_start, double scale,
                    int64_t window, int64_t sinks, double softcap = 0.) const {
    std::optional<at::Tensor> ks, vs;
    if (kind >= 0) {
      ks = scales->select(0, 0);
      vs = scales->select(0, 1);
    }
    const int64_t tile = kvserve_tiles::TILE;
    const std::vector<int64_t> shape =
        cache.dim() == 5
            ? std::vector<int64_t>{-1, dm.block_size / tile, dm.kv_heads, tile, dm.head_dim}
            : std::vector<int64_t>{-1, dm.block_size, dm.kv_heads, dm.head_dim};
    return kvserve::paged_attention(q, cache.select(0, 0).view(shape),
                                    cache.select(0, 1).view(shape), tables, lens, query_start,
                                    scale, window, sinks, ks, vs, softcap);
  }
};

// Linear i of the stack (4 per layer: qkv, o, gate_up, down). A linear is bf16_linear
// (kinds[i] = -1) or, for GGUF weights kept quantized (model/quantized.py), gguf_linear of
// kind kinds[i] with its scales in qscales[2i], qscales[2i + 1]. A quantized linear may
// have a tail: its last tail_rows[i] outputs in a part of another type (tail_kinds[i] >= 0;
// tails[3i .. 3i + 2] its qs, d, aux), computed as a second gguf_linear whose output is
// concatenated, as GGUFLinear does with its parts (a Q4_K_M file's Q/K in Q4_K, V in Q6_K).
struct Linears {
  const c10::List<std::optional<at::Tensor>>& qscales;
  c10::IntArrayRef kinds;
  const c10::List<std::optional<at::Tensor>>& tails;
  c10::IntArrayRef tail_kinds, tail_rows;

  // Checks the lists' lengths for `layers` layers and each quantized linear's tensors.
  void check(const char* op, int64_t layers) const {
    TORCH_CHECK(static_cast<int64_t>(kinds.size()) == 4 * layers &&
                    static_cast<int64_t>(qscales.size()) == 8 * layers,
                op, ": 4 linear kinds and 8 quantization scales per layer");
    TORCH_CHECK(static_cast<int64_t>(tail_kinds.size()) == 4 * layers &&
                    static_cast<int64_t>(tail_rows.size()) == 4 * layers &&
                    static_cast<int64_t>(tails.size()) == 12 * layers,
                op, ": 4 tail kinds and rows and 12 tail tensors per layer");
    for (int64_t i = 0; i < 4 * layers; ++i) {
      TORCH_CHECK(kinds[i] < 0 ||
                      (qscales.get(2 * i).has_value() && qscales.get(2 * i + 1).has_value()),
                  op, ": a quantized linear needs its scales");
      TORCH_CHECK(tail_kinds[i] < 0 || (kinds[i] >= 0 && tail_rows[i] > 0 &&
                                        tails.get(3 * i).has_value() &&
                                        tails.get(3 * i + 1).has_value() &&
                                        tails.get(3 * i + 2).has_value()),
                  op, ": a tail needs a quantized linear, its rows and its tensors");
    }
  }

  at::Tensor operator()(int64_t i, const at::Tensor& x, const at::Tensor& w,
                        const std::optional<at::Tensor>& bias, int64_t n) const {
    if (kinds[i] < 0) return kvserve::bf16_linear(x, w, bias, n);
    if (tail_kinds[i] < 0)
      return kvserve::gguf_linear(x, w, *qscales.get(2 * i), *qscales.get(2 * i + 1), kinds[i],
                                  n, bias);
    const int64_t nt = tail_rows[i], nh = n - nt;
    std::optional<at::Tensor> bh, bt;
    if (bias.has_value()) {
      bh = bias->narrow(0, 0, nh);
      bt = bias->narrow(0, nh, nt);
    }
    at::Tensor head = kvserve::gguf_linear(x, w, *qscales.get(2 * i), *qscales.get(2 * i + 1),
                                           kinds[i], nh, bh);
    at::Tensor tail = kvserve::gguf_linear(x, *tails.get(3 * i), *tails.get(3 * i + 1),
                                           *tails.get(3 * i + 2), tail_kinds[i], nt, bt);
    return at::cat({head, tail}, 1);
  }
};

// What both stacks check before their first layer: the linears' lists (Linears::check),
// the per-head q/k norm weights (2 per layer, each layer both or neither), the step's x
// [tokens, hidden] (contiguous) and the caches' kv_kind (-1: plain, 0-2: quantize_kv's).
inline void check_stack(const char* op, int64_t layers, const Linears& linear,
                        const c10::List<std::optional<at::Tensor>>& qk_norms,
                        const at::Tensor& x, const Dims& dm, int64_t kv_kind) {
  linear.check(op, layers);
  TORCH_CHECK(static_cast<int64_t>(qk_norms.size()) == 2 * layers, op,
              ": 2 q/k norm entries per layer");
  for (int64_t l = 0; l < layers; ++l)
    TORCH_CHECK(qk_norms.get(2 * l).has_value() == qk_norms.get(2 * l + 1).has_value(), op,
                ": q and k norms come together");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == dm.hidden && x.is_contiguous(), op,
              ": x must be contiguous [tokens, hidden]");
  TORCH_CHECK(kv_kind >= -1 && kv_kind <= 2, op, ": kv_kind must be -1, 0, 1 or 2");
}

}  // namespace kvserve_stack
