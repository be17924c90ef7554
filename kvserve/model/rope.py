"""Rotary position embeddings (HF "rotate half" layout) with default/linear/llama3 scaling."""

from __future__ import annotations

import math

import torch

from kvserve.model.spec import RopeSpec


def inv_frequencies(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """Per-pair inverse frequencies in float32, scaled as ``rope.rope_type`` prescribes."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.rope_type == "linear":
        inv = inv / rope.factor
    elif rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv.to(torch.float32)


class RotaryEmbedding:
    """Precomputed cos/sin tables ``[positions, head_dim]`` indexed by absolute position.

    Tables are computed in float32 and cast to the compute dtype (as HF does); they grow
    on demand when ``tables`` is asked for a position beyond them.
    """

    def __init__(self, rope: RopeSpec, head_dim: int, max_positions: int, device: torch.device):
        self.inv_freq = inv_frequencies(rope, head_dim).to(device)
        self.device = device
        self._build(max(max_positions, 1))

    def _build(self, n: int) -> None:
        pos = torch.arange(n, device=self.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, dtype: torch.dtype, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` in ``dtype`` covering positions ``0 .. max_position``."""
        if max_position >= self.cos.shape[0]:
            self._build(2 * max_position)
        if dtype not in self._cast:
            self._cast[dtype] = (self.cos.to(dtype).contiguous(), self.sin.to(dtype).contiguous())
        return self._cast[dtype]
