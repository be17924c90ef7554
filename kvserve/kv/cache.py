"""KV tensor shapes, bytes per token and capacity in blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.kv.quant import KVFormat, QuantizedKVCache

_TOKEN_SCALE_BYTES = 2  # float16 per (token, KV head) for int8


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one model's KV cache; the single source of its byte sizes.

    ``dtype`` is the stored element type; ``scale`` is the quantization scale granularity
    (``none``, ``token``: one float16 per token and KV head, ``head``: per layer and head,
    negligible and not counted per token).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    scale: str = "none"

    @classmethod
    def for_format(
        cls, num_layers: int, num_kv_heads: int, head_dim: int, fmt: KVFormat, block_size: int
    ) -> KVCacheSpec:
        return cls(num_layers, num_kv_heads, head_dim, fmt.storage, block_size, fmt.scale)

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) × layers × KV heads × (head dim × element size + per-token scale)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        scale = _TOKEN_SCALE_BYTES if self.scale == "token" else 0
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * elem + scale)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, memory_bytes: int) -> int:
        return memory_bytes // self.bytes_per_block

    def allocate(
        self, num_blocks: int, device: torch.device, fmt: KVFormat | None = None
    ) -> list[torch.Tensor] | list[QuantizedKVCache]:
        """Per-layer caches of ``num_blocks`` blocks: ``[2, slots, H, D]`` tensor views of one
        zeroed allocation, or ``QuantizedKVCache`` objects for a quantized ``fmt``."""
        slots = num_blocks * self.block_size
        if fmt is not None and fmt.quantized:
            return [
                QuantizedKVCache(fmt, slots, self.num_kv_heads, self.head_dim, device)
                for _ in range(self.num_layers)
            ]
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


def block_tensors(caches: list, block_size: int) -> list[torch.Tensor]:
    """Every device tensor holding per-slot data, viewed as ``[2, blocks, block_size, …]``
    (fp8 through uint8: CPU index kernels do not cover fp8). Per-head fp8 scales are
    global and stay on the device."""
    out = []
    for cache in caches:
        parts = [cache]
        if isinstance(cache, QuantizedKVCache):
            parts = [cache.data.view(torch.uint8)]
            if cache.fmt.scale == "token":
                parts.append(cache.scale)
        for t in parts:
            out.append(t.view(2, -1, block_size, *t.shape[2:]))
    return out
