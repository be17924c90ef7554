// The kernels' entry points, for C++ callers in this extension (decoder_stack.cpp): the same
// functions torch.ops.kvserve registers, called without the dispatcher. Each is defined as a
// one-line forwarder at the end of its own file; their contracts are stated there.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace kvserve {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
// residual += x (rounded to its dtype); returns rms_norm(residual).
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& w,
                        double eps);
// In place on q and k.
void rope(const at::Tensor& positions, at::Tensor q, at::Tensor k, const at::Tensor& cos,
          const at::Tensor& sin);
void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
              at::Tensor cache);
void quantize_kv(const at::Tensor& x, const at::Tensor& slots, at::Tensor data,
                 at::Tensor scale, int64_t kind, int64_t candidates,
                 const std::optional<at::Tensor>& shift, int64_t part = 0);
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& wp,
                       const std::optional<at::Tensor>& bias, int64_t n);
at::Tensor bf16_linear_silu_mul(const at::Tensor& x, const at::Tensor& wp,
                                const std::optional<at::Tensor>& bias, int64_t inter);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
// Gemma's (1 + w) RMSNorm of 2-D or 3-D x with a contiguous last dimension.
at::Tensor gemma_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
// residual += x (rounded to its dtype); returns gemma_rms_norm(residual).
at::Tensor gemma_add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& w,
                              double eps);
at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up);
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                       const at::Tensor& aux, int64_t kind, int64_t n,
                       const std::optional<at::Tensor>& bias);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& tables,
                           const at::Tensor& lens, const at::Tensor& query_start, double scale,
                           int64_t window, int64_t sinks,
                           const std::optional<at::Tensor>& k_scale,
                           const std::optional<at::Tensor>& v_scale, double softcap = 0.);

}  // namespace kvserve
