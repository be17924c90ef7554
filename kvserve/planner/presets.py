"""Architecture presets for common models, so ``kvserve plan`` needs no checkpoint.

Only the fields that size memory are given; they are the published configs' values.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """What sizes a model's memory: layers, KV heads, head dim, parameter count, and the
    attention windows: one for every layer, or per layer (``layer_windows``, 0: global)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: int
    sliding_window: int | None = None
    layer_windows: tuple[int, ...] = ()


def _shape(
    name: str,
    layers: int,
    hidden: int,
    heads: int,
    kv: int,
    params: float,
    head_dim: int | None = None,
    window: int | None = None,
    local: int | None = None,
) -> ModelShape:
    """``local``: Gemma 3's pattern, every sixth layer global, the others sliding over
    ``local`` tokens."""
    per_layer = tuple(0 if (i + 1) % 6 == 0 else local for i in range(layers)) if local else ()
    return ModelShape(
        name,
        layers,
        hidden,
        heads,
        kv,
        head_dim or hidden // heads,
        int(params * 1e9),
        window,
        per_layer,
    )


PRESETS = {
    p.name.lower(): p
    for p in (
        _shape("llama-2-7b", 32, 4096, 32, 32, 6.74),
        _shape("llama-2-13b", 40, 5120, 40, 40, 13.0),
        _shape("llama-2-70b", 80, 8192, 64, 8, 69.0),
        _shape("llama-3-8b", 32, 4096, 32, 8, 8.03),
        _shape("llama-3-70b", 80, 8192, 64, 8, 70.6),
        _shape("llama-3.2-1b", 16, 2048, 32, 8, 1.24, head_dim=64),
        _shape("llama-3.2-3b", 28, 3072, 24, 8, 3.21),
        _shape("mistral-7b", 32, 4096, 32, 8, 7.24, window=None),
        _shape("qwen2.5-0.5b", 24, 896, 14, 2, 0.49),
        _shape("qwen2.5-1.5b", 28, 1536, 12, 2, 1.54),
        _shape("qwen2.5-7b", 28, 3584, 28, 4, 7.62),
        _shape("qwen2.5-14b", 48, 5120, 40, 8, 14.8),
        _shape("qwen2.5-32b", 64, 5120, 40, 8, 32.8),
        _shape("qwen2.5-72b", 80, 8192, 64, 8, 72.7),
        _shape("gemma-3-270m", 18, 640, 4, 1, 0.27, head_dim=256, local=512),
        _shape("gemma-3-1b", 26, 1152, 4, 1, 1.0, head_dim=256, local=512),
        _shape("gemma-3-4b", 34, 2560, 8, 4, 3.88, head_dim=256, local=1024),
        _shape("gemma-3-12b", 48, 3840, 16, 8, 11.8, head_dim=256, local=1024),
        _shape("gemma-3-27b", 62, 5376, 32, 16, 27.0, head_dim=128, local=1024),
        # the classic multi-head-attention example: every head has its own K/V
        _shape("13b-mha", 40, 5120, 40, 40, 13.0),
    )
}
