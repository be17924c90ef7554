"""The worker's host copies of swapped-out requests' K/V (the tensor side of swapping).

``apply`` executes one ``SchedulerOutput``'s swap lists, before that step's forward pass:
host copies of finished requests are dropped, then every ``SwapOut`` copies device blocks
to host tensors of the request's own (pinned on CUDA), then every ``SwapIn`` copies them
into the fresh blocks the scheduler allocated and drops them. Swap-outs come first, so a
block freed by a victim and handed to another request in the same step is read before it
is overwritten. Copies are synchronous; each copy's bytes and seconds go to ``on_copy``
(the preemption cost model learns the bandwidth from them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvserve.model.kv_cache import block_tensors

if TYPE_CHECKING:
    from kvserve.sched.output import SchedulerOutput


class HostSwap:
    """Host tensors per swapped-out request, written and read only through ``apply``."""

    def __init__(
        self,
        caches: list,
        block_size: int,
        bytes_per_block: int,
        on_copy: Callable[[int, float], None] | None = None,
    ):
        self._dev = block_tensors(caches, block_size)
        self.device = self._dev[0].device
        self.bytes_per_block = bytes_per_block
        self.on_copy = on_copy
        self._host: dict[str, list[torch.Tensor]] = {}  # one per device tensor
        self._pin = self.device.type == "cuda"

    def held(self) -> set[str]:
        return set(self._host)

    def apply(self, out: SchedulerOutput) -> None:
        for rid in out.swap_drop:
            self._host.pop(rid, None)
        for so in out.swap_out:
            self._copy_out(so.request_id, so.blocks)
        for si in out.swap_in:
            self._copy_in(si.request_id, si.blocks, si.skip)

    def _copy_out(self, request_id: str, blocks: list[int]) -> None:
        t0 = time.perf_counter()
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        host = []
        for t in self._dev:
            part = t.index_select(1, idx)
            if self.device.type != "cpu":
                pinned = torch.empty(part.shape, dtype=part.dtype, pin_memory=self._pin)
                part = pinned.copy_(part, non_blocking=True)
            host.append(part)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._host[request_id] = host
        self._observe(len(blocks), time.perf_counter() - t0)

    def _copy_in(self, request_id: str, blocks: list[int], skip: int) -> None:
        host = self._host.pop(request_id)
        t0 = time.perf_counter()
        if blocks:
            idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
            for t, h in zip(self._dev, host, strict=True):
                t.index_copy_(1, idx, h[:, skip:].to(self.device, non_blocking=True))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._observe(len(blocks), time.perf_counter() - t0)

    def _observe(self, num_blocks: int, seconds: float) -> None:
        if self.on_copy is not None and num_blocks:
            self.on_copy(num_blocks * self.bytes_per_block, seconds)
