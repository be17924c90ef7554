"""Linear layers with weights prepacked on the CPU: kvserve's bf16 GEMM, or oneDNN.

At decode sizes (M = the number of running sequences, 1–64) ``F.linear`` on a bf16 CPU
tensor re-lays out the weight on every call; oneDNN's blocked layout, made once at load
time, measured 1.3–1.8× faster at M ≤ 64 and ~5 % at prefill sizes on this project's
benchmark machines (``benchmarks/kernels/step_profile.py``; vLLM-CPU prepacks the same way). Every
row of the output is computed the same way whatever M is (tested for random shapes, M up
to 2048), which the engine's batch invariance (README, "Determinism") relies on.

On a CPU with AVX-512-BF16, bf16 weights go to ``KernelLinear`` instead: the project's
own GEMM (``csrc/bf16_gemm.cpp``), 1.2–1.5× oneDNN's speed at decode sizes (M ≤ 64, where
oneDNN's call alone costs ~20 µs) and at parity for prefill. Where the CPU also has AMX,
it runs on AMX tiles (``csrc/bf16_gemm_amx.cpp``): 1.2–1.4× oneDNN's AMX kernels at
M = 8–256, ~0.85× at M = 2048; with the decoder stack then in one C++ call, a SmolLM2
decode step is ~30 % shorter there (benchmarks/history/notebook.md, "Twentieth round").
Its rows are batch invariant by construction (one accumulator per output, K in order);
oneDNN's are not on AMX (its sum order there depends on M), so on AMX machines only layers
the kernel cannot take (odd ``in_features``, float16) keep oneDNN and its last-bit batch
dependence.

``prepack_linears`` swaps each ``nn.Linear`` of a loaded model for one of the two; it
applies only to bf16/fp16 weights on a CPU with native kernels for that dtype, and changes
nothing (returns 0) otherwise. Float32 models keep ``F.linear`` so HF parity tests compare
like with like.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from kvserve.hugepages import huge_arena

logger = logging.getLogger(__name__)

_BATCH_HINT = 32  # oneDNN's layout choice barely depends on it (measured M = 1…2048)


def prepack_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """True when oneDNN has native CPU kernels for ``dtype`` on this machine."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    mkldnn = torch.ops.mkldnn
    if not hasattr(mkldnn, "_reorder_linear_weight"):
        return False
    if dtype == torch.bfloat16:
        return bool(mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(mkldnn._is_mkldnn_fp16_supported())
    return False


class _Prepacked(nn.Module):
    """What both packed layers hold: ``packed_weight`` and ``bias`` (or None) as buffers,
    the sizes of the ``nn.Linear`` they replace, and no plain ``weight`` (code that needs
    the checkpoint's tensor must read it before packing)."""

    def __init__(self, linear: nn.Linear, packed: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", packed, False)
        self.register_buffer("bias", bias, False)

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> _Prepacked:
        """A bias-free packed copy of ``weight`` ``[out, in]`` (the original is kept)."""
        lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        lin.weight = nn.Parameter(weight.detach(), requires_grad=False)
        return cls(lin)


class PackedLinear(_Prepacked):
    """``y = x @ W.T + b`` with ``W`` in oneDNN's blocked layout (an opaque tensor)."""

    def __init__(self, linear: nn.Linear):
        w = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach().clone()
        super().__init__(linear, torch.ops.mkldnn._reorder_linear_weight(w, _BATCH_HINT), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[M, in]`` → ``[M, out]``; row i's value does not depend on M.

        oneDNN computes a single row (M = 1) with another kernel whose sum over K runs in
        another order once K is large (measured from K = 1536); a lone row is therefore
        computed as two copies of itself (measured as fast as M = 1).
        """
        if x.dim() == 2 and x.shape[0] == 1:
            y = torch.ops.mkldnn._linear_pointwise(
                x.expand(2, -1).contiguous(), self.packed_weight, self.bias, "none", [], ""
            )
            return y[:1]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def kernel_gemm_preferred(dtype: torch.dtype, device: torch.device) -> bool:
    """True when ``KernelLinear`` is the faster choice here: bf16 on a CPU whose kernels
    were built with AVX-512-BF16, and, where they were built with AMX too, the kernel
    granted this process AMX's tile state (builds and loads the CPU kernels)."""
    if dtype != torch.bfloat16 or device.type != "cpu":
        return False
    from kvserve.model.cpu_kernels import load_cpu_kernels

    return load_cpu_kernels() and bool(torch.ops.kvserve.bf16_gemm_preferred())


def _over_rows(op: Callable[..., torch.Tensor], layer: _Prepacked, x: torch.Tensor) -> torch.Tensor:
    """``op(rows, packed_weight, bias, out_features)`` over the rows of ``x`` ``[..., in]``.

    2-D input with unit column stride (the engine's case) goes straight to the kernel (no
    reshape/view: ~6 µs a call); other shapes are viewed as rows, copied if strided.
    """
    if x.dim() == 2 and x.stride(1) == 1:
        return op(x, layer.packed_weight, layer.bias, layer.out_features)
    rows = x.reshape(-1, layer.in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = op(rows, layer.packed_weight, layer.bias, layer.out_features)
    return y.view(*x.shape[:-1], layer.out_features)


class KernelLinear(_Prepacked):
    """``y = x @ W.T + b`` for bf16 with kvserve's CPU GEMM (``csrc/bf16_gemm.cpp``).

    The weight is held in the kernel's packed layout (its N padded to a multiple of 16);
    the bias, if any, as float32. ``in_features`` must be even (ValueError otherwise).
    """

    def __init__(self, linear: nn.Linear):
        if linear.in_features % 2:
            raise ValueError(f"KernelLinear needs an even in_features, got {linear.in_features}")
        w = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        super().__init__(linear, torch.ops.kvserve.bf16_pack_weight(w), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in]`` → ``[..., out]``; a row's value never depends on the others."""
        return _over_rows(torch.ops.kvserve.bf16_linear, self, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel"


class KernelGateUpSilu(_Prepacked):
    """An MLP's fused gate/up projection and SiLU-and-mul in one kernel call:
    ``silu(x @ W_gate.T + b_gate) * (x @ W_up.T + b_up)``, ``[..., in]`` → ``[..., inter]``.

    It replaces an ``nn.Linear`` of ``2 * inter`` outputs laid out ``[gate; up]`` (what
    ``TorchOps.silu_and_mul`` splits), packed with gate and up blocks of 16 columns
    interleaved. The result equals ``silu_and_mul(KernelLinear(linear)(x))`` bit for bit; it
    never writes the ``[M, 2 * inter]`` intermediate. ``out_features`` is ``inter``.
    """

    def __init__(self, linear: nn.Linear):
        if not self.accepts(linear):
            raise ValueError(
                "KernelGateUpSilu needs an even in_features and 2 * inter outputs with inter "
                f"a multiple of 16, got {linear.in_features} -> {linear.out_features}"
            )
        inter = linear.out_features // 2
        w = linear.weight.detach()
        w = w.view(2, inter // 16, 16, -1).transpose(0, 1).reshape(2 * inter, -1)
        bias = None
        if linear.bias is not None:
            b = linear.bias.detach().float()
            bias = b.view(2, inter // 16, 16).transpose(0, 1).reshape(-1).contiguous()
        super().__init__(linear, torch.ops.kvserve.bf16_pack_weight(w), bias)
        self.out_features = inter

    @staticmethod
    def accepts(linear: nn.Linear) -> bool:
        """True when ``linear``'s shape suits the kernel (even ``in``, ``2 * inter`` outputs
        with ``inter`` a multiple of 16)."""
        return linear.in_features % 2 == 0 and linear.out_features % 32 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in]`` → ``[..., inter]``; a row's value never depends on the others."""
        return _over_rows(torch.ops.kvserve.bf16_linear_silu_mul, self, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, inter={self.out_features}, kernel + SiLU"


def _layer_class(in_features: int, own_gemm: bool) -> type[_Prepacked]:
    """KernelLinear where it is preferred and can take ``in_features``, else PackedLinear."""
    return KernelLinear if own_gemm and in_features % 2 == 0 else PackedLinear


def _weights_on_huge_pages(model: nn.Module) -> None:
    """Move every kvserve-GEMM layer's packed weight into one mapping on huge pages
    (``kvserve/hugepages.py``): a decode step streams them all, and with 4 KiB pages the
    TLB misses on the way cost ~2 % of the GEMMs' time here."""
    layers = [m for m in model.modules() if isinstance(m, (KernelLinear, KernelGateUpSilu))]
    moved = huge_arena([m.packed_weight for m in layers])
    for layer, weight in zip(layers, moved, strict=True):
        layer.packed_weight = weight


def prepack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` in ``model`` by a packed layer, in place.

    Each becomes a ``KernelLinear`` where ``kernel_gemm_preferred`` (and its in_features
    is even), else a ``PackedLinear``. With kvserve's GEMM, a module that names one of its
    linears in ``silu_fusable`` (the MLP's gate/up projection) gets a ``KernelGateUpSilu``
    there when its shape suits, and its ``gate_up_applies_silu`` is set to True. Returns
    how many were replaced: 0 (nothing changed) when the weights' dtype or device has no
    native kernels here. A model whose LM head is tied to its embeddings gets a packed
    copy of the embedding matrix as ``lm_head_packed`` when it has that attribute
    (``LlamaForCausalLM``), costing one more copy of that matrix in memory.
    """
    first = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    if first is None or not prepack_supported(first.weight.dtype, first.weight.device):
        return 0
    own = kernel_gemm_preferred(first.weight.dtype, first.weight.device)
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            fusable = own and getattr(parent, "silu_fusable", None) == name
            if fusable and KernelGateUpSilu.accepts(child):
                parent.register_module(name, KernelGateUpSilu(child))
                parent.gate_up_applies_silu = True
            else:
                parent.register_module(name, _layer_class(child.in_features, own)(child))
            count += 1
    tied = getattr(model, "lm_head", None) is None
    if tied and getattr(model, "lm_head_packed", False) is None:  # None: not set yet
        emb = model.embed_tokens.weight
        model.lm_head_packed = _layer_class(emb.shape[1], own).from_weight(emb)
    if own:
        _weights_on_huge_pages(model)
    logger.info(
        "prepacked %d linear weights (%s) for %s",
        count, first.weight.dtype, "kvserve's bf16 GEMM" if own else "oneDNN",
    )  # fmt: skip
    return count
