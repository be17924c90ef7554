"""KV tensor shapes, bytes per token and capacity in blocks.

A plain per-layer cache is ``[2, slots, H, D]`` (rows: slot = block * block_size + offset)
or, for the CPU kernels, ``[2, slots / 16, H, 16, D]`` (tiles: each group of 16 slots and
head in the order the attention kernel reads it, ``csrc/kv_tiles.h``); an 8-bit cache with
per-token scales may be tiled too, its scales then ``[2, slots / 16, H, 16]``. Both layouts
hold a block as one contiguous run per part, so swap, the host tier and the KV store move
blocks the same way; only the kernels that write and read tokens know the order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.hugepages import huge_zeros
from kvserve.model.kv_groups import KVGroups
from kvserve.model.kv_quant import TILE, KVFormat, QuantizedKVCache

_TOKEN_SCALE_BYTES = 2  # float16 per (token, KV head) for int8


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one model's KV cache; the single source of its byte sizes.

    ``dtype`` is the stored element type; ``scale`` is the quantization scale granularity
    (``none``, ``token``: one float16 per token and KV head, ``head``: per layer and head,
    negligible and not counted per token). ``groups`` (the hybrid layout, model/kv_groups.py):
    a block holds ``groups.group_size`` layers, not all of them.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    scale: str = "none"
    tiled: bool = False  # [2, slots / TILE, H, TILE, D] (module docstring)
    groups: KVGroups | None = None

    def __post_init__(self) -> None:
        if self.tiled and (self.scale == "head" or self.block_size % TILE or self.head_dim % 2):
            raise ValueError(
                f"a tiled KV cache needs a plain cache or per-token scales, block_size a "
                f"multiple of {TILE} and an even head_dim (got scale {self.scale}, block_size "
                f"{self.block_size}, head_dim {self.head_dim})"
            )

    @classmethod
    def for_format(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        fmt: KVFormat,
        block_size: int,
        tiled: bool = False,
        groups: KVGroups | None = None,
    ) -> KVCacheSpec:
        return cls(
            num_layers, num_kv_heads, head_dim, fmt.storage, block_size, fmt.scale, tiled, groups
        )

    @property
    def layer_bytes_per_token(self) -> int:
        """2 (K and V) × KV heads × (head dim × element size + per-token scale)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        scale = _TOKEN_SCALE_BYTES if self.scale == "token" else 0
        return 2 * self.num_kv_heads * (self.head_dim * elem + scale)

    @property
    def bytes_per_token(self) -> int:
        """One token's K/V in every layer (in the hybrid layout: before any of it leaves a
        sliding window)."""
        return self.num_layers * self.layer_bytes_per_token

    @property
    def block_layers(self) -> int:
        """Layers one pool block holds: every layer, or a hybrid layout's group size."""
        return self.groups.group_size if self.groups is not None else self.num_layers

    @property
    def bytes_per_block(self) -> int:
        return self.block_layers * self.layer_bytes_per_token * self.block_size

    def num_blocks_for(self, memory_bytes: int) -> int:
        return memory_bytes // self.bytes_per_block

    def allocate(
        self, num_blocks: int, device: torch.device, fmt: KVFormat | None = None
    ) -> list[torch.Tensor] | list[QuantizedKVCache]:
        """Per-layer caches of ``num_blocks`` blocks: ``[2, slots, H, D]`` tensor views of one
        zeroed allocation (``[2, slots / TILE, H, TILE, D]`` when ``tiled``), or
        ``QuantizedKVCache`` objects for a quantized ``fmt`` (tiled alike). In the hybrid
        layout the layers at one position of their groups share one cache's slots (a
        quantized cache's per-layer state stays each layer's own)."""
        slots = num_blocks * self.block_size
        n = self.block_layers
        if fmt is not None and fmt.quantized:
            shared = [
                QuantizedKVCache(fmt, slots, self.num_kv_heads, self.head_dim, device, self.tiled)
                for _ in range(n)
            ]
            if self.groups is None:
                return shared
            return [
                shared[j] if g == 0 else shared[j].sharing_rows()
                for g, j in zip(self.groups.layer_group, self.groups.layer_slot, strict=True)
            ]
        h = self.num_kv_heads
        rows = (slots // TILE, h, TILE) if self.tiled else (slots, h)
        # on a CPU, in a mapping of its own on huge pages (kvserve/hugepages.py): attention
        # reads blocks scattered over all of it
        full = list(huge_zeros((n, 2, *rows, self.head_dim), self.dtype, device).unbind(0))
        if self.groups is None:
            return full
        return [full[j] for j in self.groups.layer_slot]


def block_tensors(caches: list, block_size: int) -> list[torch.Tensor]:
    """Every device tensor holding per-slot data, viewed as ``[2, blocks, block_size, …]``
    (fp8 through uint8: CPU index kernels do not cover fp8), each once: in the hybrid
    layout layers share rows (``KVCacheSpec.allocate``), and a block is one group's page.
    Per-head fp8 scales are global and stay on the device."""
    out = []
    seen: set[int] = set()
    for cache in caches:
        if isinstance(cache, QuantizedKVCache):
            parts, tiled = [cache.data.view(torch.uint8)], cache.tiled
            if cache.fmt.scale == "token":
                parts.append(cache.scale)
        else:
            parts, tiled = [cache], cache.dim() == 5
        for t in parts:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                out.append(t.view(2, -1, rows_per_block(block_size, tiled), *t.shape[2:]))
    return out


def rows_per_block(block_size: int, tiled: bool) -> int:
    """How many rows (dim 1 of a cache part ``[2, …]``: its codes' or its scales') one
    block holds: ``block_size`` slots, or ``block_size / TILE`` tiles when ``tiled``."""
    return block_size // TILE if tiled else block_size


def tiles_from_rows(cache: torch.Tensor) -> torch.Tensor:
    """A plain cache ``[2, slots, H, D]`` in the tiled layout ``[2, slots / TILE, H, TILE, D]``
    (a new tensor): K as dimension pairs with key lanes side by side, V as key pairs."""
    _, slots, h, d = cache.shape
    k = cache[0].reshape(slots // TILE, TILE, h, d // 2, 2).permute(0, 2, 3, 1, 4)
    v = cache[1].reshape(slots // TILE, TILE // 2, 2, h, d).permute(0, 3, 1, 4, 2)
    return torch.stack([k.reshape(-1, h, TILE, d), v.reshape(-1, h, TILE, d)])


def rows_from_tiles(tiles: torch.Tensor) -> torch.Tensor:
    """The inverse of ``tiles_from_rows``: ``[2, slots, H, D]`` (a new tensor)."""
    n, h, d = tiles.shape[1], tiles.shape[2], tiles.shape[4]
    k = tiles[0].reshape(n, h, d // 2, TILE, 2).permute(0, 3, 1, 2, 4)
    v = tiles[1].reshape(n, h, TILE // 2, d, 2).permute(0, 2, 4, 1, 3)
    return torch.stack([k.reshape(n * TILE, h, d), v.reshape(n * TILE, h, d)])
