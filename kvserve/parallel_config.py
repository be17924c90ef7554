"""Tensor-parallel configuration (``ParallelConfig``) and its flags' parsing helpers;
re-exported by ``kvserve.config`` beside the other configs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: ``tensor_parallel_size`` ranks (worker processes) hold one
    shard each; with ``nnodes`` > 1 they span machines, ``tensor_parallel_size / nnodes``
    per node, this one being ``node_rank`` (node 0 runs the engine core and the API
    server; the others only workers). ``distributed_init_method`` (``tcp://HOST:PORT``) is
    where node 0 listens for the ranks' rendezvous; default (one node): a free local port,
    or ``MASTER_ADDR``/``MASTER_PORT`` when set (torchrun's variables; ``NODE_RANK`` /
    ``GROUP_RANK`` and ``NNODES`` too). Every collective gives up after
    ``distributed_timeout`` seconds."""

    tensor_parallel_size: int = 1
    distributed_init_method: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    distributed_timeout: float = 120.0

    def __post_init__(self) -> None:
        n = self.tensor_parallel_size
        if n < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {n}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} is not in 0..nnodes-1 ({self.nnodes})")
        if n % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size {n} is not a multiple of nnodes {self.nnodes} "
                "(every node runs the same number of ranks)"
            )
        if self.nnodes > 1 and self.distributed_init_method is None:
            raise ValueError("--nnodes > 1 needs --distributed-init-method tcp://HOST:PORT")
        if self.distributed_init_method is not None:
            host_port(self.distributed_init_method)  # validates
        if self.distributed_timeout <= 0:
            raise ValueError("distributed_timeout must be positive")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes


def host_port(init_method: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` → ``(HOST, PORT)``; raises ValueError naming the flag."""
    rest = init_method.removeprefix("tcp://")
    host, _, port = rest.rpartition(":")
    if not init_method.startswith("tcp://") or not host or not port.isdigit():
        raise ValueError(f"--distributed-init-method {init_method!r}: expected tcp://HOST:PORT")
    return host.strip("[]"), int(port)


def torchrun_env() -> dict[str, Any]:
    """ParallelConfig fields from torchrun-style environment variables, when set."""
    env = os.environ
    out: dict[str, Any] = {}
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        out["distributed_init_method"] = f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    rank = env.get("NODE_RANK") or env.get("GROUP_RANK")
    if rank is not None and rank.isdigit():
        out["node_rank"] = int(rank)
    if env.get("NNODES", "").isdigit():
        out["nnodes"] = int(env["NNODES"])
    return out
