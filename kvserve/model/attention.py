"""Attention over the paged KV cache, behind a small backend interface.

The model code calls ``backend.forward(q, k, v, kv_cache, meta)`` and knows nothing about
blocks. ``AttentionMetadata`` is built once per engine step by the model runner and shared
by all layers. Token order in a batch: all decode tokens first (one per sequence), then the
prefill chunks, each contiguous.

Cache layout per layer: ``kv_cache[0]`` (keys) and ``kv_cache[1]`` (values), each
``[num_slots, num_kv_heads, head_dim]`` where slot = block_id * block_size + offset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One sequence's chunk of new tokens in a step.

    ``start``/``end`` index the batch's token dimension; ``context_len`` is the sequence
    length after this chunk (cached tokens + new). ``slot_idx`` lists the cache slots of
    all ``context_len`` tokens, or is None when the chunk is the whole sequence so far
    (then the chunk's own K/V are used directly). ``mask`` is None for plain causal.
    """

    start: int
    end: int
    context_len: int
    slot_idx: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """Per-step description of where each token's K/V goes and what it attends to."""

    slot_mapping: torch.Tensor
    num_decodes: int = 0
    decode_slot_idx: torch.Tensor | None = None  # [num_decodes, max_len]
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_len], True = attend
    prefills: list[PrefillChunk] = field(default_factory=list)


class AttentionBackend(Protocol):
    """Writes new K/V into the cache and returns attention output ``[tokens, heads, dim]``."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


class TorchPagedAttention:
    """Portable backend (CPU and CUDA) built on ``scaled_dot_product_attention``.

    Decodes are batched: their context is gathered from the cache by slot index into a
    padded tensor with a validity mask. Prefill chunks run one sequence at a time.
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            idx = meta.decode_slot_idx
            kd = k_cache[idx].to(q.dtype).transpose(1, 2)  # [B, Hkv, L, D]
            vd = v_cache[idx].to(q.dtype).transpose(1, 2)
            qd = q[:nd].unsqueeze(2)  # [B, Hq, 1, D]
            o = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
            )
            out[:nd] = o.squeeze(2)
        for p in meta.prefills:
            qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)
            if p.slot_idx is None:
                kp, vp = k[p.start : p.end], v[p.start : p.end]
            else:
                kp = k_cache[p.slot_idx].to(q.dtype)
                vp = v_cache[p.slot_idx].to(q.dtype)
            kp = kp.transpose(0, 1).unsqueeze(0)
            vp = vp.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qp,
                kp,
                vp,
                attn_mask=p.mask,
                is_causal=p.mask is None,
                scale=scale,
                enable_gqa=True,
            )
            out[p.start : p.end] = o.squeeze(0).transpose(0, 1)
        return out
