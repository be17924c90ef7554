"""A shared-memory channel for the collectives of tensor-parallel ranks on one machine.

The engine core creates the segment (``create``: a zeroed file under ``/dev/shm``) before
it starts the ranks, each rank maps it (``ShmChannel.open``) and the engine unlinks the
file once every rank is up, so nothing outlives the processes. The collectives are C++
(``csrc/shm_comm.cpp``: a copy, a release/acquire flag per rank and a sum in rank order,
bounded by a timeout); ranks on other machines use gloo instead.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from dataclasses import dataclass

import torch

LINE = 64  # bytes of one rank's round counter (a cache line)


def segment_bytes(world: int, capacity: int) -> int:
    return world * LINE + 2 * world * capacity


def capacity_for(max_num_batched_tokens: int, hidden_size: int) -> int:
    """Bytes per rank and parity: one step's float32 activations, within 4–64 MiB
    (larger tensors take several rounds)."""
    return max(4 << 20, min(64 << 20, max_num_batched_tokens * hidden_size * 4))


def create(world: int, capacity: int) -> str:
    """A new zeroed segment for ``world`` ranks; returns its path."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="kvserve-tp-", dir=directory)
    try:
        os.ftruncate(fd, segment_bytes(world, capacity))
    finally:
        os.close(fd)
    return path


@dataclass
class ShmChannel:
    """One rank's view of a segment."""

    tensor: torch.Tensor  # the mapped segment as uint8
    rank: int
    world: int
    capacity: int
    timeout: float
    _mm: mmap.mmap | None = None

    def __post_init__(self) -> None:
        self.seq = torch.zeros(1, dtype=torch.long)  # rounds so far (the same on every rank)

    @classmethod
    def open(cls, path: str, rank: int, world: int, capacity: int, timeout: float) -> ShmChannel:
        with open(path, "r+b") as f:
            mm = mmap.mmap(f.fileno(), segment_bytes(world, capacity))
        tensor = torch.frombuffer(mm, dtype=torch.uint8)
        return cls(tensor, rank, world, capacity, timeout, mm)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` (contiguous, CPU) over the ranks in place; returns ``x``."""
        return torch.ops.kvserve.shm_all_reduce(
            x, self.tensor, self.seq, self.rank, self.world, self.capacity, self.timeout
        )

    def gather(self, x: torch.Tensor, dst: int = 0) -> torch.Tensor | None:
        """``[world, *x.shape]`` on rank ``dst``; None elsewhere."""
        out = torch.ops.kvserve.shm_gather(
            x.contiguous(), self.tensor, self.seq, self.rank, self.world, self.capacity,
            self.timeout, dst,
        )  # fmt: skip
        return out if self.rank == dst else None
