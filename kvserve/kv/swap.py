"""Bounded host swap space for the K/V of preempted requests: the bookkeeping (no tensors).

The scheduler decides here which requests' blocks go to the host and come back, and how
much room is left; the copies themselves are the worker's (``worker.swap.HostSwap``),
from the ``SwapOut`` / ``SwapIn`` lists of each ``SchedulerOutput``. ``reserve`` records a
swap-out (the entries of the table that are live: outside a sliding window a table holds
the null block, which is not copied) and returns what the worker must copy before any of
those blocks is reused — it runs the copies before the step's forward pass, swap-outs
before swap-ins, so blocks freed and handed out again in the same step are safe.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SwapOut:
    """Copy these device blocks (table order, null entries left out) to the host."""

    request_id: str
    blocks: list[int]


@dataclass(frozen=True)
class SwapIn:
    """Copy the request's host blocks after the first ``skip`` (shared back from the
    prefix cache instead) into these device blocks, and drop the host copy."""

    request_id: str
    blocks: list[int]
    skip: int


class SwapSpace:
    """Which requests are swapped out, with which live entries; at most
    ``capacity_bytes`` of host copies in all, at every point of a step: the room of a
    request coming back (``release``) is free only from the next step on (``settle``),
    since its host copy lives until the worker ran the step's swap-ins, and a swap-in
    cancelled in its own step (``restore``) keeps that copy."""

    def __init__(self, bytes_per_block: int, capacity_bytes: int):
        self.bytes_per_block = bytes_per_block
        self.capacity_bytes = capacity_bytes
        self.capacity_blocks = capacity_bytes // bytes_per_block
        self.used_blocks = 0  # held and still returning
        self._live: dict[str, list[bool]] = {}
        self._returning: dict[str, list[bool]] = {}  # released this step: still held

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.bytes_per_block

    def can_hold(self, num_blocks: int) -> bool:
        return self.used_blocks + num_blocks <= self.capacity_blocks

    def live(self, request_id: str) -> list[bool]:
        return list(self._live[request_id])

    def held(self) -> set[str]:
        return set(self._live)

    def reserve(self, request_id: str, table: list[int], null_block: int | None) -> SwapOut | None:
        """Room for the live blocks of ``table``; None, changing nothing, when they do not
        fit in the remaining space."""
        if request_id in self._live:
            raise ValueError(f"request {request_id!r} is already swapped out")
        live = [b != null_block for b in table]
        ids = [b for b in table if b != null_block]
        if not self.can_hold(len(ids)):
            return None
        self._live[request_id] = live
        self.used_blocks += len(ids)
        return SwapOut(request_id, ids)

    def release(self, request_id: str, blocks: list[int], skip: int) -> SwapIn:
        """The request comes back into ``blocks`` (one per live entry after the first
        ``skip``); its room is free from the next ``settle`` on."""
        live = self._live[request_id]
        n = sum(live)
        if len(blocks) != n - skip:
            raise ValueError(
                f"swap_in of {request_id!r}: {n} blocks saved, {skip} shared, {len(blocks)} given"
            )
        self._returning[request_id] = self._live.pop(request_id)
        return SwapIn(request_id, blocks, skip)

    def restore(self, request_id: str) -> None:
        """Undo a ``release`` of this step whose ``SwapIn`` the worker never ran: the host
        copy is held again (its room never left)."""
        if request_id not in self._returning:
            raise ValueError(f"request {request_id!r} was not released in this step")
        self._live[request_id] = self._returning.pop(request_id)

    def settle(self) -> None:
        """A new step: the room of the requests released in the last one is free (the
        worker ran their swap-ins, which dropped the host copies)."""
        self.used_blocks -= sum(sum(live) for live in self._returning.values())
        self._returning.clear()

    def discard(self, request_id: str) -> bool:
        """Forget a swapped request (finished or aborted); True if it had a host copy."""
        live = self._live.pop(request_id, None)
        if live is None:
            return False
        self.used_blocks -= sum(live)
        return True

    def check_integrity(self) -> None:
        held = [*self._live.values(), *self._returning.values()]
        used = sum(sum(live) for live in held)
        if used != self.used_blocks or used > self.capacity_blocks:
            raise AssertionError(
                f"swap space: {used} blocks held, counter {self.used_blocks}, "
                f"capacity {self.capacity_blocks}"
            )
