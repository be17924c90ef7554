"""Serialized KV blocks: a header that names exactly what the bytes are, then the bytes.

Layout: ``b"KVSB"`` · u32 header length · header (JSON, UTF-8) · payload.

The header carries the format version, the block's key (its chained hash) and token ids,
the model
fingerprint, KV dtype, block size, layer count, each tensor's dtype and shape, the
fp8 scales' digest (fp8 blocks are only meaningful under the scales they were written
with) and a CRC32 of the payload. ``decode`` returns the tensors only when every field
equals what the reader expects and the checksum holds; anything else — truncated,
corrupted, another model's, another dtype's, a value stored under the wrong key — is a
miss with a reason, never data.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

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
        per_layer = 0
        for dtype, shape in self.parts:
            n = _DTYPES[dtype].itemsize
            for d in shape:
                n *= d
            per_layer += n
        return per_layer * self.num_layers

    def header(self, key: bytes, checksum: int, tokens: Sequence[int]) -> dict:
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
            "crc32": checksum,
        }


def encode(
    fmt: BlockFormat, key: bytes, tensors: list[torch.Tensor], tokens: Sequence[int] = ()
) -> bytes:
    """``tensors``: ``num_layers × len(parts)`` tensors in layer-major order, each of its
    part's dtype and shape; ``tokens``: the block's token ids (checked on decode, so a hash
    collision is a miss). Raises ValueError when the tensors do not match ``fmt``."""
    if len(tensors) != fmt.num_layers * len(fmt.parts):
        raise ValueError(f"expected {fmt.num_layers * len(fmt.parts)} tensors, got {len(tensors)}")
    chunks = []
    for i, t in enumerate(tensors):
        dtype, shape = fmt.parts[i % len(fmt.parts)]
        if t.dtype != _DTYPES[dtype] or tuple(t.shape) != shape:
            raise ValueError(f"tensor {i}: {t.dtype} {tuple(t.shape)}, expected {dtype} {shape}")
        chunks.append(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    payload = b"".join(chunks)
    header = fmt.header(key, zlib.crc32(payload), tokens)
    header = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + _LEN.pack(len(header)) + header + payload


def decode(
    fmt: BlockFormat, key: bytes, data: bytes, tokens: Sequence[int] = ()
) -> list[torch.Tensor] | str:
    """The block's tensors, or a reason string (``corrupt: …`` or ``mismatch: …``)."""
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
    expected = fmt.header(key, header.get("crc32", -1), tokens)
    for field in ("key", "tokens", "model", "kv", "bs", "layers", "parts", "scales"):
        if header.get(field) != expected[field]:
            return f"mismatch: {field}"
    if len(payload) != fmt.payload_bytes:
        return f"corrupt: payload of {len(payload)} bytes, expected {fmt.payload_bytes}"
    if zlib.crc32(payload) != header["crc32"]:
        return "corrupt: checksum"
    buf = bytearray(data)  # torch.frombuffer wants a writable buffer; one copy
    out = []
    offset = 8 + hlen
    for _ in range(fmt.num_layers):
        for dtype, shape in fmt.parts:
            n = _DTYPES[dtype].itemsize
            for d in shape:
                n *= d
            t = torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=offset)
            out.append(t.view(_DTYPES[dtype]).view(shape))
            offset += n
    return out
