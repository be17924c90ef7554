"""Rotary position embeddings (HF "rotate half" layout) with default, linear, llama3, yarn,
longrope and dynamic (NTK) scaling.

Dynamic NTK scaling raises the rotary base for a sequence longer than the model's
``max_position_embeddings`` M: ``base · (factor · L / M − (factor − 1))^(d / (d − 2))`` for
length L. transformers recomputes it for the longest position of each forward call; here
position p (≥ M) is rotated with the base of length p + 1, per position, so again a
token's rotation does not depend on its batch. That is what transformers computes for
every decode step (each step grows the length by one); a prefill chunk past M rotates its
earlier positions with smaller bases than transformers' one call would.

LongRoPE (Phi-3) divides the frequencies by ``short_factor`` within the original context
and by ``long_factor`` beyond it. transformers switches on the longest position of each
forward call; here the switch is per position (a position at or past the original context
uses the long factors), so a token's rotation never depends on what it is batched with.
The two agree for every decode step and for any prefill chunk that does not cross the
original context; a chunk that crosses it rotates its first positions with the short
factors, where transformers would use the long ones for the whole call. (transformers'
``generate`` for Phi-3 also re-encodes the whole cache at the crossing; keys already
cached here keep their rotation.)
"""

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
    elif rope.rope_type == "yarn":
        inv = _yarn(rope, head_dim, inv)
    elif rope.rope_type == "longrope":
        inv = inv / torch.tensor(rope.short_factor, dtype=torch.float64)
    return inv.to(torch.float32)


def long_frequencies(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """LongRoPE's inverse frequencies past the original context (float32)."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    return (inv / torch.tensor(rope.long_factor, dtype=torch.float64)).to(torch.float32)


def _yarn(rope: RopeSpec, dim: int, extrapolated: torch.Tensor) -> torch.Tensor:
    """YaRN: the low-frequency dims interpolated (divided by ``factor``), the high ones
    kept, a linear ramp between the dims that turn ``beta_slow`` and ``beta_fast`` times
    over the original context."""

    def dim_of(rotations: float) -> float:
        turns = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(rope.theta))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolated (unchanged), 0: interpolated
    return extrapolated / rope.factor * (1 - keep) + extrapolated * keep


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_scaling(rope: RopeSpec) -> float:
    """The factor yarn and longrope apply to cos and sin (1 for the other types)."""
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.rope_type == "yarn":
        if rope.mscale and rope.mscale_all_dim:
            return _mscale(rope.factor, rope.mscale) / _mscale(rope.factor, rope.mscale_all_dim)
        return _mscale(rope.factor)
    if rope.rope_type == "longrope" and rope.factor > 1:
        original = rope.original_max_position_embeddings
        return math.sqrt(1 + math.log(rope.factor) / math.log(original))
    return 1.0


class RotaryEmbedding:
    """Precomputed cos/sin tables ``[positions, head_dim]`` indexed by absolute position.

    Tables are computed in float32 and cast to the compute dtype (as HF does); they grow
    on demand when ``tables`` is asked for a position beyond them.
    """

    def __init__(self, rope: RopeSpec, head_dim: int, max_positions: int, device: torch.device):
        self.inv_freq = inv_frequencies(rope, head_dim).to(device)
        self.long_inv_freq: torch.Tensor | None = None  # LongRoPE's, from ``long_from`` on
        self.long_from = rope.original_max_position_embeddings
        if rope.rope_type == "longrope":
            self.long_inv_freq = long_frequencies(rope, head_dim).to(device)
        self.scaling = attention_scaling(rope)
        self.device = device
        self.rope, self.head_dim = rope, head_dim
        self._build(max(max_positions, 1))

    def _dynamic_rows(self, pos: torch.Tensor) -> torch.Tensor:
        """Dynamic NTK: each position's angles with the base of its own length (float32,
        as transformers computes them)."""
        r, d = self.rope, self.head_dim
        m = r.original_max_position_embeddings
        base = r.theta * ((r.factor * (pos + 1) / m) - (r.factor - 1)) ** (d / (d - 2))
        exponents = torch.arange(0, d, 2, device=self.device, dtype=torch.float32) / d
        inv = 1.0 / (base[:, None] ** exponents[None, :])
        return pos[:, None] * inv

    def _build(self, n: int) -> None:
        pos = torch.arange(n, device=self.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        if self.long_inv_freq is not None and n > self.long_from:
            freqs[self.long_from :] = torch.outer(pos[self.long_from :], self.long_inv_freq)
        if self.rope.rope_type == "dynamic" and n > self.long_from:
            freqs[self.long_from :] = self._dynamic_rows(pos[self.long_from :])
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            self.cos, self.sin = self.cos * self.scaling, self.sin * self.scaling
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, dtype: torch.dtype, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` in ``dtype`` covering positions ``0 .. max_position``."""
        if max_position >= self.cos.shape[0]:
            self._build(2 * max_position)
        if dtype not in self._cast:
            self._cast[dtype] = (self.cos.to(dtype).contiguous(), self.sin.to(dtype).contiguous())
        return self._cast[dtype]
