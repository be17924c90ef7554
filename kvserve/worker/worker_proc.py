"""A tensor-parallel worker process: one rank's shard, KV tensors and forward pass.

``worker_main`` (the process target) joins the ``torch.distributed`` group (gloo on CPU,
NCCL on CUDA) through the engine core's rendezvous store, reads the engine's
``ShardInputs`` from it, loads its shard of the weights, and then executes every step
the engine publishes, in order (``worker.protocol``). Contracts:

- every collective is bounded by the group's timeout: a dead peer fails the step, the
  rank reports ``WorkerFailed`` and exits 1 — it never waits forever;
- a rank whose engine core is gone exits: locally the kernel's parent-death signal,
  on another node a failed check of the rendezvous store (the engine core serves it)
  while idle;
- on a CPU each local rank is pinned to its own share of this machine's allowed cores
  (``torch.set_num_threads`` to match), as vLLM-CPU binds its OpenMP threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import signal
import socket
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import zmq

from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.parallel import ShardPlan, TPGroup
from kvserve.model.shm import ShmChannel
from kvserve.worker.inputs import InputBuilder
from kvserve.worker.loading import ShardBuilder, ShardInputs, rank_kv_spec
from kvserve.worker.model_runner import ModelRunner
from kvserve.worker.offload import KVTransfer
from kvserve.worker.protocol import (
    STORE_PREFIX,
    CacheReady,
    InitCache,
    SaveBlocks,
    SavedRows,
    Shutdown,
    StepDone,
    WorkerArgs,
    WorkerFailed,
    WorkerReady,
    device_for,
    loopback,
)
from kvserve.worker.swap import HostSwap

logger = logging.getLogger("kvserve")

IDLE_CHECK_S = 1.0  # how often an idle rank checks that the engine core is alive


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _pin(local_rank: int, local_world: int) -> None:
    """Pin this rank to its contiguous share of the allowed cores (CPU only)."""
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, len(cpus) // local_world)
    mine = cpus[local_rank * per : (local_rank + 1) * per] or cpus
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))


def worker_main(wa: WorkerArgs) -> None:
    """The process target: run rank ``wa.rank`` until ``Shutdown`` (exit 0) or a
    failure (reported, exit 1)."""
    if wa.die_with_parent:
        _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine core decides when to stop
    logging.basicConfig(level=logging.WARNING, format=f"rank {wa.rank}: %(message)s")
    if loopback(wa.host):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = zmq.Context()
    push = None
    try:
        timeout = timedelta(seconds=wa.timeout)
        store = dist.TCPStore(wa.host, wa.port, is_master=False, timeout=timeout)
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 5000)
        push.connect(store.get(STORE_PREFIX + "results").decode())
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(store.get(STORE_PREFIX + "steps").decode())
        inp: ShardInputs = pickle.loads(store.get(STORE_PREFIX + "shard_inputs"))
        device = device_for(inp.model_config.device, wa.local_rank)
        if device.type == "cpu":
            _pin(wa.local_rank, wa.local_world)
        else:
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=dist.PrefixStore(STORE_PREFIX + "tp", store),
            rank=wa.rank,
            world_size=wa.world_size,
            timeout=timeout,
        )
        shm = None
        # every rank of one machine decides alike: the same segment, the same kernels
        if device.type == "cpu" and store.check([STORE_PREFIX + "shm"]) and load_cpu_kernels():
            path, capacity = store.get(STORE_PREFIX + "shm").decode().rsplit("|", 1)
            shm = ShmChannel.open(path, wa.rank, wa.world_size, int(capacity), wa.timeout)
        tp = TPGroup(ShardPlan.for_rank(inp.spec, wa.rank, wa.world_size), shm=shm)
        torch.manual_seed(inp.model_config.seed)
        shard = ShardBuilder(inp, device, tp)
        ready = WorkerReady(
            wa.rank,
            os.getpid(),
            socket.gethostname(),
            shard.num_blocks(),
            shard.weight_bytes,
            shard.backend.dense_masks,
        )
        push.send(pickle.dumps(ready))
        _loop(wa, store, sub, push, shard)
    except Exception:
        msg = traceback.format_exc()
        logger.error("failed:\n%s", msg)
        if push is not None:
            with contextlib.suppress(Exception):
                push.send(pickle.dumps(WorkerFailed(wa.rank, msg)))
                push.close(linger=2000)
        sys.exit(1)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    push.close(linger=2000)
    sys.exit(0)


def _loop(wa: WorkerArgs, store, sub: zmq.Socket, push: zmq.Socket, shard: ShardBuilder):
    runner: ModelRunner | None = None
    while True:
        if not sub.poll(int(IDLE_CHECK_S * 1000)):
            store.check([STORE_PREFIX + "steps"])  # raises when the engine core is gone
            continue
        msg = pickle.loads(sub.recv())
        if isinstance(msg, Shutdown):
            return
        if isinstance(msg, InitCache):
            caches = shard.allocate(msg.num_blocks)
            bs = shard.kv_spec.block_size
            swap = HostSwap(caches, bs, shard.kv_spec.bytes_per_block) if msg.swap else None
            groups = shard.kv_spec.groups
            layer_group = groups.layer_group if groups is not None else None
            row_slice = _row_slice(shard, wa.rank, wa.world_size) if msg.store else None
            transfer = KVTransfer(caches, bs, "", "", layer_group, row_slice)
            inp, dense = shard.inp, shard.backend.dense_masks
            inputs = InputBuilder(bs, shard.device, inp.window, inp.attention_sinks, dense)
            runner = ModelRunner(
                shard.model,
                caches,
                shard.device,
                inputs,
                host_swap=swap,
                kv_transfer=transfer if msg.store else None,
            )
            digest = transfer.block_format().scales_digest
            push.send(pickle.dumps(CacheReady(wa.rank, transfer.parts, digest)))
            continue
        assert runner is not None, "a step before InitCache"
        if isinstance(msg, SaveBlocks):
            assert runner.kv_transfer is not None
            push.send(pickle.dumps(SavedRows(wa.rank, runner.kv_transfer.rows(msg.blocks))))
            continue
        result = runner.execute(msg)
        if wa.rank == 0:
            comm = shard.model.tp.comm_seconds if shard.model.tp is not None else 0.0
            done = StepDone(result, runner.swap_held(), comm, len(runner.requests))
            push.send(pickle.dumps(done))


def main(argv: list[str] | None = None) -> None:
    """``python -m kvserve.worker.worker_proc HOST PORT RANK WORLD LOCAL_RANK LOCAL_WORLD
    TIMEOUT``: how ``worker.executor.start_ranks`` starts a rank."""
    a = sys.argv[1:] if argv is None else argv
    worker_main(WorkerArgs(a[0], int(a[1]), *map(int, a[2:6]), float(a[6])))


def _row_slice(shard: ShardBuilder, rank: int, world: int) -> tuple[int, int]:
    """(offset, bytes) of this rank's shard in a stored block's payload row: the ranks'
    shards in rank order, each every layer's bytes of its KV heads for one block (in the
    hybrid layout more than one pool block, which holds a group's layers)."""
    sizes = []
    for q in range(world):
        spec = rank_kv_spec(shard.inp, shard.kv_format, q, world)
        sizes.append(spec.bytes_per_token * spec.block_size)
    return sum(sizes[:rank]), sizes[rank]


if __name__ == "__main__":
    main()
