"""Direct replication to the session's standby (``--replicate-to standby``).

After each accepted publish the primary pushes the delta to the standby the router named:
the session record and the KV blocks that became full since the last push, read from the
primary's own host tier (where the offloader put them, serialized and checksummed). The
standby verifies every block against the hashes and tokens of the record — a block with
the wrong key, tokens, format or checksum is dropped, never cached — and puts the good
ones into its host tier and, pre-warmed, into its device pool (``--prewarm-device-
fraction``), so a takeover finds them in local memory without waiting for the shared
tier. Pushing is best effort (bounded timeouts, failures counted); the
coordinator record stays the source of truth for ownership and fencing.

Wire format of ``POST /internal/replica`` (authenticated with the cluster secret): a 4-byte
big-endian header length, the JSON header ``{"session", "epoch", "record", "blocks":
[[index, length], …]}``, then the blocks' bytes back to back.
"""

from __future__ import annotations

import json
import logging
import struct
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import httpx
import msgspec

from kvserve.ha.coordination import Coordinator
from kvserve.ha.record import SessionRecord
from kvserve.store import serde

if TYPE_CHECKING:
    from kvserve.store.offloader import KVOffloader

logger = logging.getLogger("kvserve")
_LEN = struct.Struct(">I")


def encode_push(header: dict[str, Any], blocks: Sequence[tuple[int, bytes]]) -> bytes:
    head = dict(header, blocks=[[i, len(b)] for i, b in blocks])
    raw = json.dumps(head, separators=(",", ":")).encode()
    return b"".join([_LEN.pack(len(raw)), raw, *(b for _, b in blocks)])


def decode_push(body: bytes) -> tuple[dict[str, Any], list[tuple[int, bytes]]]:
    """Header and blocks of a push; raises ValueError for a malformed body."""
    if len(body) < 4:
        raise ValueError("truncated push")
    (n,) = _LEN.unpack_from(body, 0)
    try:
        header = json.loads(body[4 : 4 + n])
        spans = [(int(i), int(size)) for i, size in header["blocks"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"bad push header: {e}") from None
    pos, blocks = 4 + n, []
    for i, size in spans:
        if size < 0 or pos + size > len(body):
            raise ValueError("truncated push")
        blocks.append((i, body[pos : pos + size]))
        pos += size
    return header, blocks


class StandbyPusher:
    """Primary side (the replicator's publisher thread calls ``push``)."""

    def __init__(self, coord: Coordinator, offloader: KVOffloader, secret: str | None):
        self.coord = coord
        self.offloader = offloader
        self.secret = secret
        self.http = httpx.Client(timeout=httpx.Timeout(2.0, connect=1.0))
        self._urls: dict[str, tuple[str, float]] = {}  # node → (url, when read)
        self._pushed: OrderedDict[str, int] = OrderedDict()  # session → blocks pushed
        self.num_blocks = 0
        self.num_bytes = 0
        self.num_errors = 0

    def _url(self, node: str) -> str | None:
        url, when = self._urls.get(node, (None, 0.0))
        if url is None or time.monotonic() - when > 10:
            info = self.coord.nodes().get(node)
            if info is None:
                return None
            url = info["url"].rstrip("/")
            self._urls[node] = (url, time.monotonic())
        return url

    def push(self, session: str, epoch: int, record: SessionRecord) -> int:
        """Send ``record`` and its blocks not pushed yet to ``record.standby``; returns
        the blocks sent (0 on failure: counted, the next push retries them)."""
        standby = record.standby
        url = self._url(standby) if standby else None
        if url is None:
            return 0
        kv = self.offloader.kv
        bs = kv.block_size
        tokens = record.tokens()
        n = min(record.stored_tokens, len(tokens)) // bs
        done = self._pushed.get(session, 0)
        hashes = kv.hashes_for(tokens[: n * bs], record.cache_salt)[done:]
        values = self.offloader.host.get(hashes) if hashes else []
        blocks = [(done + j, v) for j, v in enumerate(values) if v is not None]
        header = {"session": session, "epoch": epoch, "record": msgspec.to_builtins(record)}
        body = encode_push(header, blocks)
        headers = {"Content-Type": "application/octet-stream"}
        if self.secret:
            headers["X-Kvserve-Cluster-Secret"] = self.secret
        try:
            r = self.http.post(url + "/internal/replica", content=body, headers=headers)
            r.raise_for_status()
        except httpx.HTTPError as e:
            self.num_errors += 1
            logger.warning("push of session %s to %s failed: %s", session, standby, e)
            return 0
        self._pushed[session] = n
        self._pushed.move_to_end(session)
        while len(self._pushed) > 4096:
            self._pushed.popitem(last=False)
        self.num_blocks += len(blocks)
        self.num_bytes += len(body)
        return len(blocks)

    def close(self) -> None:
        self.http.close()


def accept_push(
    offloader: KVOffloader, body: bytes
) -> tuple[list[tuple[bytes, list[int], memoryview]], int]:
    """Standby side: verify the pushed blocks against the record and put the good ones
    into the host tier. Returns the good ones, in chain order, as (hash, token ids,
    payload) — the engine pre-warms its device pool with them — and how many were
    refused; raises ValueError for a malformed body."""
    header, blocks = decode_push(body)
    if header.get("record") is None:
        raise ValueError("push without a record")
    record = SessionRecord.from_builtins(header["record"])
    kv = offloader.kv
    bs = kv.block_size
    tokens = record.tokens()
    n = len(tokens) // bs
    hashes = kv.hashes_for(tokens[: n * bs], record.cache_salt)
    fmt = offloader.block_format()
    good, verified, refused = [], [], 0
    for i, data in sorted(blocks):  # chain order: a device prefix is only useful from its start
        block_tokens = tokens[i * bs : (i + 1) * bs] if 0 <= i < n else []
        ok = serde.check(fmt, hashes[i], data, block_tokens) if block_tokens else "index"
        if isinstance(ok, str):
            refused += 1
            continue
        good.append((hashes[i], data))
        verified.append((hashes[i], block_tokens, ok))
    if good:
        offloader.host.put(good)
    return verified, refused
