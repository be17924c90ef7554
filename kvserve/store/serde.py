"""Serialized KV blocks: a header that names exactly what the bytes are, then the bytes.

Layout: ``b"KVSB"`` · u32 header length · header (JSON, UTF-8) · payload.

The header carries the format version, the block's key (its chained hash) and token ids,
the model
fingerprint, KV dtype, block size, layer count, each tensor's dtype and shape, the
fp8 scales' digest (fp8 blocks are only meaningful under the scales they were written
with) and an XXH3-64 checksum of the payload (~50 GB/s, so checking costs little next
to moving the bytes). ``decode`` returns the tensors only when every field
equals what the reader expects and the checksum holds; anything else — truncated,
corrupted, another model's, another dtype's, a value stored under the wrong key — is a
miss with a reason, never data.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

MAGIC = b"KVSB"
VERSION = 1
_LEN = struct.Struct("<I")
_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


@dataclass(frozen=True)
class BlockFormat:
    """What one stored block holds: per layer, ``parts`` tensors (dtype name, shape)."""

    model_fingerprint: str
    kv_dtype: str
    block_size: int
    num_layers: int
    parts: tuple[tuple[str, tuple[int, ...]], ...]
    scales_digest: str | None = None

    @property
    def payload_bytes(self) -> int:
        per_layer = sum(_DTYPES[d].itemsize * math.prod(s) for d, s in self.parts)
        return per_layer * self.num_layers

    def header(self, key: bytes, checksum: str, tokens: Sequence[int]) -> dict:
        return {
            "v": VERSION,
            "key": key.hex(),
            "tokens": list(tokens),
            "model": self.model_fingerprint,
            "kv": self.kv_dtype,
            "bs": self.block_size,
            "layers": self.num_layers,
            "parts": [[d, list(s)] for d, s in self.parts],
            "scales": self.scales_digest,
            "xxh3": checksum,
        }


def pack(fmt: BlockFormat, tensors: list[torch.Tensor]) -> torch.Tensor:
    """One block's ``num_layers × len(parts)`` tensors (layer-major, each of its part's
    dtype and shape) as the flat uint8 payload. Raises ValueError on a mismatch."""
    if len(tensors) != fmt.num_layers * len(fmt.parts):
        raise ValueError(f"expected {fmt.num_layers * len(fmt.parts)} tensors, got {len(tensors)}")
    flat = []
    for i, t in enumerate(tensors):
        dtype, shape = fmt.parts[i % len(fmt.parts)]
        if t.dtype != _DTYPES[dtype] or tuple(t.shape) != shape:
            raise ValueError(f"tensor {i}: {t.dtype} {tuple(t.shape)}, expected {dtype} {shape}")
        flat.append(t.detach().cpu().contiguous().view(torch.uint8).reshape(-1))
    return torch.cat(flat)


def unpack(fmt: BlockFormat, payload: torch.Tensor) -> list[torch.Tensor]:
    """The inverse of ``pack`` (views into ``payload``)."""
    out = []
    offset = 0
    for _ in range(fmt.num_layers):
        for dtype, shape in fmt.parts:
            n = _DTYPES[dtype].itemsize * math.prod(shape)
            out.append(payload[offset : offset + n].view(_DTYPES[dtype]).view(shape))
            offset += n
    return out


def encode(
    fmt: BlockFormat, key: bytes, payload: torch.Tensor | bytes, tokens: Sequence[int] = ()
) -> bytes:
    """Header + ``payload`` (the block's bytes, see ``pack``); ``tokens``: the block's
    token ids (checked on decode, so a hash collision is a miss). Raises ValueError for a
    payload of the wrong size."""
    if isinstance(payload, torch.Tensor):
        payload = payload.contiguous().view(torch.uint8).numpy().tobytes()
    if len(payload) != fmt.payload_bytes:
        raise ValueError(f"payload of {len(payload)} bytes, expected {fmt.payload_bytes}")
    header = fmt.header(key, xxhash.xxh3_64_hexdigest(payload), tokens)
    header = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + _LEN.pack(len(header)) + header + payload


def check(
    fmt: BlockFormat, key: bytes, data: bytes, tokens: Sequence[int] = ()
) -> memoryview | str:
    """The payload of a valid block (a view into ``data``, no copy), or a reason string
    (``corrupt: …`` or ``mismatch: …``) for anything else."""
    if len(data) < 8 or data[:4] != MAGIC:
        return "corrupt: bad magic"
    (hlen,) = _LEN.unpack_from(data, 4)
    if 8 + hlen > len(data):
        return "corrupt: truncated header"
    try:
        header = json.loads(data[8 : 8 + hlen])
    except ValueError:
        return "corrupt: unreadable header"
    payload = memoryview(data)[8 + hlen :]
    if not isinstance(header, dict) or header.get("v") != VERSION:
        return f"mismatch: format version {header.get('v') if isinstance(header, dict) else '?'}"
    expected = fmt.header(key, header.get("xxh3", ""), tokens)
    for field in ("key", "tokens", "model", "kv", "bs", "layers", "parts", "scales"):
        if header.get(field) != expected[field]:
            return f"mismatch: {field}"
    if len(payload) != fmt.payload_bytes:
        return f"corrupt: payload of {len(payload)} bytes, expected {fmt.payload_bytes}"
    if xxhash.xxh3_64_hexdigest(payload) != header["xxh3"]:
        return "corrupt: checksum"
    return payload


def decode(
    fmt: BlockFormat, key: bytes, data: bytes, tokens: Sequence[int] = ()
) -> torch.Tensor | str:
    """``check``, then the payload copied into a flat uint8 tensor (``unpack`` splits it)."""
    payload = check(fmt, key, data, tokens)
    if isinstance(payload, str):
        return payload
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)
