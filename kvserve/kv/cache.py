"""KV tensor shapes, bytes per token and capacity in blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one model's KV cache; the single source of its byte sizes."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) × layers × KV heads × head dim × element size."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, memory_bytes: int) -> int:
        return memory_bytes // self.bytes_per_block

    def allocate(self, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
        """One zeroed tensor for all layers; returns per-layer views ``[2, slots, H, D]``."""
        slots = num_blocks * self.block_size
        full = torch.zeros(
            self.num_layers,
            2,
            slots,
            self.num_kv_heads,
            self.head_dim,
            dtype=self.dtype,
            device=device,
        )
        return list(full.unbind(0))
