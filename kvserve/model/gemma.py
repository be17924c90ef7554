"""Gemma 2 and 3 decoders: Llama's attention and paged KV with Gemma's layer around them.

What differs from ``llama.LlamaForCausalLM``, as HF transformers computes it:

- RMSNorm scales by ``1 + w`` and keeps float32 until the end (``GemmaRMSNorm``);
- four norms a layer: after attention, and before and after the MLP (``GemmaDecoderLayer``);
- embeddings multiplied by ``sqrt(hidden_size)`` (rounded to the model's dtype);
- GeGLU MLP (``mlp.GeluMLP``), q/k norms (Gemma 3), queries scaled by
  ``query_pre_attn_scalar ** -0.5``, optional final logit soft-capping and (Gemma 2)
  attention score soft-capping, which the attention backends apply (``ModelSpec``);
- interleaved sliding and global layers (``spec.layer_windows``), the sliding ones with
  their own rotary base (``spec.local_rope``): both handled by the base class.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.model.attention import AttentionBackend, AttentionMetadata
from kvserve.model.gemma_stack import GemmaStack
from kvserve.model.llama import Attention, LlamaForCausalLM
from kvserve.model.mlp import make_mlp
from kvserve.model.ops import TorchOps
from kvserve.model.parallel import TPGroup
from kvserve.model.spec import ModelSpec


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + w)`` in float32, cast to ``x``'s dtype at the end
    (``ops.gemma_rms_norm``: one C++ pass with the CPU kernels)."""

    def __init__(self, dim: int, eps: float, ops: TorchOps | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.ops = ops or TorchOps()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.gemma_rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``; may update ``residual`` in place."""
        return self.ops.gemma_add_rms_norm(x, residual, self.weight, self.eps)


class GemmaDecoderLayer(nn.Module):
    """Sandwich-norm block: ``h += post_attn(attn(in(h)))``, ``h += post_ffn(mlp(pre_ffn(h)))``."""

    fused_stack_order = "gemma"  # gemma_stack (model/gemma_stack.py) runs it in C++

    def __init__(
        self,
        spec: ModelSpec,
        backend: AttentionBackend,
        ops: TorchOps,
        tp: TPGroup | None,
        layer: int = 0,
    ):
        super().__init__()
        eps, h = spec.rms_norm_eps, spec.hidden_size
        self.input_layernorm = GemmaRMSNorm(h, eps, ops)
        self.self_attn = Attention(spec, backend, ops, tp, norm_class=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, ops)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, ops)
        self.mlp = make_mlp(spec, ops, tp, layer)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, ops)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``llama.DecoderLayer``: ``(block output, residual)``, whose sum is the output;
        each residual add is fused into the norm that follows it."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h, rope, kv_cache, meta))
        h, residual = self.pre_feedforward_layernorm.add_forward(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 and Gemma 3 (text) with the base class's loading, tensor parallelism and LM
    head."""

    layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm
    stack_class = GemmaStack

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = super()._embed(ids)
        return x * torch.tensor(self.spec.hidden_size**0.5).to(x.dtype)

    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        out = super().expected_weights()
        for i in range(self.spec.num_layers):
            p = f"model.layers.{i}."
            for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                out[p + f"{name}.weight"] = (self.spec.hidden_size,)
        return out
