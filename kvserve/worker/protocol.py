"""Messages between the engine core and its tensor-parallel worker processes.

The engine publishes one message per step to every rank (the step's ``SchedulerOutput``:
plain data, the deltas of the requests each rank keeps a copy of, on a ZeroMQ XPUB
socket; pickled, since copy lists carry tensors); ranks answer on one PULL socket: rank 0
with the step's ``StepDone`` (sampled tokens), any rank with ``WorkerFailed`` before it
exits. Start-up: every rank loads its shard and sends ``WorkerReady`` (its block capacity
and weight bytes); the engine publishes ``InitCache`` with the smallest capacity, each
rank allocates and answers ``CacheReady``. With a KV store, ``SaveBlocks`` (after a step)
asks every rank for its shard of some blocks (``SavedRows``); a stored block is the
ranks' shards concatenated in rank order. ``Shutdown`` ends the workers (exit 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.sched.output import StepResult
from kvserve.utils import resolve_device

STORE_PREFIX = "kvserve/"  # keys the engine core sets in the rendezvous store


@dataclass(frozen=True)
class WorkerArgs:
    """How one rank finds the others: the rendezvous store at ``host:port`` (the engine
    core serves it), its global ``rank`` of ``world_size``, its ``local_rank`` of
    ``local_world`` on this machine (which cores or GPU it takes)."""

    host: str
    port: int
    rank: int
    world_size: int
    local_rank: int
    local_world: int
    timeout: float
    die_with_parent: bool = True


@dataclass(frozen=True)
class WorkerReady:
    rank: int
    pid: int
    hostname: str
    num_blocks: int  # KV blocks this rank can hold
    weight_bytes: int
    dense_masks: bool  # whether its attention backend reads dense masks


@dataclass(frozen=True)
class InitCache:
    num_blocks: int
    swap: bool  # keep host copies for swap preemption
    store: bool  # blocks move to and from a KV store (SaveBlocks, SchedulerOutput.kv_loads)


@dataclass(frozen=True)
class CacheReady:
    rank: int
    parts: tuple  # per layer, (dtype name, shape) of each part of one block (serde)
    digest: str | None = None  # its blocks' scales/shift digest (KVTransfer.block_format)


@dataclass(frozen=True)
class SaveBlocks:
    """Every rank answers with ``SavedRows``: its shard of these blocks' bytes (each
    block's page per KV group, ``KVSave.pages``)."""

    blocks: list[tuple[int, ...]]


@dataclass(frozen=True)
class SavedRows:
    rank: int
    rows: torch.Tensor  # [len(blocks), this rank's payload bytes] uint8


@dataclass
class StepDone:
    """Rank 0's answer to a step: its result (None when no tokens were scheduled) and the
    requests whose KV it holds host copies of (for ``check_integrity``)."""

    result: StepResult | None
    swap_held: set[str]
    comm_seconds: float  # rank 0's time inside collectives so far
    request_copies: int  # requests rank 0 keeps a copy of after the step


@dataclass(frozen=True)
class WorkerFailed:
    rank: int
    error: str


@dataclass(frozen=True)
class Shutdown:
    pass


def loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1")


def device_for(device: str, local_rank: int) -> torch.device:
    """A rank's device for the ``--device`` flag (``resolve_device``): the CPU, or
    ``cuda:<local_rank>`` on CUDA (each local rank its own GPU)."""
    dev = resolve_device(device)
    return torch.device("cuda", local_rank) if dev.type == "cuda" else dev
