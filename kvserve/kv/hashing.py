"""Chained block hashes: the name of a full KV block in every pool, tier and node.

A block's hash covers its parent's hash (so it names the whole prefix up to and including
the block), its token ids, and — through the root — the extra keys that decide whether two
blocks' bytes are interchangeable: model fingerprint, KV dtype, block size and an optional
isolation salt (tenant, per-request ``cache_salt``). Hashes are 16 bytes of BLAKE2b, stable
across processes and machines (unlike Python's ``hash``), so a store can key on them.

A hash names, it does not prove: whoever serves a block by hash also compares token ids.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Sequence
from pathlib import Path

BlockHash = bytes
HASH_BYTES = 16


def _digest(*parts: bytes) -> BlockHash:
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    for p in parts:
        h.update(len(p).to_bytes(4, "little"))
        h.update(p)
    return h.digest()


def root_hash(*extra_keys: str | None) -> BlockHash:
    """The parent of a sequence's first block, from the keys that make KV bytes comparable.

    ``None`` keys are skipped (e.g. no salt), so adding an unset key keeps old hashes.
    """
    return _digest(b"kvserve-block-v1", *(k.encode() for k in extra_keys if k is not None))


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block chained to ``parent``."""
    return _digest(parent, array("q", token_ids).tobytes())


def hash_blocks(
    parent: BlockHash, token_ids: Sequence[int], block_size: int, start_block: int = 0
) -> list[BlockHash]:
    """Hashes of the full blocks ``start_block, …`` of ``token_ids`` chained from ``parent``
    (the hash of block ``start_block - 1``, or the root when ``start_block`` is 0)."""
    out = []
    for i in range(start_block, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


def model_fingerprint(model_dir: str | Path) -> str:
    """A short, stable id of a checkpoint: config.json plus every safetensors file's tensor
    index (names, dtypes, shapes, offsets) and size. Cheap (headers only), and it changes
    when the architecture or any weight file is replaced."""
    root = Path(model_dir)
    h = hashlib.blake2b(digest_size=12)
    config = root / "config.json"
    if config.is_file():
        h.update(json.dumps(json.loads(config.read_text()), sort_keys=True).encode())
    for f in sorted(root.glob("*.safetensors")):
        with f.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(f.name.encode())
            h.update(fh.read(min(n, 100_000_000)))
        h.update(str(f.stat().st_size).encode())
    return h.hexdigest()
