"""Gemma 2 / Gemma 3 decoder layers in one C++ call (``csrc/gemma_stack.cpp``).

``GemmaStack`` is ``FusedStack`` for ``gemma.GemmaDecoderLayer``'s order: four (1 + w)
RMSNorms a layer, q/k norms (Gemma 3), GeGLU, score soft-capping (Gemma 2), and the hybrid
models' per-layer differences: each layer's window and sinks, its rotary tables (a Gemma 3
sliding layer has its own base) and, in the hybrid KV layout (``model/kv_groups.py``), its
KV group's slots and block tables. The result equals the Python loop's bit for bit; it
saves the ~15 op calls a layer makes from Python. Built by ``FusedStack.build`` for a
model whose ``stack_class`` is this one; None from it where a part is not a C++ kernel
(the GeGLU after a fused SiLU GEMM cannot occur: Gemma's gate/up is never fused).
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.model.attention import AttentionMetadata
from kvserve.model.fused_stack import FusedStack, one_eps, runs_linear
from kvserve.model.mlp import GeluMLP


class GemmaStack(FusedStack):
    """Per layer, besides ``FusedStack``'s weights and q/k norms: ``layer_info`` = (KV
    group, 1 if it rotates with the sliding tables, window, sinks)."""

    order = "gemma"
    local_rope = True

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.layer_info: list[int] = []
        local = model._local_layers
        groups = model._kv_groups
        for i, layer in enumerate(model.layers):
            a = layer.self_attn
            self.layer_info += [groups[i], int(local[i]), a.backend.window, a.backend.sinks]
        self.softcap = float(model.layers[0].self_attn.softcap)
        self.groups = 1 + max(groups)

    @staticmethod
    def layer_weights(layer: nn.Module, linears: list[torch.Tensor]) -> list[torch.Tensor]:
        w = linears
        return [
            layer.input_layernorm.weight, w[0], w[1],
            layer.post_attention_layernorm.weight, layer.pre_feedforward_layernorm.weight,
            w[2], w[3], layer.post_feedforward_layernorm.weight,
        ]  # fmt: skip

    @classmethod
    def runs_layer(cls, layer: nn.Module, first: nn.Module) -> bool:
        """Gemma's layer with every norm of one eps, a plain gate/up projection (GeGLU is
        applied after it) and the model's scale and soft-cap."""
        a, m = layer.self_attn, layer.mlp
        norms = [
            layer.input_layernorm, layer.post_attention_layernorm,
            layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm,
        ]  # fmt: skip
        return (
            type(m) is GeluMLP
            and runs_linear(m.gate_up_proj)
            and not m.gate_up_applies_silu
            and one_eps(norms, layer, first)
            and (a.scale, a.softcap) == (first.self_attn.scale, first.self_attn.softcap)
        )

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list,
        meta: AttentionMetadata,
        local_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        args = self.step_args(x, kv_caches)
        if args is None:
            return None
        metas = [meta.for_group(g) for g in range(self.groups)]  # uniform: all one table
        for m in metas:
            assert m.seq_block_tables is not None
            if m.seq_lens is not meta.seq_lens or m.query_start is not meta.query_start:
                return None  # the groups' lengths are one tensor (worker/inputs.py)
        assert meta.seq_lens is not None and meta.query_start is not None
        local = local_rope or rope
        return torch.ops.kvserve.gemma_stack(
            x,
            positions,
            [rope[0], rope[1], local[0], local[1]],
            self.weights,
            self.qk_norms,
            self.biases,
            args.tensors,
            args.scales,
            args.k_shifts,
            [m.slot_mapping for m in metas],
            [m.seq_block_tables for m in metas],
            meta.seq_lens,
            meta.query_start,
            self.dims,
            self.layer_info,
            self.eps,
            self.scale,
            self.softcap,
            args.kind,
            args.candidates,
            self.qscales,
            self.kinds,
            self.tails,
            self.tail_kinds,
            self.tail_rows,
        )
