"""One rank of the shared-memory collective test (run as a subprocess by test_shm_comm)."""

from __future__ import annotations

import sys

import torch

from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.shm import ShmChannel

SHAPES = [(3,), (8, 576), (1000, 37), (5000,)]  # the last two exceed the 4 KiB capacity
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def inputs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(s, generator=g).to(d) for d in DTYPES for s in SHAPES]


def main(path: str, rank: int, world: int, capacity: int, out: str) -> None:
    assert load_cpu_kernels()
    ch = ShmChannel.open(path, rank, world, capacity, timeout=30.0)
    reduced = [ch.all_reduce(x.clone()) for x in inputs(rank)]
    gathered = [ch.gather(x) for x in inputs(rank)]
    torch.save({"reduced": reduced, "gathered": gathered, "rounds": int(ch.seq)}, out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
