// Every decoder layer of a Llama-family model in one call (torch.ops.kvserve.decoder_stack):
// the same kernels, in the same order and on the same tensors, as the Python layers call one
// by one (kvserve/model/llama.py with CpuKernelOps, CpuPagedAttention and kvserve's bf16
// GEMM), so the result is equal bit for bit. What it saves is the Python between them: per
// layer ~10 op calls from Python, their views and the nn.Module calls (~70 µs a layer).
//
// Per layer l: h = add_rms_norm(x, residual, in_norm) (layer 0: residual = x,
// h = rms_norm(x)); qkv = linear(h); rope on q, k; K/V written to the cache (copied,
// or quantized with per-token scales and K's shift); o = paged_attention;
// h = add_rms_norm(linear(o), residual, post_norm); x = down(gate_up_silu(h)).
// A linear is bf16_linear (kinds[i] = -1; gate/up: bf16_linear_silu_mul) or, for GGUF
// weights kept quantized (model/quantized.py), gguf_linear of kind kinds[i] with its
// scales in qscales[2i], qscales[2i + 1] (gate/up: then silu_and_mul). A quantized linear
// may have a tail: its last tail_rows[i] outputs in a part of another type (tail_kinds[i]
// >= 0; tails[3i .. 3i + 2] its qs, d, aux), computed as a second gguf_linear whose output
// is concatenated, as GGUFLinear does with its parts (a Q4_K_M file's Q/K in Q4_K, V in Q6_K).
// Returns (x, residual); the stack's output is norm(x + residual), left to the caller.
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "kv_tiles.h"
#include "ops.h"

namespace {

constexpr int64_t kWeightsPerLayer = 6;  // in_norm, qkv, o, post_norm, gate_up, down
constexpr int64_t kBiasesPerLayer = 4;   // qkv, o, gate_up, down (each may be None)

// dims: {num_heads, num_kv_heads, head_dim, hidden, inter, block_size}
struct Dims {
  int64_t heads, kv_heads, head_dim, hidden, inter, block_size;
  int64_t q_size() const { return heads * head_dim; }
  int64_t kv_size() const { return kv_heads * head_dim; }
};

Dims read_dims(c10::IntArrayRef d) {
  TORCH_CHECK(d.size() == 6, "decoder_stack: dims must be [heads, kv_heads, head_dim, hidden, "
              "inter, block_size]");
  for (int64_t v : d) TORCH_CHECK(v > 0, "decoder_stack: dims must be positive");
  return Dims{d[0], d[1], d[2], d[3], d[4], d[5]};
}

// One layer's K/V: a plain cache [2, slots, H, D] (or its tiles, kv_tiles.h) of the
// activations' dtype (kind < 0), or the codes [2, slots, H, D] of a token-scale int8/fp8
// cache with scales [2, slots, H] float16 (or both tiled: [2, slots / 16, H, 16, D] and
// [2, slots / 16, H, 16]), quantize_kv's kind and candidates, and K's shift (None, or
// [H, D] float32).
void write_layer(const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                 const at::Tensor& cache, const std::optional<at::Tensor>& scales,
                 const std::optional<at::Tensor>& shift, int64_t kind, int64_t candidates) {
  if (kind < 0) {
    kvserve::write_kv(k, v, slots, cache);
    return;
  }
  TORCH_CHECK(scales.has_value(), "decoder_stack: a quantized cache needs its scales");
  kvserve::quantize_kv(k, slots, cache.select(0, 0).view(at::kByte), scales->select(0, 0), kind,
                       candidates, shift, 0);
  kvserve::quantize_kv(v, slots, cache.select(0, 1).view(at::kByte), scales->select(0, 1), kind,
                       candidates, std::nullopt, 1);
}

// Linear i of the stack (4 per layer: qkv, o, gate_up, down) on x, n outputs.
struct Linears {
  const c10::List<std::optional<at::Tensor>>& qscales;
  c10::IntArrayRef kinds;
  const c10::List<std::optional<at::Tensor>>& tails;
  c10::IntArrayRef tail_kinds, tail_rows;

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
  at::Tensor gate_up_silu(int64_t i, const at::Tensor& x, const at::Tensor& w,
                          const std::optional<at::Tensor>& bias, int64_t inter) const {
    if (kinds[i] < 0) return kvserve::bf16_linear_silu_mul(x, w, bias, inter);
    return kvserve::silu_and_mul((*this)(i, x, w, bias, 2 * inter));
  }
};

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
    c10::IntArrayRef tail_kinds, c10::IntArrayRef tail_rows) {
  const Dims dm = read_dims(dims);
  const int64_t layers = static_cast<int64_t>(caches.size());
  TORCH_CHECK(layers > 0, "decoder_stack: no layers");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kWeightsPerLayer * layers &&
                  static_cast<int64_t>(biases.size()) == kBiasesPerLayer * layers &&
                  static_cast<int64_t>(scales.size()) == layers &&
                  static_cast<int64_t>(k_shifts.size()) == layers,
              "decoder_stack: ", layers, " caches need ", kWeightsPerLayer * layers,
              " weights, ", kBiasesPerLayer * layers, " biases and ", layers,
              " scales and shifts");
  TORCH_CHECK(static_cast<int64_t>(kinds.size()) == 4 * layers &&
                  static_cast<int64_t>(qscales.size()) == 8 * layers,
              "decoder_stack: 4 linear kinds and 8 quantization scales per layer");
  TORCH_CHECK(static_cast<int64_t>(tail_kinds.size()) == 4 * layers &&
                  static_cast<int64_t>(tail_rows.size()) == 4 * layers &&
                  static_cast<int64_t>(tails.size()) == 12 * layers,
              "decoder_stack: 4 tail kinds and rows and 12 tail tensors per layer");
  for (int64_t i = 0; i < 4 * layers; ++i) {
    TORCH_CHECK(kinds[i] < 0 || (qscales.get(2 * i).has_value() && qscales.get(2 * i + 1).has_value()),
                "decoder_stack: a quantized linear needs its scales");
    TORCH_CHECK(tail_kinds[i] < 0 || (kinds[i] >= 0 && tail_rows[i] > 0 &&
                                      tails.get(3 * i).has_value() &&
                                      tails.get(3 * i + 1).has_value() &&
                                      tails.get(3 * i + 2).has_value()),
                "decoder_stack: a tail needs a quantized linear, its rows and its tensors");
  }
  const Linears linear{qscales, kinds, tails, tail_kinds, tail_rows};
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == dm.hidden && x_in.is_contiguous(),
              "decoder_stack: x must be contiguous [tokens, hidden]");
  TORCH_CHECK(kv_kind >= -1 && kv_kind <= 2, "decoder_stack: kv_kind must be -1, 0, 1 or 2");
  const int64_t t = x_in.size(0), qs = dm.q_size(), kvs = dm.kv_size();
  const int64_t nqkv = qs + 2 * kvs;
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
    at::Tensor qkv = linear(b, h, w[1], biases.get(b), nqkv);
    at::Tensor q = qkv.narrow(1, 0, qs).view({t, dm.heads, dm.head_dim});
    at::Tensor k = qkv.narrow(1, qs, kvs).view({t, dm.kv_heads, dm.head_dim});
    at::Tensor v = qkv.narrow(1, qs + kvs, kvs).view({t, dm.kv_heads, dm.head_dim});
    kvserve::rope(positions, q, k, cos, sin);
    const at::Tensor& cache = caches[l];
    const std::optional<at::Tensor> sc = scales.get(l);
    write_layer(k, v, slots, cache, sc, k_shifts.get(l), kv_kind, candidates);
    std::optional<at::Tensor> ks, vs;
    if (kv_kind >= 0) {
      ks = sc->select(0, 0);
      vs = sc->select(0, 1);
    }
    // rows [2, slots, H, D] or tiles [2, slots / 16, H, 16, D] (kv_tiles.h), as blocks
    const int64_t tile = kvserve_tiles::TILE;
    const std::vector<int64_t> shape =
        cache.dim() == 5
            ? std::vector<int64_t>{-1, dm.block_size / tile, dm.kv_heads, tile, dm.head_dim}
            : std::vector<int64_t>{-1, dm.block_size, dm.kv_heads, dm.head_dim};
    const auto blocks = cache.select(0, 0).view(shape);
    const auto vblocks = cache.select(0, 1).view(shape);
    at::Tensor o = kvserve::paged_attention(q, blocks, vblocks, tables, lens, query_start, scale,
                                            window, sinks, ks, vs);
    o = linear(b + 1, o.view({t, qs}), w[2], biases.get(b + 1), dm.hidden);
    h = kvserve::add_rms_norm(o, residual, w[3], eps);
    at::Tensor g = linear.gate_up_silu(b + 2, h, w[4], biases.get(b + 2), dm.inter);
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
        "int[] kinds, Tensor?[] tails, int[] tail_kinds, int[] tail_rows) -> (Tensor, Tensor)");
  m.impl("decoder_stack", c10::DispatchKey::CPU, TORCH_FN(decoder_stack));
}
