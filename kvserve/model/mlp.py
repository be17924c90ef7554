"""The feed-forward half of a decoder layer: dense (SwiGLU, GeGLU) or a sparse mixture of
experts (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral, gpt-oss).

A dense MLP fuses gate and up into one projection at load time; under tensor parallelism
each rank holds a slice of the intermediate size and the down projection's partial sums
are all-reduced. ``SparseMoE`` routes each token to its top-k experts, runs each expert
once over all the tokens routed to it (one GEMM pair per expert hit, never a loop over
tokens; on the CPU every expert of the layer in one C++ call, ``ExpertKernel`` for bf16
experts, ``QuantizedExpertKernel`` for quantized ones) and sums each token's weighted
outputs over its own top-k slots, so a token's result does not depend on the other tokens
of the step: with kvserve's GEMMs (batch-invariant by construction) the MoE layer is
batch-invariant too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from kvserve.model.ops import TorchOps
from kvserve.model.parallel import TPGroup
from kvserve.model.spec import ModelSpec


class MLP(nn.Module):
    # prepack_linears may swap gate_up_proj for a layer that applies SiLU-and-mul itself
    # (KernelGateUpSilu), and then sets gate_up_applies_silu.
    silu_fusable = "gate_up_proj"

    def __init__(self, spec: ModelSpec, ops: TorchOps, tp: TPGroup | None):
        super().__init__()
        self.gate_up_applies_silu = False
        self.inter = spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * self.inter, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(self.inter, spec.hidden_size, bias=spec.mlp_bias)
        self.ops = ops
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        if not self.gate_up_applies_silu:
            h = self.act_and_mul(h)
        out = self.down_proj(h)
        return out if self.tp is None else self.tp.all_reduce(out)

    def act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(gate_up)


class GeluMLP(MLP):
    """GeGLU (``gelu_pytorch_tanh`` of the gate times up: Gemma)."""

    silu_fusable = None

    def act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.gelu_tanh_and_mul(gate_up)


class ClampedSwiGLU(MLP):
    """gpt-oss's expert activation: the gate clamped above and up to ``±limit``, then
    ``gate * sigmoid(alpha * gate) * (up + 1)`` (the checkpoint's interleaved gate/up
    columns are split into halves at load: ``model/gpt_oss.py``)."""

    silu_fusable = None

    def __init__(self, spec: ModelSpec, ops: TorchOps, tp: TPGroup | None):
        super().__init__(spec, ops, tp)
        assert spec.swiglu_limit is not None
        self.limit, self.alpha = spec.swiglu_limit, spec.swiglu_alpha

    def act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.clamped_swiglu(gate_up, self.alpha, self.limit)


def _swiglu_clamp(expert: nn.Module) -> tuple[float, float]:
    """The one-call kernels' ``(swiglu_alpha, swiglu_limit)`` of ``expert``: gpt-oss's
    clamped SwiGLU's, or ``(1.0, 0.0)`` (plain SwiGLU)."""
    if isinstance(expert, ClampedSwiGLU):
        return expert.alpha, expert.limit
    return 1.0, 0.0


@dataclass(frozen=True)
class ExpertKernel:
    """Every expert of a ``SparseMoE`` through one ``moe_experts`` call (``csrc/
    moe_experts.cpp``): their packed weights and biases, in expert order. The same kernel
    functions as the experts' own modules, so the same bits, without a Python call per
    expert."""

    gate_up: list[torch.Tensor]
    gate_up_bias: list[torch.Tensor | None]
    down: list[torch.Tensor]
    down_bias: list[torch.Tensor | None]
    inter: int
    hidden: int
    swiglu_alpha: float = 1.0
    swiglu_limit: float = 0.0  # > 0: gpt-oss's clamped SwiGLU (ops.clamped_swiglu)

    @classmethod
    def of(cls, experts: nn.ModuleList) -> ExpertKernel | None:
        """The kernel for ``experts`` after ``prepack_linears``, or None unless every one is
        a SwiGLU ``MLP`` on kvserve's bf16 GEMM (``KernelGateUpSilu``, ``KernelLinear``) or
        a ``ClampedSwiGLU`` on it (``KernelLinear`` twice, the C++ ops)."""
        from kvserve.model.linear import KernelGateUpSilu, KernelLinear
        from kvserve.model.ops import CpuKernelOps

        def fits(e: nn.Module) -> bool:
            if not isinstance(e.down_proj, KernelLinear):
                return False
            if type(e) is MLP:
                return isinstance(e.gate_up_proj, KernelGateUpSilu)
            return (
                type(e) is ClampedSwiGLU
                and type(e.gate_up_proj) is KernelLinear
                and isinstance(e.ops, CpuKernelOps)
            )

        if not all(fits(e) for e in experts):
            return None
        first = experts[0]
        return cls(
            [e.gate_up_proj.packed_weight for e in experts],
            [e.gate_up_proj.bias for e in experts],
            [e.down_proj.packed_weight for e in experts],
            [e.down_proj.bias for e in experts],
            first.inter,
            first.down_proj.out_features,
            *_swiglu_clamp(first),
        )

    def __call__(self, grouped: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``grouped`` ``[rows, hidden]``, expert e's ``counts[e]`` rows after expert
        e - 1's → each row through its expert, ``[rows, hidden]``."""
        return torch.ops.kvserve.moe_experts(
            grouped, counts, self.gate_up, self.gate_up_bias, self.down, self.down_bias,
            self.inter, self.hidden, self.swiglu_alpha, self.swiglu_limit,
        )  # fmt: skip


@dataclass(frozen=True)
class QuantizedExpertKernel:
    """Every expert of a ``SparseMoE`` whose weights are kept quantized (a GGUF file's,
    ``--quantization int8``'s: ``quantized.GGUFLinear``) through one
    ``moe_experts_quantized`` call: each expert's gate/up parts and down part, flattened
    to (qs, d, aux) triples in expert order. The same kernels as the modules' loop."""

    gate_up: list[torch.Tensor]
    gate_up_kinds: list[int]
    gate_up_ns: list[int]
    gate_up_bias: list[torch.Tensor | None]
    down: list[torch.Tensor]
    down_kind: int
    down_bias: list[torch.Tensor | None]
    inter: int
    hidden: int
    swiglu_alpha: float = 1.0
    swiglu_limit: float = 0.0

    @classmethod
    def of(cls, experts: nn.ModuleList) -> QuantizedExpertKernel | None:
        """The kernel for ``experts``, or None unless every one is a SwiGLU ``MLP`` or a
        ``ClampedSwiGLU`` on C++ ops whose projections are ``GGUFLinear`` of the same
        part kinds and sizes (down: one part)."""
        from kvserve.model.ops import CpuKernelOps
        from kvserve.model.quantized import GGUFLinear

        def layout(e: nn.Module) -> tuple | None:
            up, down = e.gate_up_proj, e.down_proj
            if type(e) not in (MLP, ClampedSwiGLU) or not isinstance(e.ops, CpuKernelOps):
                return None
            if not (isinstance(up, GGUFLinear) and isinstance(down, GGUFLinear)):
                return None
            if len(down.parts) != 1:
                return None
            return tuple((p.kind, p.n) for p in up.parts), down.parts[0].kind

        shapes = {layout(e) for e in experts}
        if len(shapes) != 1 or None in shapes:
            return None
        ((up_parts, down_kind),) = shapes
        first = experts[0]
        return cls(
            [t for e in experts for p in e.gate_up_proj.parts for t in (p.qs, p.d, p.aux)],
            [kind for kind, _ in up_parts],
            [n for _, n in up_parts],
            [b for e in experts for b in e.gate_up_proj.bias_parts],
            [t for e in experts for p in e.down_proj.parts for t in (p.qs, p.d, p.aux)],
            down_kind,
            [e.down_proj.bias_parts[0] for e in experts],
            first.inter,
            first.down_proj.out_features,
            *_swiglu_clamp(first),
        )

    def __call__(self, grouped: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
        """As ``ExpertKernel``; None where the call does not take ``grouped`` (gpt-oss's
        activation in another dtype than bf16): the caller loops over the experts."""
        if self.swiglu_limit > 0 and grouped.dtype != torch.bfloat16:
            return None
        return torch.ops.kvserve.moe_experts_quantized(
            grouped, counts, self.gate_up, self.gate_up_kinds, self.gate_up_ns,
            self.gate_up_bias, self.down, self.down_kind, self.down_bias, self.inter,
            self.hidden, self.swiglu_alpha, self.swiglu_limit,
        )  # fmt: skip


class SparseMoE(nn.Module):
    """Top-k routed experts: ``gate`` (the router, ``[experts, hidden]``) and ``experts``,
    dense SwiGLU MLPs of ``spec.moe_intermediate_size``.

    Routing as transformers computes it: softmax of the router logits in float32, the
    top ``num_experts_per_tok``, renormalised to sum to 1 when ``spec.norm_topk_prob``;
    gpt-oss (``spec.softmax_after_topk``): the top logits of a router with a bias, then
    their softmax, into experts of ``ClampedSwiGLU`` with biases.
    The tokens are grouped by expert (one gather), each expert runs once over its group,
    and each token's expert outputs, weighted in float32, are summed in top-k slot order
    (a sum over one row's own values: it does not depend on the other tokens). Under
    tensor parallelism every rank routes alike (the router is replicated) and holds a
    slice of every expert's intermediate size; the weighted partial sums are all-reduced.

    Qwen2-MoE's shared expert (``spec.shared_expert_intermediate_size``): a dense SwiGLU
    MLP every token goes through, scaled by ``sigmoid(shared_expert_gate(x))`` and added
    to the routed experts' sum (under TP split like a dense MLP, inside the one
    all-reduce).
    """

    def __init__(self, spec: ModelSpec, ops: TorchOps, tp: TPGroup | None):
        super().__init__()
        self.tp = tp
        self.top_k = spec.num_experts_per_tok
        self.norm_topk_prob = spec.norm_topk_prob
        self.softmax_after_topk = spec.softmax_after_topk
        self.gate = nn.Linear(spec.hidden_size, spec.num_experts, bias=spec.router_bias)
        expert = dataclasses.replace(spec, intermediate_size=spec.moe_intermediate_size)
        kind = MLP if spec.swiglu_limit is None else ClampedSwiGLU
        self.experts = nn.ModuleList(kind(expert, ops, None) for _ in range(spec.num_experts))
        # every expert in one C++ call, set by use_expert_kernels after prepack_linears
        self.expert_kernel: ExpertKernel | QuantizedExpertKernel | None = None
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Module | None = None
        if spec.shared_expert_intermediate_size:
            shared = dataclasses.replace(
                spec, intermediate_size=spec.shared_expert_intermediate_size
            )
            self.shared_expert = MLP(shared, ops, None)
            self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x).float()
        if self.softmax_after_topk:
            top, chosen = torch.topk(logits, self.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1)
        else:
            weights, chosen = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs by expert
        grouped = x.index_select(0, order // self.top_k)  # each expert's tokens together
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        h = None
        if self.expert_kernel is not None:
            h = self.expert_kernel(grouped, counts)  # index_select: contiguous rows
        if h is not None:  # weighted and summed per token in C++ too
            out = torch.ops.kvserve.moe_combine(h, weights.contiguous(), order)
        else:
            parts, start = [], 0
            for expert, n in zip(self.experts, counts, strict=True):
                if n:
                    parts.append(expert(grouped[start : start + n]))
                    start += n
            h = torch.cat(parts).float() * weights.flatten()[order, None]
            # back to (token, slot) order; each token's k outputs summed in slot order
            h = h[torch.argsort(order)].view(x.shape[0], self.top_k, -1)
            out = h.sum(dim=1).to(x.dtype)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)


def use_expert_kernels(model: nn.Module) -> int:
    """Give every ``SparseMoE`` of ``model`` (after ``prepack_linears``) its
    ``ExpertKernel`` where its experts run on kvserve's bf16 GEMM, or its
    ``QuantizedExpertKernel`` where they are kept quantized; returns how many got one
    (the rest keep the loop over their expert modules)."""
    count = 0
    for module in model.modules():
        if isinstance(module, SparseMoE):
            module.expert_kernel = ExpertKernel.of(module.experts) or QuantizedExpertKernel.of(
                module.experts
            )
            count += module.expert_kernel is not None
    return count


def make_mlp(spec: ModelSpec, ops: TorchOps, tp: TPGroup | None, layer: int) -> nn.Module:
    """Layer ``layer``'s feed-forward module: ``SparseMoE`` where ``spec`` routes it to
    experts, else the dense MLP of ``spec.hidden_act``."""
    if spec.is_moe_layer(layer):
        return SparseMoE(spec, ops, tp)
    return (GeluMLP if spec.hidden_act == "gelu_pytorch_tanh" else MLP)(spec, ops, tp)


# Mixtral's checkpoint names for what Qwen3-MoE (and kvserve) call mlp, gate/up/down
_MIXTRAL_NAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".w1.", ".gate_proj."),
    (".w3.", ".up_proj."),
    (".w2.", ".down_proj."),
)


def our_mlp_name(name: str) -> str:
    """A checkpoint tensor name with Mixtral's MoE names replaced by ours."""
    if ".block_sparse_moe." not in name:
        return name
    for theirs, ours in _MIXTRAL_NAMES:
        name = name.replace(theirs, ours)
    return name


def mlp_weights(spec: ModelSpec, layer: int, prefix: str) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names and shapes of layer ``layer``'s MLP (``prefix``:
    ``model.layers.N.``), as the checkpoint of ``spec.family`` names them."""
    h = spec.hidden_size
    if not spec.is_moe_layer(layer):
        inter, experts, mlp = spec.intermediate_size, [""], prefix + "mlp."
    else:
        inter = spec.moe_intermediate_size
        mlp = prefix + ("block_sparse_moe." if spec.family == "mixtral" else "mlp.")
        experts = [f"experts.{e}." for e in range(spec.num_experts)]
    out: dict[str, tuple[int, ...]] = {}
    if spec.is_moe_layer(layer):
        out[mlp + "gate.weight"] = (spec.num_experts, h)
        if spec.router_bias:
            out[mlp + "gate.bias"] = (spec.num_experts,)
        if spec.shared_expert_intermediate_size:
            out[mlp + "shared_expert_gate.weight"] = (1, h)
    names = ("gate_proj", "up_proj", "down_proj")
    shapes: tuple[tuple[int, int], ...] = ((inter, h), (inter, h), (h, inter))
    if spec.family == "mixtral":
        names = ("w1", "w3", "w2")
    elif spec.fused_checkpoint:  # Phi-3 stores gate and up as one tensor
        names, shapes = ("gate_up_proj", "down_proj"), ((2 * inter, h), (h, inter))
    for e in experts:
        for name, shape in zip(names, shapes, strict=True):
            out[f"{mlp}{e}{name}.weight"] = shape
            if spec.mlp_bias:
                out[f"{mlp}{e}{name}.bias"] = (shape[0],)
    if spec.is_moe_layer(layer) and spec.shared_expert_intermediate_size:
        s = spec.shared_expert_intermediate_size
        for name, shape in zip(names, ((s, h), (s, h), (h, s)), strict=True):
            out[f"{mlp}shared_expert.{name}.weight"] = shape
    return out
