"""Linear layers and embeddings over GGUF-quantized weights, kept quantized in memory.

A GGUF file's ``Q4_0``, ``Q4_1``, ``Q4_K`` and ``Q8_0`` matrices reach the model as their raw
blocks (``model/gguf.py`` stores them so in its cache; ``QUANT_MANIFEST`` names them) and are
repacked once, at load, into the layout of ``csrc/gguf_gemm.cpp``: groups of 16 output rows,
K in blocks of 32, 4-bit codes two to a byte (Q4_0, Q4_1: kinds ``z4``, ``u4``; Q4_K: ``k4``)
or 8-bit codes (Q8_0: ``s8``, stored as q + 128), fp16 scales (and Q4_1's offsets; Q4_K
keeps its two levels: 6-bit scales and mins per 32 as bytes, fp16 ``d`` and ``dmin`` per
256). Nothing is expanded to 16 or 32 bits: a weight takes about the file's bits here
(Q4_0 4.5, Q4_1 5, Q4_K 4.625 against the file's 4.5, Q8_0 8.5). ``pack_int8`` gives a
float checkpoint's matrices the same treatment (``--quantization int8``): 8-bit codes in
Q8_0's layout with one float32 scale per output row (kernel kind ``c8``).

``GGUFLinear`` computes ``x @ W.T`` with activations quantized per 32 values to int8 (as
llama.cpp does), one kernel call per *part*: a fused projection (Q/K/V, gate/up) whose
pieces have different types keeps one part per type run. ``GGUFEmbedding`` dequantizes only
the rows it looks up, with the ``gguf`` package's formulas (bit for bit its values).
Both keep the engine's batch invariance: a row's output never depends on the other rows.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from kvserve.hugepages import huge_arena

QUANT_MANIFEST = "kvserve_quant.json"  # tensor name -> GGML type name, in a converted dir

# GGML type name -> (elements per block, bytes per block)
BLOCKS = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}
# bits a weight as the kernels hold each type (``Packed``): the file's, but Q4_K's and
# Q5_K's 6-bit scales and mins, which are kept as bytes (+1/8 bit a weight)
SERVED_BITS = {t: size * 8 / per + (0.125 if t in ("Q4_K", "Q5_K") else 0.0)
               for t, (per, size) in BLOCKS.items()}  # fmt: skip
# csrc/gguf_gemm.cpp's kinds: Q4_1, Q8_0, Q4_0, Q4_K, Q6_K, Q5_K, and int8 per channel
_U4, _S8, _Z4, _K4, _K6, _K5, _C8 = 0, 1, 2, 3, 4, 5, 6
_KINDS = {"Q4_1": _U4, "Q8_0": _S8, "Q4_0": _Z4, "Q4_K": _K4, "Q6_K": _K6, "Q5_K": _K5}
INT8 = "int8"  # Packed.ggml_type of ``pack_int8``'s weights (not a GGML type)
_KINDS[INT8] = _C8


def kept_quantized(ggml_type: str) -> bool:
    """True for the GGML types served quantized (``BLOCKS``)."""
    return ggml_type in BLOCKS


def row_bytes(ggml_type: str, k: int) -> int:
    """Bytes of one row of ``k`` elements; ValueError when ``k`` is not whole blocks."""
    per, size = BLOCKS[ggml_type]
    if k % per:
        raise ValueError(f"{ggml_type}: a row of {k} is not whole blocks of {per}")
    return k // per * size


def dequantize(raw: np.ndarray, ggml_type: str) -> np.ndarray:
    """Raw rows ``[n, row_bytes]`` → float32 ``[n, k]`` (the ``gguf`` package's values)."""
    from gguf import GGMLQuantizationType, quants

    return np.asarray(quants.dequantize(raw, GGMLQuantizationType[ggml_type]), np.float32)


@dataclass(frozen=True)
class Packed:
    """One part of a quantized weight in ``gguf_gemm.cpp``'s layout: ``qs`` uint8
    ``[G, K/32, 256 | 512]``, ``d`` float16 ``[G, K/32, 16]``, ``aux`` Q4_1's offsets,
    float16 ``[G, K/32, 16]`` (empty for Q4_0 and Q8_0); ``n`` rows of ``ggml_type``.
    Q4_K: ``d`` float16 ``[G, K/256, 32]`` (lanes 0–15 the rows' ``d``, 16–31 their
    ``dmin``), ``aux`` uint8 ``[G, K/32, 32]`` (lanes 0–15 the 6-bit scales, 16–31 the
    mins); Q5_K as Q4_K, with ``qs`` ``[G, K/32, 320]``: the codes' fifth bits follow
    (``_fifth_bits``). Q6_K: ``qs`` ``[G, K/32, 384]``, the codes' low 4 bits as Q4's 256
    bytes, then their high 2 bits (``_high_bits``); ``d`` float16 ``[G, K/256, 16]``;
    ``aux`` int8 ``[G, K/32, 32]`` (lanes 0–15 the scales of a block's first 16 values,
    16–31 of its last 16)."""

    ggml_type: str
    n: int
    k: int
    qs: torch.Tensor
    d: torch.Tensor
    aux: torch.Tensor

    @property
    def kind(self) -> int:
        return _KINDS[self.ggml_type]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.aux))


def _split_q4_k(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q4_K (or Q5_K) super-blocks ``[n, K/256, 144 | 176]`` → codes ``[n, K/32, 32]``, fp16
    ``d`` and ``dmin`` ``[n, K/256]``, and the 6-bit scales and mins ``[n, K/32]`` (uint8),
    unpacked by the ``gguf`` package's own ``get_scale_min``. Q5_K's 32 bytes of fifth bits
    (bit i: block i's) sit between the scales and the nibbles."""
    from gguf.quants import Q4_K

    n, nsb = blocks.shape[:2]
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]
    dmin = blocks[:, :, 2:4].copy().view(np.float16)[..., 0]
    sc, mins = Q4_K.get_scale_min(blocks[:, :, 4:16].reshape(-1, 12))
    five = blocks.shape[2] == BLOCKS["Q5_K"][1]
    qs = blocks[:, :, 48 if five else 16 :].reshape(n, nsb, 4, 1, 32)  # per 32 bytes: lo, hi
    q = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(n, nsb, 8, 32)
    if five:
        qh = blocks[:, :, 16:48].reshape(n, nsb, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
        q = q | ((qh & 1) << 4)
    return q.reshape(n, nsb * 8, 32), d, dmin, sc.reshape(n, nsb * 8), mins.reshape(n, nsb * 8)


def _split_q6_k(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q6_K super-blocks ``[n, K/256, 210]`` → codes q - 32 ``[n, K/32, 32]`` (int8), fp16
    ``d`` ``[n, K/256]`` and the int8 scales ``[n, K/32, 2]`` (one per 16 values), in the
    ``gguf`` package's order of values."""
    n, nsb = blocks.shape[:2]
    ql = blocks[:, :, :128].reshape(n, nsb, 2, 1, 64)  # per half: low, then high nibbles
    lo = np.concatenate([ql & 15, ql >> 4], axis=3).reshape(n, nsb, 256)
    qh = (
        blocks[:, :, 128:192].reshape(n, nsb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    )
    hi = (qh & 3).reshape(n, nsb, 256)
    q = ((lo | (hi << 4)).astype(np.int8) - np.int8(32)).reshape(n, nsb * 8, 32)
    sc = blocks[:, :, 192:208].copy().view(np.int8).reshape(n, nsb * 8, 2)
    d = blocks[:, :, 208:210].copy().view(np.float16)[..., 0]
    return q, d, sc


def _split_blocks(raw: np.ndarray, ggml_type: str) -> tuple[np.ndarray, ...]:
    """Raw rows → codes ``[n, nb, 32]`` (Q4: 0..15 as uint8; Q8_0: int8), d ``[n, nb]``
    float16, and for Q4_1 its offsets m ``[n, nb]`` float16 (Q4_K: ``_split_q4_k``)."""
    size = BLOCKS[ggml_type][1]
    blocks = np.ascontiguousarray(raw).reshape(raw.shape[0], -1, size)
    if ggml_type in ("Q4_K", "Q5_K"):
        return _split_q4_k(blocks)
    if ggml_type == "Q6_K":
        return _split_q6_k(blocks)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]
    if ggml_type == "Q8_0":
        return blocks[:, :, 2:].copy().view(np.int8), d
    nibbles = blocks[:, :, 4:] if ggml_type == "Q4_1" else blocks[:, :, 2:]
    q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1)  # element j, then j + 16
    if ggml_type == "Q4_0":  # w = d * (q - 8): the kernel takes the offset from d
        return q, d
    return q, d, blocks[:, :, 2:4].copy().view(np.float16)[..., 0]


def pack(raw: np.ndarray, ggml_type: str, k: int) -> Packed:
    """Raw GGUF rows ``[n, row_bytes(k)]`` of ``ggml_type`` in the kernel's layout."""
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] != row_bytes(ggml_type, k):
        raise ValueError(f"{ggml_type}: raw rows {raw.shape} do not hold rows of {k}")
    n, nb = raw.shape[0], k // 32
    q, d, *m = _split_blocks(raw, ggml_type)
    g = -(-n // 16)
    pad = g * 16 - n

    def grouped(a: np.ndarray) -> np.ndarray:  # [n, blocks, ...] -> [G, blocks, 16, ...]
        a = np.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
        return np.ascontiguousarray(a.reshape(g, 16, *a.shape[1:]).swapaxes(1, 2))

    qg, dg = grouped(q), grouped(d)
    if ggml_type in ("Q4_K", "Q5_K"):  # [d | dmin] per super-block, [scale | min] per block
        dg = np.concatenate([dg, grouped(m[0])], axis=-1)
        aux = torch.from_numpy(np.concatenate([grouped(m[1]), grouped(m[2])], axis=-1))
    elif ggml_type == "Q6_K":  # [G, nb, 16, 2] -> [G, nb, 2 x 16]
        aux = torch.from_numpy(
            np.ascontiguousarray(grouped(m[0]).swapaxes(2, 3)).reshape(g, nb, 32)
        )
    elif m:
        aux = torch.from_numpy(grouped(m[0]))
    else:
        aux = torch.empty(0, dtype=torch.float16)
    if ggml_type == "Q8_0":  # stored as q + 128: the kernel's unsigned operand
        qs = qg.reshape(g, nb, 16, 8, 4).transpose(0, 1, 3, 2, 4).reshape(g, nb, 512)
        qs = qs.view(np.uint8) ^ np.uint8(0x80)
    else:
        codes = (qg.view(np.uint8) + np.uint8(32)) if ggml_type == "Q6_K" else qg  # 0..63
        halves = (codes & 15).reshape(g, nb, 16, 4, 2, 4)  # [.., chunk c, low/high, byte j]
        qs = (halves[..., 0, :] | (halves[..., 1, :] << 4)).astype(np.uint8)
        qs = qs.transpose(0, 1, 3, 2, 4).reshape(g, nb, 256)
        if ggml_type == "Q6_K":
            qs = np.concatenate([qs, _high_bits(codes >> 4)], axis=-1)
        elif ggml_type == "Q5_K":
            qs = np.concatenate([qs, _fifth_bits(codes >> 4)], axis=-1)
    return Packed(
        ggml_type, n, k, torch.from_numpy(np.ascontiguousarray(qs)), torch.from_numpy(dg), aux
    )


def c8_block(k: int) -> int:
    """Values per activation block of kind c8 over rows of ``k``: 128 where ``k`` allows,
    else 32 (``csrc/gguf_c8.h``'s ``c8_block``)."""
    return 128 if k % 128 == 0 else 32


def pack_int8(w: torch.Tensor, amax: torch.Tensor | None = None) -> Packed:
    """Float rows ``[n, k]`` as int8 with one scale per row (``--quantization int8``,
    kernel kind c8: ``csrc/gguf_c8.h``; activations quantized per ``c8_block(k)``
    values):
    ``d = max|w| / 127`` in float32, codes ``round(w / d)`` (to nearest even), in s8's
    layout (``q + 128``); ``d`` ``[G, 16]``. ``amax`` ``[n]``: the rows' ``max|w|`` when
    ``w`` holds only some of their columns (a tensor-parallel rank's part), so the part's
    codes and scales are the whole matrix's."""
    n, k = w.shape
    if k % 32:
        raise ValueError(f"int8: a row of {k} is not whole blocks of 32")
    w = w.detach().float()
    d = (w.abs().amax(dim=1) if amax is None else amax.float()) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(w * inv[:, None]).clamp(-127, 127).to(torch.int8)
    g, nb = -(-n // 16), k // 32
    q = torch.nn.functional.pad(q, (0, 0, 0, g * 16 - n))
    qs = q.view(g, 16, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(g, nb, 512)
    qs = (qs.view(torch.uint8) ^ 0x80).contiguous()
    dg = torch.nn.functional.pad(d, (0, g * 16 - n)).view(g, 16).contiguous()
    return Packed(INT8, n, k, qs, dg, torch.empty(0, dtype=torch.float16))


def _high_bits(hi: np.ndarray) -> np.ndarray:
    """Q6_K codes' high 2 bits ``[G, nb, 16 rows, 32]`` → ``[G, nb, 128]``: per half p of a
    block, 64 bytes [row][j] holding values 16p + j, 16p + 4 + j, 16p + 8 + j and
    16p + 12 + j from bit 0 up (the lanes of the 4-bit chunks 2p and 2p + 1)."""
    g, nb = hi.shape[:2]
    four = hi.reshape(g, nb, 16, 2, 4, 4).astype(np.uint8)  # [.., row, p, k, j]
    packed = four[..., 0, :] | four[..., 1, :] << 2 | four[..., 2, :] << 4 | four[..., 3, :] << 6
    return packed.transpose(0, 1, 3, 2, 4).reshape(g, nb, 128)  # [.., p, row, j]


def _fifth_bits(hi: np.ndarray) -> np.ndarray:
    """Q5_K codes' fifth bits ``[G, nb, 16 rows, 32]`` → ``[G, nb, 64]``: byte j of a row
    holds values j, 4 + j, 8 + j, … 28 + j from bit 0 up (bits 2c and 2c + 1: the lanes of
    the 4-bit chunk c)."""
    g, nb = hi.shape[:2]
    eight = hi.reshape(g, nb, 16, 8, 4).astype(np.uint8)  # [.., row, e, j]: value 4e + j
    packed = np.zeros((g, nb, 16, 4), np.uint8)
    for e in range(8):
        packed |= eight[:, :, :, e] << e
    return packed.reshape(g, nb, 64)


def _codes(p: Packed, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows ``rows`` of ``p`` as stored: codes float32 ``[T, nb, 32]`` (Q4: 0..15, Q8_0:
    -128..127), ``d`` float32 ``[T, nb, 1]``, and Q4_1's offsets so (else None). Q4_K's
    two levels give ``d = d * scale`` and offsets ``-(dmin * min)`` per block of 32 (both
    exact in float32, as the ``gguf`` package and the kernel compute them)."""
    g, lane = rows // 16, rows % 16
    nb = p.k // 32

    def per_row(t: torch.Tensor, at: torch.Tensor = lane) -> torch.Tensor:
        # [G, blocks, lanes] -> [T, blocks, 1]
        return t[g].gather(2, at.view(-1, 1, 1).expand(-1, t.shape[1], 1)).float()

    groups = p.qs[g]  # [T, nb, qbytes]: each row's group, read once
    chunks = 8 if p.kind in (_S8, _C8) else 4
    b = groups[:, :, : chunks * 64].reshape(-1, nb, chunks, 16, 4)
    b = b.gather(3, lane.view(-1, 1, 1, 1, 1).expand(-1, nb, chunks, 1, 4)).reshape(
        -1, nb, chunks, 4
    )
    if p.kind in (_S8, _C8):
        q = (b.int() - 128).reshape(-1, nb, 32)  # stored as q + 128
    else:
        q = torch.stack([b & 15, b >> 4], dim=3).reshape(-1, nb, 32)  # [c][lo/hi][j]
    if p.kind == _K5:  # the fifth bits: byte j of a row, bit e for value 4e + j
        h = groups[:, :, 256:].reshape(-1, nb, 16, 4)
        h = h.gather(2, lane.view(-1, 1, 1, 1).expand(-1, nb, 1, 4)).reshape(-1, nb, 1, 4)
        bits = (h >> torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)) & 1
        q = q | (bits.reshape(-1, nb, 32) << 4)
    if p.kind == _C8:  # one scale per row
        return q.float(), p.d[g, lane].view(-1, 1, 1), None
    if p.kind in (_K4, _K5):
        d, dmin = (per_row(p.d, at).repeat_interleave(8, dim=1) for at in (lane, lane + 16))
        scale, mins = per_row(p.aux), per_row(p.aux, lane + 16)
        return q.float(), d * scale, -(dmin * mins)
    if p.kind == _K6:  # 6-bit codes less 32; d per super-block; each block's two scales
        h = groups[:, :, 256:].reshape(-1, nb, 2, 16, 4)
        h = h.gather(3, lane.view(-1, 1, 1, 1, 1).expand(-1, nb, 2, 1, 4)).reshape(-1, nb, 2, 1, 4)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1)
        high = ((h >> shifts) & 3).reshape(-1, nb, 32)  # [p][k][j]: value 16p + 4k + j
        q = (q | (high << 4)).int() - 32
        halves = torch.cat([per_row(p.aux), per_row(p.aux, lane + 16)], dim=2)
        return q.float(), per_row(p.d).repeat_interleave(8, dim=1), halves
    return q.float(), per_row(p.d), per_row(p.aux) if p.aux.numel() else None


def unpack_rows(p: Packed, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (int64 ``[T]``) of the weight, dequantized to float32 ``[T, k]`` with
    the ``gguf`` package's formulas (Q4_0 ``d * (q - 8)``, Q4_1 ``d * q + m``, Q4_K and
    Q5_K ``(d * scale) * q - dmin * min``, Q6_K ``(d * scale) * (q - 32)``, Q8_0 ``d * q``),
    so the values are its values bit for bit."""
    q, d, aux = _codes(p, rows)
    if p.ggml_type in ("Q8_0", INT8):
        w = d * q
    elif p.ggml_type == "Q6_K":  # (d * scale) per 16 values, times the code
        assert aux is not None
        w = (d * aux).repeat_interleave(16, dim=2) * q
    elif p.ggml_type == "Q4_0":
        w = d * (q - 8)
    else:
        assert aux is not None
        w = d * q + aux
    return w.reshape(-1, p.k)


def _f32(x: torch.Tensor) -> torch.Tensor:
    """float64 values rounded to float32 (and kept float64 for the next exact step)."""
    return x.float().double()


def reference_part(p: Packed, x: torch.Tensor) -> torch.Tensor:
    """``gguf_linear``'s float32 result for one part, computed here step by step: the
    activations quantized as the kernel does, the integer block sums exact, and each of
    the kernel's operations (products, FMAs, blocks in order) rounded to float32 as it
    rounds them. Equal to the kernel's bits, up to a double rounding of an FMA emulated in
    float64 (an exact product plus an addend, rounded twice: rarer than 1 in 2^28)."""
    m = x.shape[0]
    size = c8_block(p.k) if p.kind == _C8 else 32  # c8: wider activation blocks
    blocks = x.float().view(m, -1, size)
    amax = blocks.abs().amax(-1)  # [M, nb]
    # a true division (torch computes ``127 / amax`` as ``127 * (1 / amax)``)
    inv = torch.where(amax > 0, torch.full_like(amax, 127).div(amax), torch.zeros_like(amax))
    qx = torch.round(blocks * inv.unsqueeze(-1)).clamp(-127, 127)
    dx, sx = (amax * torch.tensor(1 / 127)).double(), qx.sum(-1).double()
    q, d, aux = _codes(p, torch.arange(p.n))
    if p.kind == _C8:  # blocks' exact sums times dx, then the row's scale once
        isum = torch.einsum("mbk,nbk->mnb", qx.double(), q.double().view(p.n, -1, size))
        acc = torch.zeros(m, p.n, dtype=torch.float64)
        for b in range(isum.shape[-1]):
            acc = _f32(isum[:, :, b] * dx[:, b : b + 1] + acc)
        return _f32(acc * d.view(1, -1).double()).float()
    if p.kind == _K6:  # per half block: exact integer sums, combined by their scales
        assert aux is not None
        halves = torch.einsum(
            "mbhk,nbhk->mnbh", qx.double().view(m, -1, 2, 16), q.double().view(p.n, -1, 2, 16)
        )
        comb = (halves * aux.double().unsqueeze(0)).sum(-1)  # exact (below 2^24)
        t = _f32(d[:, :, 0].double() * comb)
    else:
        isum = torch.einsum("mbk,nbk->mnb", qx.double(), q.double())  # exact integers
        t = _f32(d[:, :, 0].double() * isum)  # [M, n, nb]
        if aux is not None:  # Q4_1, Q4_K, Q5_K
            t = _f32(aux[:, :, 0].double() * sx.unsqueeze(1) + t)
        elif p.kind == _Z4:  # d * (isum - 8 sx): the difference is exact
            t = _f32(d[:, :, 0].double() * (isum - 8 * sx.unsqueeze(1)))
    acc = torch.zeros(m, p.n, dtype=torch.float64)
    for b in range(t.shape[-1]):
        acc = _f32(t[:, :, b] * dx[:, b : b + 1] + acc)
    return acc.float()


class GGUFLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` over quantized parts (``Packed``) stacked along the output;
    ``in_features``/``out_features`` as ``nn.Linear``'s. Needs the CPU kernels."""

    def __init__(self, parts: list[Packed], bias: torch.Tensor | None = None):
        super().__init__()
        if not parts or len({p.k for p in parts}) != 1:
            raise ValueError("GGUFLinear needs parts of one in_features")
        self.parts = parts
        self.in_features = parts[0].k
        self.out_features = sum(p.n for p in parts)
        self.bias_parts = [None] * len(parts)
        if bias is not None:
            pieces = bias.detach().float().split([p.n for p in parts])
            self.bias_parts = [b.contiguous() for b in pieces]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in]`` (float32, bf16 or fp16) → ``[..., out]`` in ``x``'s dtype."""
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        op = torch.ops.kvserve.gguf_linear
        outs = [
            op(rows, p.qs, p.d, p.aux, p.kind, p.n, b)
            for p, b in zip(self.parts, self.bias_parts, strict=True)
        ]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y.view(*x.shape[:-1], self.out_features)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """What ``forward`` computes, step by step in torch (``reference_part``): from the
        codes and scales, not the kernel (tests compare the two)."""
        rows = x.reshape(-1, self.in_features)
        outs = []
        for p, b in zip(self.parts, self.bias_parts, strict=True):
            y = reference_part(p, rows)
            outs.append((y if b is None else y + b).to(x.dtype))
        return torch.cat(outs, dim=-1).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        types = "+".join(p.ggml_type for p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, {types}"


def weight_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers and of its quantized modules' tensors
    (``GGUFLinear`` parts, ``GGUFEmbedding``: not parameters; a tied LM head's are its
    embedding's, counted once)."""
    tensors = [*model.parameters(), *model.buffers()]
    packed: dict[int, torch.Tensor] = {}
    for m in model.modules():
        parts = m.parts if isinstance(m, GGUFLinear) else []
        if isinstance(m, GGUFEmbedding):
            parts = [m.packed]
        packed |= {t.data_ptr(): t for p in parts for t in (p.qs, p.d, p.aux) if t.numel()}
    tensors += packed.values()
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type != "meta")


def release_freed_memory() -> None:
    """Give the heap's free pages back to the system: a garbage collection, then glibc's
    ``malloc_trim`` (nothing where the C library is not glibc). Packing frees about the
    model's size in temporaries, which the CPU allocator settings
    (``engine/cpu_env.tune_malloc``: give back only above 2 GiB) would otherwise keep in the
    process's resident memory (as would moving codes onto huge pages)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# codes moved onto huge pages per mapping of about this many bytes: the copies of one batch
# exist beside their originals only until the modules take them
_ARENA_BYTES = 256 << 20


def quantized_on_huge_pages(model: nn.Module) -> int:
    """Move the codes (``qs``) of every int8 ``GGUFLinear`` part of ``model``
    (``pack_int8``'s: ``--quantization int8``) into mappings on huge pages
    (``kvserve/hugepages.py``: ``huge_arena``), in place; a ``GGUFEmbedding`` that shares
    a part (a tied LM head) takes the same copy. A decode step streams these codes from
    DRAM; packed by torch at load they sat on 4 KiB pages (a Qwen3-MoE's 2,048 experts'
    codes: none of 730 MB on huge pages), and the TLB misses on the way cost ~10 % of the
    int8 decode step (benchmarks/history/notebook.md). A GGUF file's parts are left where
    they are: numpy packs them and advises its large arrays as huge pages itself (a 1B
    Q4_K_M file's codes: 99 % on huge pages); a copy gained nothing there. Returns the
    bytes moved: 0 where huge pages do not apply (disabled, too little, another device);
    then nothing changed. Gives the freed originals back to the system."""
    moved = _move_int8_codes(model)
    if moved:  # the originals, which the allocator would otherwise keep resident
        release_freed_memory()
    return moved


def _move_int8_codes(model: nn.Module) -> int:
    """``quantized_on_huge_pages``' copies, in batches of ``_ARENA_BYTES``; returns the
    bytes moved. The originals' last references go with this frame."""
    linears = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    parts = {id(p): p for m in linears for p in m.parts if p.ggml_type == INT8}
    batches: list[list[Packed]] = [[]]
    size = 0
    for p in parts.values():
        if size >= _ARENA_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(p)
        size += p.qs.nbytes
    moved_bytes = 0
    for batch in batches:
        copies = huge_arena([p.qs for p in batch])
        moved = {
            id(p): replace(p, qs=q) for p, q in zip(batch, copies, strict=True) if q is not p.qs
        }
        moved_bytes += sum(p.qs.nbytes for p in moved.values())
        for m in model.modules() if moved else []:
            if isinstance(m, GGUFLinear):
                m.parts = [moved.get(id(p), p) for p in m.parts]
            elif isinstance(m, GGUFEmbedding):
                m.packed = moved.get(id(m.packed), m.packed)
    return moved_bytes


class GGUFEmbedding(nn.Module):
    """Token embeddings looked up in a quantized matrix (rows dequantized on lookup, into
    ``dtype``); ``packed`` also serves a tied LM head (``GGUFLinear([packed])``)."""

    def __init__(self, packed: Packed, dtype: torch.dtype):
        super().__init__()
        self.packed = packed
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = packed.n, packed.k

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).long()
        return unpack_rows(self.packed, flat).to(self.dtype).view(*ids.shape, self.packed.k)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.packed.ggml_type}"
