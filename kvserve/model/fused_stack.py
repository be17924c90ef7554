"""The whole decoder stack in one C++ call, where every part of it is a CPU kernel.

``torch.ops.kvserve.decoder_stack`` (``csrc/decoder_stack.cpp``) runs the layers' kernels in
the order ``llama.DecoderLayer`` calls them, so its result equals the Python loop's bit for
bit; it saves the Python between the kernels (~70 µs a layer: a tenth of a 32-sequence
decode step of SmolLM2 on 2 cores). ``FusedStack.build`` takes a loaded, prepacked model
and returns None when any part is not one the C++ loop runs: in every linear kvserve's
bf16 GEMM (with SiLU in the gate/up one) or a GGUF-quantized weight of one or two parts
(``GGUFLinear``: a Q4_K_M file's Q/K/V is Q4_K then Q6_K), the fused element-wise ops
(Qwen3's q/k norms included), ``CpuPagedAttention`` and no tensor parallelism. At call time
a cache it cannot write in C++ (head scales, calibration pending) sends that step back to
the Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvserve.model.attention import AttentionMetadata, CpuPagedAttention
from kvserve.model.kv_quant import QuantizedKVCache
from kvserve.model.linear import KernelGateUpSilu, KernelLinear
from kvserve.model.ops import CpuKernelOps
from kvserve.model.quantized import GGUFLinear

_PLAIN = -1  # decoder_stack's kv_kind for a 16-bit cache written by copy


@dataclass(frozen=True)
class _CacheArgs:
    """One step's view of the layers' caches, as ``decoder_stack`` takes them."""

    tensors: list[torch.Tensor]
    scales: list[torch.Tensor | None]
    k_shifts: list[torch.Tensor | None]
    kind: int
    candidates: int


def runs_linear(linear: nn.Module) -> bool:
    """A linear the C++ loop calls: kvserve's bf16 GEMM, or one or two quantized parts."""
    return isinstance(linear, KernelLinear) or (
        isinstance(linear, GGUFLinear) and len(linear.parts) <= 2
    )


def _runs_gate_up(mlp: nn.Module) -> bool:
    """The gate/up projection with SiLU fused (bf16), or one quantized part before it."""
    if isinstance(mlp.gate_up_proj, KernelGateUpSilu):
        return bool(mlp.gate_up_applies_silu)
    return runs_linear(mlp.gate_up_proj) and not mlp.gate_up_applies_silu


def one_eps(norms: list[nn.Module], layer: nn.Module, first: nn.Module) -> bool:
    """Whether ``norms`` (a layer's) and ``layer``'s q/k norms, if any, all have the first
    layer's eps: the C++ loop takes one."""
    a = layer.self_attn
    if a.q_norm is not None:
        norms = [*norms, a.q_norm, a.k_norm]
    return all(n.eps == first.input_layernorm.eps for n in norms)


def _weight(linear: nn.Module) -> torch.Tensor:
    return linear.parts[0].qs if isinstance(linear, GGUFLinear) else linear.packed_weight


def _bias(linear: GGUFLinear) -> torch.Tensor | None:
    """A quantized linear's bias, whole (the C++ loop splits it between two parts)."""
    parts = linear.bias_parts
    if parts[0] is None:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _inter(gate_up: nn.Module) -> int:
    """The MLP's intermediate size (a fused SiLU layer's out_features already is)."""
    n = gate_up.out_features
    return n if isinstance(gate_up, KernelGateUpSilu) else n // 2


class FusedStack:
    """The weights of every layer, in ``decoder_stack``'s order, and the constants of the
    call. Build it with ``FusedStack.build``; it holds references, not copies. A subclass
    runs another layer order (``gemma_stack.GemmaStack``): its ``order`` names the layers'
    ``fused_stack_order`` it accepts, ``layer_weights`` lists a layer's weights."""

    order = "llama"  # the layers' fused_stack_order this stack runs
    local_rope = False  # whether it rotates sliding layers with their own tables (Gemma 3)

    def __init__(self, model: nn.Module):
        layers = model.layers
        backend = layers[0].self_attn.backend
        self.weights: list[torch.Tensor] = []
        self.biases: list[torch.Tensor | None] = []
        self.qscales: list[torch.Tensor | None] = []  # (d, aux) of each quantized linear
        self.kinds: list[int] = []  # per linear: -1 (bf16 GEMM) or gguf_linear's kind
        # a quantized linear's second part: (qs, d, aux), its kind (-1: none) and rows
        self.tails: list[torch.Tensor | None] = []
        self.tail_kinds: list[int] = []
        self.tail_rows: list[int] = []
        self.qk_norms: list[torch.Tensor | None] = []  # per layer: q's, k's (or None, None)
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            self.qk_norms += (
                [None, None] if a.q_norm is None else [a.q_norm.weight, a.k_norm.weight]
            )
            linears = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
            self.weights += self.layer_weights(layer, [_weight(lin) for lin in linears])
            for lin in linears:
                quantized = isinstance(lin, GGUFLinear)
                self.biases.append(_bias(lin) if quantized else lin.bias)
                part = lin.parts[0] if quantized else None
                self.qscales += [part.d, part.aux] if part else [None, None]
                self.kinds.append(part.kind if part else -1)
                tail = lin.parts[1] if quantized and len(lin.parts) == 2 else None
                self.tails += [tail.qs, tail.d, tail.aux] if tail else [None] * 3
                self.tail_kinds.append(tail.kind if tail else -1)
                self.tail_rows.append(tail.n if tail else 0)
        a0 = layers[0].self_attn
        self.dims = [
            a0.num_heads,
            a0.num_kv_heads,
            a0.head_dim,
            a0.o_proj.out_features,
            _inter(layers[0].mlp.gate_up_proj),
            backend.block_size,
        ]
        self.eps = float(layers[0].input_layernorm.eps)
        self.scale = float(a0.scale)
        self.window, self.sinks = backend.window, backend.sinks
        self.dtype = layers[0].input_layernorm.weight.dtype

    @staticmethod
    def layer_weights(layer: nn.Module, linears: list[torch.Tensor]) -> list[torch.Tensor]:
        """``layer``'s weights in the C++ loop's order, given its four linears' (qkv, o,
        gate_up, down)."""
        w = linears
        return [
            layer.input_layernorm.weight, w[0], w[1],
            layer.post_attention_layernorm.weight, w[2], w[3],
        ]  # fmt: skip

    @classmethod
    def runs_layer(cls, layer: nn.Module, first: nn.Module) -> bool:
        """Whether the C++ loop runs ``layer`` as it is (``first``: the model's first layer,
        whose constants the call takes)."""
        a, m = layer.self_attn, layer.mlp
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        return (
            a.backend is first.self_attn.backend
            and _runs_gate_up(m)
            and (a.q_norm is None or isinstance(a.q_norm.ops, CpuKernelOps))  # Qwen3's
            and one_eps(norms, layer, first)
        )

    @classmethod
    def build(cls, model: nn.Module) -> FusedStack | None:
        """The stack for ``model`` (a ``LlamaForCausalLM`` after ``prepack_linears``; its
        ``stack_class``, this class by default), or None when some part of its layers is
        not a kernel the C++ loop calls."""
        layers = getattr(model, "layers", None)
        if not layers or getattr(model, "tp", None) is not None:
            return None
        backend = layers[0].self_attn.backend
        if not isinstance(backend, CpuPagedAttention):
            return None
        stack: type[FusedStack] = getattr(model, "stack_class", FusedStack)
        spec = getattr(model, "spec", None)
        if getattr(spec, "local_rope", None) is not None and not stack.local_rope:
            return None
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            if (
                getattr(layer, "fused_stack_order", None) != stack.order
                or not hasattr(m, "down_proj")  # a mixture of experts
                or not isinstance(a.backend, CpuPagedAttention)
                or getattr(a, "sinks", None) is not None  # learned sinks (gpt-oss)
                or not isinstance(a.ops, CpuKernelOps)
                or not isinstance(layer.input_layernorm.ops, CpuKernelOps)
                or not all(runs_linear(x) for x in (a.qkv_proj, a.o_proj, m.down_proj))
                or not stack.runs_layer(layer, layers[0])
            ):
                return None
        return stack(model)

    def cache_args(self, kv_caches: list) -> _CacheArgs | None:
        """What ``decoder_stack`` needs of ``kv_caches``, or None when a cache is of a kind
        only the Python loop writes (head scales, another dtype, not contiguous)."""
        first = kv_caches[0]
        if isinstance(first, QuantizedKVCache):
            if first.fmt.scale != "token" or not first.data.is_cpu:
                return None
            caches: list[QuantizedKVCache] = kv_caches
            return _CacheArgs(
                [c.data for c in caches],
                [c.scale for c in caches],
                [c.k_shift for c in caches],
                first.kernel_kind,
                first.candidates,
            )
        if not all(
            isinstance(c, torch.Tensor) and c.dtype == self.dtype and c.is_contiguous()
            for c in kv_caches
        ):
            return None
        n = len(kv_caches)
        return _CacheArgs(list(kv_caches), [None] * n, [None] * n, _PLAIN, 1)

    def step_args(self, x: torch.Tensor, kv_caches: list) -> _CacheArgs | None:
        """``cache_args(kv_caches)``, or None also when ``x`` is not a contiguous tensor of
        the weights' dtype: a step the C++ loop cannot run."""
        if x.dtype != self.dtype or not x.is_contiguous():
            return None
        return self.cache_args(kv_caches)

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list,
        meta: AttentionMetadata,
        local_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(x, residual)`` after every layer (the stack's output is their normed sum),
        writing this step's K/V; None, with nothing written, when ``cache_args`` refuses
        the caches or ``x`` is not of the weights' dtype. ``local_rope``: the sliding
        layers' cos/sin tables, for a stack whose ``local_rope`` is set."""
        args = self.step_args(x, kv_caches)
        if args is None:
            return None
        assert meta.seq_block_tables is not None and meta.seq_lens is not None
        assert meta.query_start is not None
        return torch.ops.kvserve.decoder_stack(
            x,
            positions,
            rope[0],
            rope[1],
            self.weights,
            self.biases,
            args.tensors,
            args.scales,
            args.k_shifts,
            meta.slot_mapping,
            meta.seq_block_tables,
            meta.seq_lens,
            meta.query_start,
            self.dims,
            self.eps,
            self.scale,
            self.window,
            self.sinks,
            args.kind,
            args.candidates,
            self.qscales,
            self.kinds,
            self.tails,
            self.tail_kinds,
            self.tail_rows,
            self.qk_norms,
        )
