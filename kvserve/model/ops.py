"""Element-wise building blocks of the decoder, in two interchangeable implementations.

``TorchOps`` is plain PyTorch (any device). ``CpuKernelOps`` calls the fused C++ kernels
(``torch.ops.kvserve``), which follow the same rounding, so outputs agree bit-for-bit in
float32 and to the last bf16/fp16 rounding otherwise. The model receives one at build time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchOps:
    """Reference implementations (HF semantics: RMSNorm statistics in float32)."""

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return w * x32.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(rms_norm(residual + x), residual + x)``; may update ``residual``."""
        residual = residual + x
        return self.rms_norm(residual, w, eps), residual

    def gemma_rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """Gemma's RMSNorm: ``x / rms(x) * (1 + w)`` in float32, cast to ``x``'s dtype once
        at the end (HF ``GemmaRMSNorm``)."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return (x32 * (1.0 + w.float())).to(x.dtype)

    def gemma_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gemma_rms_norm(residual + x), residual + x)``; may update ``residual``."""
        residual = residual + x
        return self.gemma_rms_norm(residual, w, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU over ``[..., gate | up]``: ``gelu_pytorch_tanh(gate) * up`` (Gemma)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def clamped_swiglu(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """gpt-oss's expert activation of ``gate_up`` ``[..., 2 * inter]`` laid out
        ``[gate; up]``: the gate clamped above at ``limit``, up to ``±limit``, then
        ``gate * sigmoid(alpha * gate) * (up + 1)`` (transformers' ``GptOssExperts``)."""
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
        return gate * torch.sigmoid(gate * alpha) * (up + 1)

    def rope(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c = cos[positions].unsqueeze(1)
        s = sin[positions].unsqueeze(1)
        return _rotate(q, c, s), _rotate(k, c, s)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class CpuKernelOps(TorchOps):
    """Fused C++ kernels for CPU tensors; falls back to PyTorch for layouts they don't take.

    Construct only after ``load_cpu_kernels()`` returned True.
    """

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """One C++ pass for contiguous ``x`` and for 3-D ``x`` whose last dimension is
        contiguous (Qwen3's q/k views of the qkv output); others as ``TorchOps``."""
        if not (x.is_contiguous() or (x.dim() == 3 and x.stride(-1) == 1)):
            return super().rms_norm(x, w, eps)
        return torch.ops.kvserve.rms_norm(x, w, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.kvserve.add_rms_norm(x, residual, w, eps), residual

    def gemma_rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """One C++ pass (``csrc/gemma_ops.cpp``) for 2-D and 3-D ``x`` whose last dimension
        is contiguous (the q/k views of the qkv output qualify); others as ``TorchOps``."""
        if x.dim() not in (2, 3) or x.stride(-1) != 1:
            return super().gemma_rms_norm(x, w, eps)
        return torch.ops.kvserve.gemma_rms_norm(x, w, eps)

    def gemma_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not (x.is_contiguous() and residual.is_contiguous()):
            return super().gemma_add_rms_norm(x, residual, w, eps)
        return torch.ops.kvserve.gemma_add_rms_norm(x, residual, w, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvserve.silu_and_mul(gate_up)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() != 2 or gate_up.stride(1) != 1:
            return super().gelu_tanh_and_mul(gate_up)
        return torch.ops.kvserve.gelu_tanh_and_mul(gate_up)

    def clamped_swiglu(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """bf16 rows in one C++ pass (float math, rounded once: what ``moe_experts`` runs,
        so the expert loop and the one-call kernel agree bit for bit); other dtypes and
        layouts as ``TorchOps``."""
        if gate_up.dtype != torch.bfloat16 or gate_up.dim() != 2 or gate_up.stride(1) != 1:
            return super().clamped_swiglu(gate_up, alpha, limit)
        return torch.ops.kvserve.clamped_swiglu(gate_up, alpha, limit)

    def rope(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        torch.ops.kvserve.rope(positions, q, k, cos, sin)
        return q, k
