"""Writing GGUF K-quant blocks: ``Q4_K``, ``Q5_K`` and ``Q6_K`` from float weights.

The ``gguf`` package reads every K-quant type but writes none, and tests and benchmarks
need K-quant files of random models (model hubs are out of reach here). This quantizer
makes valid blocks with a plain min/max rule per block of 32 — not llama.cpp's search for
the best scales, so its error is somewhat larger than a real file's; whatever it writes,
kvserve and llama.cpp read the same values (the ``gguf`` package's dequantization is the
reference of both).

Q4_K, per super-block of 256 values: fp16 ``d`` and ``dmin``; 12 bytes holding eight 6-bit
scales and eight 6-bit mins (one each per block of 32); 128 bytes of 4-bit codes, the 64
values of a pair of blocks in 32 bytes (the first block in the low nibbles). A value is
``d * scale * q - dmin * min``. Q5_K (176 bytes) is Q4_K with a fifth bit: after the
scales, 32 bytes whose bit i holds the top bit of block i's 32 codes, then the low 4 bits
as Q4_K's.

Q6_K, per super-block of 256 values: 128 bytes of the codes' low 4 bits (a half of 128
values in 64 bytes: values 0–63 in the low nibbles, 64–127 in the high), 64 bytes of their
high 2 bits (a half's 128 values in 32 bytes, four to a byte), sixteen int8 scales (one per
16 values) and fp16 ``d``. A value is ``d * scale * (q - 32)``, q in 0..63.
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def _round(x: np.ndarray, top: int) -> np.ndarray:
    return np.clip(np.rint(x), 0, top).astype(np.uint8)


def _scale_bytes(sc: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins ``[..., 8]`` in Q4_K's 12 bytes ``[..., 12]``: bytes
    0–3 hold scales 0–3 and the top 2 bits of scales 4–7, bytes 4–7 the same for the
    mins, bytes 8–11 the low 4 bits of scales 4–7 (low nibble) and mins 4–7 (high)."""
    lo_sc, hi_sc = sc[..., :4], sc[..., 4:]
    lo_m, hi_m = mins[..., :4], mins[..., 4:]
    return np.concatenate(
        [
            lo_sc | ((hi_sc >> 4) << 6),
            lo_m | ((hi_m >> 4) << 6),
            (hi_sc & 15) | ((hi_m & 15) << 4),
        ],
        axis=-1,
    ).astype(np.uint8)


def _check(w: np.ndarray, name: str) -> tuple[int, int]:
    n, k = w.shape
    if k % QK_K:
        raise ValueError(f"{name}: a row of {k} is not whole blocks of {QK_K}")
    return n, k


def _with_min(w: np.ndarray, top: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K's rule, per block of 32: codes 0..``top`` between the block's minimum
    (its offset, never positive) and maximum. Returns fp16 ``d``, ``dmin`` ``[n, K/256]``,
    the 6-bit scales and mins ``[n, K/256, 8]`` and the codes ``[n, K/256, 8, 32]``."""
    n, k = w.shape
    x = np.asarray(w, np.float32).reshape(n, k // QK_K, 8, 32)
    lo = np.minimum(x.min(-1), 0.0)  # a block's offset is -min (never negative)
    scale, mins = (x.max(-1) - lo) / top, -lo
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (mins.max(-1) / 63).astype(np.float16)
    df, dmf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = _round(np.where(df > 0, scale / df, 0), 63)
        mq = _round(np.where(dmf > 0, mins / dmf, 0), 63)
        step = (df * sc)[..., None]
        q = _round(np.where(step > 0, (x + (dmf * mq)[..., None]) / step, 0), top)
    return d, dmin, sc, mq, q


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Codes ``[n, K/256, 8, 32]`` → their low 4 bits in 128 bytes per 256: the 64 values
    of a pair of blocks in 32 bytes, the first block in the low nibbles."""
    n, nsb = q.shape[:2]
    pairs = (q & 15).reshape(n, nsb, 4, 2, 32)
    return (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(n, nsb, 128).astype(np.uint8)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """Float rows ``[n, k]`` (``k`` a multiple of 256) → raw Q4_K rows uint8
    ``[n, k / 256 * 144]``; ValueError for another ``k``."""
    n, _ = _check(w, "Q4_K")
    d, dmin, sc, mq, q = _with_min(w, 15)
    parts = [d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), _scale_bytes(sc, mq)]
    blocks = np.concatenate([*parts, _nibbles(q)], axis=-1)
    return np.ascontiguousarray(blocks.reshape(n, -1))


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """Float rows ``[n, k]`` (``k`` a multiple of 256) → raw Q5_K rows uint8
    ``[n, k / 256 * 176]``; ValueError for another ``k``."""
    n, _ = _check(w, "Q5_K")
    d, dmin, sc, mq, q = _with_min(w, 31)
    bits = (q >> 4).astype(np.uint8)  # [n, nsb, 8 blocks, 32]: block i's in bit i
    qh = np.zeros((*bits.shape[:2], 32), np.uint8)
    for i in range(8):
        qh |= bits[:, :, i] << i
    parts = [d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), _scale_bytes(sc, mq)]
    blocks = np.concatenate([*parts, qh, _nibbles(q)], axis=-1)
    return np.ascontiguousarray(blocks.reshape(n, -1))


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """Float rows ``[n, k]`` (``k`` a multiple of 256) → raw Q6_K rows uint8
    ``[n, k / 256 * 210]``; ValueError for another ``k``."""
    n, k = _check(w, "Q6_K")
    nsb = k // QK_K
    x = np.asarray(w, np.float32).reshape(n, nsb, 16, 16)
    scale = np.abs(x).max(-1) / 31  # per 16 values; codes -31..31 around 32
    d = (scale.max(-1) / 127).astype(np.float16)
    df = d.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.rint(np.where(df > 0, scale / df, 0)), 0, 127).astype(np.int8)
        step = (df * sc)[..., None]
        q = np.clip(np.rint(np.where(step > 0, x / step, 0)) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(n, nsb, 2, 128)  # two halves of 128
    lo, hi = (q & 15).reshape(n, nsb, 2, 2, 64), (q >> 4).reshape(n, nsb, 2, 4, 32)
    ql = (lo[:, :, :, 0] | (lo[:, :, :, 1] << 4)).reshape(n, nsb, 128)
    qh = hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6)
    blocks = np.concatenate(
        [ql, qh.reshape(n, nsb, 64), sc.view(np.uint8), d[..., None].view(np.uint8)], axis=-1
    )
    return np.ascontiguousarray(blocks.astype(np.uint8).reshape(n, -1))


_WRITERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def quantize(value: np.ndarray, ggml_type: str) -> np.ndarray:
    """``value`` (float, rows along the last axis) as raw blocks of ``ggml_type``: this
    module's writers for the K-quants, the ``gguf`` package's quantizer for the rest."""
    writer = _WRITERS.get(ggml_type)
    if writer is None:
        from gguf import GGMLQuantizationType, quants

        return quants.quantize(value, GGMLQuantizationType[ggml_type])
    raw = writer(value.reshape(-1, value.shape[-1]))
    return raw.reshape(*value.shape[:-1], raw.shape[-1])
