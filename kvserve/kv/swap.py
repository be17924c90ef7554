"""Bounded host swap space for the K/V of preempted requests.

``swap_out`` copies a request's live blocks from the device cache into host tensors of
its own (pinned on CUDA) and remembers which table entries were live (entries outside a
sliding window hold the null block and are not copied); ``swap_in`` copies them into the
fresh blocks the KV manager handed out and releases the host copy. Copies are synchronous:
when ``swap_out`` returns, the device blocks may be reused. Each copy's bytes and seconds
go to ``on_copy`` (the preemption cost model learns the bandwidth from them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.kv.quant import QuantizedKVCache


@dataclass
class _Swapped:
    live: list[bool]  # per table entry: copied (True) or the null block (False)
    tensors: list[torch.Tensor]  # one per device tensor, [2, n_live, block_size, ...]


def block_tensors(caches: list, block_size: int) -> list[torch.Tensor]:
    """Every device tensor holding per-slot data, viewed as ``[2, blocks, block_size, …]``
    (fp8 through uint8: CPU index kernels do not cover fp8). Per-head fp8 scales are
    global and stay on the device."""
    out = []
    for cache in caches:
        parts = [cache]
        if isinstance(cache, QuantizedKVCache):
            parts = [cache.data.view(torch.uint8)]
            if cache.fmt.scale == "token":
                parts.append(cache.scale)
        for t in parts:
            out.append(t.view(2, -1, block_size, *t.shape[2:]))
    return out


class SwapSpace:
    """Host copies of swapped-out requests, at most ``capacity_bytes`` in all."""

    def __init__(
        self,
        caches: list,
        block_size: int,
        bytes_per_block: int,
        capacity_bytes: int,
        on_copy: Callable[[int, float], None] | None = None,
    ):
        self._dev = block_tensors(caches, block_size)
        self.device = self._dev[0].device
        self.bytes_per_block = bytes_per_block
        self.capacity_bytes = capacity_bytes
        self.capacity_blocks = capacity_bytes // bytes_per_block
        self.used_blocks = 0
        self.on_copy = on_copy
        self._swapped: dict[str, _Swapped] = {}
        self._pin = self.device.type == "cuda"

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.bytes_per_block

    def can_hold(self, num_blocks: int) -> bool:
        return self.used_blocks + num_blocks <= self.capacity_blocks

    def live(self, request_id: str) -> list[bool]:
        return list(self._swapped[request_id].live)

    def swap_out(self, request_id: str, table: list[int], null_block: int | None) -> bool:
        """Copy the blocks of ``table`` (all but null entries) to the host. Returns False,
        copying nothing, when they do not fit in the remaining space."""
        live = [b != null_block for b in table]
        ids = [b for b in table if b != null_block]
        if request_id in self._swapped:
            raise ValueError(f"request {request_id!r} is already swapped out")
        if not self.can_hold(len(ids)):
            return False
        t0 = time.perf_counter()
        idx = torch.tensor(ids, dtype=torch.long, device=self.device)
        host = []
        for t in self._dev:
            part = t.index_select(1, idx)
            if self.device.type != "cpu":
                pinned = torch.empty(part.shape, dtype=part.dtype, pin_memory=self._pin)
                part = pinned.copy_(part, non_blocking=True)
            host.append(part)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._swapped[request_id] = _Swapped(live, host)
        self.used_blocks += len(ids)
        self._observe(len(ids), time.perf_counter() - t0)
        return True

    def swap_in(self, request_id: str, blocks: list[int], skip: int = 0) -> None:
        """Copy the request's host blocks, after the first ``skip`` (shared back from the
        prefix cache instead), into device ``blocks`` (one per remaining live entry, in
        table order) and release the host copy."""
        sw = self._swapped.pop(request_id)
        n = sum(sw.live)
        if len(blocks) != n - skip:
            raise ValueError(
                f"swap_in of {request_id!r}: {n} blocks saved, {skip} shared, {len(blocks)} given"
            )
        t0 = time.perf_counter()
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        for t, h in zip(self._dev, sw.tensors, strict=True):
            if blocks:
                t.index_copy_(1, idx, h[:, skip:].to(self.device, non_blocking=True))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.used_blocks -= n
        self._observe(n - skip, time.perf_counter() - t0)

    def discard(self, request_id: str) -> None:
        """Drop a swapped request's host copy (it finished or was aborted); no-op if none."""
        sw = self._swapped.pop(request_id, None)
        if sw is not None:
            self.used_blocks -= sum(sw.live)

    def _observe(self, num_blocks: int, seconds: float) -> None:
        if self.on_copy is not None and num_blocks:
            self.on_copy(num_blocks * self.bytes_per_block, seconds)

    def check_integrity(self) -> None:
        used = sum(sum(s.live) for s in self._swapped.values())
        if used != self.used_blocks or used > self.capacity_blocks:
            raise AssertionError(
                f"swap space: {used} blocks held, counter {self.used_blocks}, "
                f"capacity {self.capacity_blocks}"
            )
