"""KV cache storage formats: 16/32-bit as is, int8 with per-token scales, fp8 with per-token
or per-head scales. Quantize on write, dequantize on read; attention always computes in the
model dtype.

- ``int8``: symmetric, one float16 scale per (token, KV head) stored beside the block
  (``scale = max|x| / 127``); 2 extra bytes per 64-element head vector ≈ 3% overhead.
- ``fp8_e4m3`` / ``fp8_e5m2`` with token scales (``fp8_e4m3_token``, the default): one
  float16 scale per (token, KV head) as for int8; for e4m3 the one of 8 scales
  ``max|x| / fp8_max · 2^(i/8)`` whose decoded vector is nearest to the input: a float
  format rounds each element by where it falls between two powers of two, and shifting
  the vector by a fraction of a binade picks the placement that rounds it best (on
  SmolLM2: +0.89 % → +0.40 % perplexity). A reader needs nothing new: value = code ·
  scale, as before.
- with head scales: one float32 scale per (layer, K|V, KV head), taken from the
  checkpoint's ``k_scale``/``v_scale`` when present, else 1.0, or calibrated from the first
  forward pass (``calculate_kv_scales``: ``scale = max|x| / fp8_max``).

K smoothing (token scales only, ``kvserve.model.kv_smoothing``): a cache with a ``k_shift``
(``[H, D]`` float32, the layer's mean key) stores ``k - k_shift`` in place of ``k``. A
query's scores then all move by the same ``q · k_shift``, which softmax ignores, while
the stored vectors lose the large per-channel offsets that set their scales. Readers of
K (``read_slots``, ``gather_blocks``) return the stored, shifted keys: what attention
needs, not the model's keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.hugepages import huge_zeros

_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_PLAIN = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KV_CACHE_DTYPES = ("auto", *_PLAIN, *_FP8, "int8")
# Token-scale fp8: scales tried per vector, in 2^(i/n) steps. e5m2 keeps the plain scale:
# with 2 mantissa bits the search made SmolLM2's perplexity worse (+1.96 % → +2.23 %).
FP8_SCALE_CANDIDATES = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 1}
_SEARCH_TOKENS = 2048  # tokens per search call off the CPU kernel (C copies each)
TILE = 16  # slots per tile of a tiled cache (model/kv_cache.py, csrc/kv_tiles.h)
_KINDS = {torch.int8: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}  # quantize_kv's


@dataclass(frozen=True)
class KVFormat:
    """How K/V are stored: element type and scale granularity (none | token | head)."""

    name: str
    storage: torch.dtype
    scale: str = "none"

    @property
    def quantized(self) -> bool:
        return self.scale != "none"


KV_CACHE_SCALES = ("auto", "token", "head")


def kv_format(name: str, model_dtype: torch.dtype, fp8_scales: str = "auto") -> KVFormat:
    """The format for ``--kv-cache-dtype name`` (``auto`` follows the model dtype); an
    fp8 cache's scales per ``fp8_scales`` (``--kv-cache-scales``): ``token`` (one per
    token and KV head, computed as K/V are written), ``head`` (one per layer and KV head:
    the checkpoint's, calibrated, or 1.0); ``auto`` is ``token`` (the engine passes
    ``head`` when the checkpoint carries scales or they are calibrated). Raises
    ValueError for an unknown name."""
    if fp8_scales not in KV_CACHE_SCALES:
        raise ValueError(f"kv_cache_scales {fp8_scales!r} is not one of {KV_CACHE_SCALES}")
    if name == "auto":
        return KVFormat(str(model_dtype).removeprefix("torch."), model_dtype)
    if name in _PLAIN:
        return KVFormat(name, _PLAIN[name])
    if name in _FP8:
        canonical = "fp8_e4m3" if name == "fp8" else name
        if fp8_scales == "head":
            return KVFormat(canonical, _FP8[name], "head")
        return KVFormat(f"{canonical}_token", _FP8[name], "token")
    if name == "int8":
        return KVFormat("int8", torch.int8, "token")
    raise ValueError(f"kv_cache_dtype {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")


class QuantizedKVCache:
    """One layer's quantized K/V: ``data`` ``[2, slots, H, D]`` of the storage type and
    ``scale`` — ``[2, slots, H]`` float16 (per-token scales) or ``[2, H]`` float32 (fp8
    per-head scales).

    ``tiled`` (per-token scales, the CPU kernels only): ``data`` ``[2, slots / 16, H, 16, D]``
    and ``scale`` ``[2, slots / 16, H, 16]``, the order the attention kernel reads
    (``model/kv_cache.py``); only ``write_cpu`` writes it and only the C++ kernel reads it.

    ``calibrating`` (fp8 only): the next ``write`` first sets the per-head scales from the
    values it is given, then clears the flag.
    """

    def __init__(
        self,
        fmt: KVFormat,
        num_slots: int,
        num_heads: int,
        head_dim: int,
        device: torch.device,
        tiled: bool = False,
    ):
        if tiled and (fmt.scale != "token" or num_slots % TILE):
            raise ValueError(f"a tiled {fmt.name} cache needs per-token scales and whole tiles")
        self.fmt = fmt
        self.tiled = tiled
        rows = (num_slots // TILE, num_heads, TILE) if tiled else (num_slots, num_heads)
        self.data = huge_zeros((2, *rows, head_dim), fmt.storage, device)  # hugepages.py
        fp8 = fmt.storage != torch.int8
        self.qmax = float(torch.finfo(fmt.storage).max) if fp8 else 127.0
        if fmt.scale == "token":
            self.scale = torch.zeros(2, *rows, dtype=torch.float16, device=device)
        else:
            self.scale = torch.ones(2, num_heads, dtype=torch.float32, device=device)
        self.calibrating = False
        self.candidates = FP8_SCALE_CANDIDATES.get(fmt.storage, 1)  # token-scale fp8 only
        self.k_shift: torch.Tensor | None = None  # K smoothing: [H, D] float32

    def sharing_rows(self) -> QuantizedKVCache:
        """Another layer's cache over the same slots (a hybrid layout's layers at one
        position of their groups: model/kv_groups.py): the same codes and per-token scales, its
        own per-head scales, K shift and calibration flag."""
        other = object.__new__(QuantizedKVCache)
        other.__dict__.update(self.__dict__)
        if self.fmt.scale != "token":
            other.scale = self.scale.clone()
        other.k_shift = None
        other.calibrating = False
        return other

    def set_k_shift(self, shift: torch.Tensor) -> None:
        """Store every later key as ``k - shift`` (``[H, D]``; K smoothing). Token
        scales only (ValueError otherwise); must precede any write."""
        if self.fmt.scale != "token":
            raise ValueError(f"K smoothing needs per-token scales, {self.fmt.name} has none")
        h, d = self.data.shape[-3 if self.tiled else -2], self.data.shape[-1]
        if tuple(shift.shape) != (h, d):
            raise ValueError(f"k_shift must be [{h}, {d}], got {list(shift.shape)}")
        self.k_shift = shift.detach().to(self.data.device, torch.float32).contiguous()

    def set_head_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Per-head fp8 scales (scalars broadcast); must precede any write."""
        if self.fmt.scale != "head":
            raise ValueError(f"{self.fmt.name} has no per-head scales")
        self.scale[0] = k_scale.to(self.scale)
        self.scale[1] = v_scale.to(self.scale)

    def quantize(self, which: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` ``[T, H, D]`` → (stored values, per-token scales or None); keys (``which``
        0) less ``k_shift`` when it is set."""
        xf = x.float()
        if which == 0 and self.k_shift is not None:
            xf = xf - self.k_shift
        if self.fmt.scale == "token":
            amax = xf.abs().amax(-1)
            if self.fmt.storage == torch.int8:
                s = (amax / self.qmax).clamp_min(1e-8).half()
                scaled = (xf / s.float().unsqueeze(-1)).clamp_(-self.qmax, self.qmax)
                return torch.round(scaled).to(torch.int8), s
            # the search holds C copies of its input: bound a long prefill's temporaries
            parts = [
                self._fp8_search(xf[i : i + _SEARCH_TOKENS], amax[i : i + _SEARCH_TOKENS])
                for i in range(0, xf.shape[0], _SEARCH_TOKENS)
            ]
            if len(parts) == 1:
                return parts[0]
            return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])
        s = self.scale[which].view(1, -1, 1)
        return (xf / s).clamp_(-self.qmax, self.qmax).to(self.fmt.storage), None

    def _fp8_search(
        self, xf: torch.Tensor, amax: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token fp8 codes and float16 scales of ``xf`` ``[T, H, D]``: of the
        ``candidates`` scales, the one with the least squared error (the first on
        a tie). A scale never goes below float16's smallest normal, so an all-zero vector
        does not divide by 0."""
        n = self.candidates
        steps = 2 ** (torch.arange(n, device=xf.device) / n)
        raw = (amax.unsqueeze(0) / self.qmax * steps.view(-1, 1, 1)).clamp_min(1e-8)
        s = raw.half().clamp_min(torch.finfo(torch.float16).tiny)  # [C, T, H]
        sf = s.float().unsqueeze(-1)
        q = (xf.unsqueeze(0) / sf).clamp_(-self.qmax, self.qmax).to(self.fmt.storage)
        err = (q.float() * sf - xf.unsqueeze(0)).square_().sum(-1)  # [C, T, H]
        best = err.argmin(0, keepdim=True)  # [1, T, H]
        codes = q.view(torch.uint8).gather(0, best.unsqueeze(-1).expand(1, *xf.shape))
        return codes[0].view(self.fmt.storage), s.gather(0, best)[0]

    def _rows_only(self, what: str) -> None:
        if self.tiled:
            raise RuntimeError(f"{what} reads and writes rows; this cache is tiled (write_cpu)")

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize ``k``/``v`` ``[T, H, D]`` into ``slots`` (a cache of rows)."""
        self._rows_only("write")
        if self.calibrating:
            for which, x in ((0, k), (1, v)):
                amax = x.float().abs().amax(dim=(0, 2))
                self.scale[which] = (amax / self.qmax).clamp_min(1e-6)
            self.calibrating = False
        for which, x in ((0, k), (1, v)):
            q, s = self.quantize(which, x)
            # through a uint8 view: CPU index kernels do not cover fp8 types
            self.data[which].view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))
            if s is not None:
                self.scale[which].index_copy_(0, slots, s)

    @property
    def kernel_kind(self) -> int:
        """The storage type as the C++ kernels number it (``quantize_kv``'s ``kind``)."""
        return _KINDS[self.fmt.storage]

    def write_cpu(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``write`` through the C++ kernel (``torch.ops.kvserve.quantize_kv``, one call
        each for K and V; the same codes and scales): for a CPU cache with per-token
        scales, once the CPU kernels are loaded (a tiled cache, always). Other caches take
        ``write``."""
        if not self.tiled and (self.fmt.scale != "token" or not self.data.is_cpu):
            self.write(slots, k, v)
            return
        kind = self.kernel_kind
        for which, x in ((0, k), (1, v)):
            if x.stride(-1) != 1 or x.stride(1) != x.shape[2]:
                x = x.contiguous()
            torch.ops.kvserve.quantize_kv(
                x,
                slots,
                self.data[which].view(torch.uint8),
                self.scale[which],
                kind,
                self.candidates,
                self.k_shift if which == 0 else None,
                which,
            )

    @staticmethod
    def _dequant_tokens(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Per-token scales: ``s`` has ``q``'s shape without the last dim."""
        return (q.float() * s.float().unsqueeze(-1)).to(dtype)

    def read_slots(self, which: int, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized ``[T, H, D]`` at ``slots`` (a cache of rows)."""
        self._rows_only("read_slots")
        q = self.data[which].view(torch.uint8).index_select(0, slots).view(self.fmt.storage)
        if self.fmt.scale == "token":
            return self._dequant_tokens(q, self.scale[which].index_select(0, slots), dtype)
        return (q.float() * self.scale[which].view(1, -1, 1)).to(dtype)

    def gather_blocks(
        self, which: int, tables: torch.Tensor, block_size: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """``[B, H, nb * block_size, D]`` dequantized context of each row's blocks (a cache
        of rows)."""
        self._rows_only("gather_blocks")
        _, _, h, d = self.data.shape
        raw = self.data[which].view(torch.uint8).view(-1, block_size, h, d)
        q = raw.index_select(0, tables.flatten()).view(self.fmt.storage)
        q = q.view(tables.shape[0], -1, h, d).transpose(1, 2)  # [B, H, L, D]
        if self.fmt.scale == "token":
            s = self.scale[which].view(-1, block_size, h).index_select(0, tables.flatten())
            s = s.view(tables.shape[0], -1, h).transpose(1, 2)  # [B, H, L]
            return self._dequant_tokens(q, s, dtype)
        return (q.float() * self.scale[which].view(1, -1, 1, 1)).to(dtype)
