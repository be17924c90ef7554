"""The engine core's side of tensor parallelism: N worker processes, one step message.

``MultiprocExecutor`` serves the rendezvous store (``torch.distributed.TCPStore``) at
``--distributed-init-method`` (default: a free port on 127.0.0.1), publishes the
``ShardInputs`` there, starts this node's ranks as processes (``worker.worker_proc``;
other nodes start theirs with ``kvserve serve --node-rank R``, ``run_headless``) and
waits until every rank has loaded its shard. The KV pool is one (the engine core's
block manager) and holds as many blocks as the fullest rank can (``num_blocks``, the
minimum over the ranks).

``step`` has the in-process ``ModelRunner.step`` contract: it publishes the step's
``SchedulerOutput`` (plain data: deltas of the requests every rank keeps a copy of) to all
ranks, each builds its own inputs, and it returns rank 0's result.
Failure is fast and bounded: a rank that reports ``WorkerFailed``, a local rank process
that exits, or no answer within ``distributed_timeout`` (+ a margin) raises
``EngineError``; the engine core then exits non-zero and the server reports unhealthy.
``close`` stops the workers (``Shutdown``, then SIGKILL for any left after 10 s).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import zmq

from kvserve.config import ParallelConfig, host_port
from kvserve.errors import EngineError
from kvserve.model.kv_quant import kv_format
from kvserve.sched.output import SchedulerOutput, StepResult
from kvserve.store import serde
from kvserve.store.offloader import KVSave
from kvserve.store.tiered import TieredStore
from kvserve.utils import format_size
from kvserve.worker.loading import ShardInputs, rank_kv_spec
from kvserve.worker.protocol import (
    STORE_PREFIX,
    CacheReady,
    InitCache,
    SaveBlocks,
    SavedRows,
    Shutdown,
    StepDone,
    WorkerFailed,
    WorkerReady,
    device_for,
)

logger = logging.getLogger("kvserve")

STARTUP_TIMEOUT_S = 600.0  # loading a shard of a large checkpoint takes a while
_MARGIN_S = 30.0  # beyond the collective timeout, for a step's answer


def start_ranks(config: ParallelConfig, host: str, port: int) -> list[subprocess.Popen]:
    """Start this node's ranks (``node_rank * ranks_per_node`` …) as processes
    (``python -m kvserve.worker.worker_proc``; they die with this process)."""
    local = config.ranks_per_node
    procs = []
    for i in range(local):
        rank = config.node_rank * local + i
        argv = [host, port, rank, config.tensor_parallel_size, i, local, config.distributed_timeout]
        cmd = [sys.executable, "-m", "kvserve.worker.worker_proc", *map(str, argv)]
        procs.append(subprocess.Popen(cmd))
    return procs


class MultiprocExecutor:
    """Drives ``tensor_parallel_size`` ranks; see the module docstring."""

    def __init__(self, inp: ShardInputs, config: ParallelConfig):
        self.config = config
        self.size = config.tensor_parallel_size
        self.procs: list[subprocess.Popen] = []
        self._held: set[str] = set()
        self._copies = 0  # rank 0's request copies after the last step
        self._parts: list[tuple] = []  # each rank's block parts (start_cache)
        self._digest: str | None = None  # the ranks' scales/shift digests (start_cache)
        self._store_names: tuple[str, str] | None = None  # start_cache
        self.comm_seconds = 0.0  # rank 0's time in collectives, after the last step
        self._closed = False
        cache = inp.cache_config
        self.kv_format = kv_format(cache.kv_cache_dtype, inp.dtype, cache.kv_cache_scales)
        # rank 0 has the most KV heads (uneven splits give the first ranks one more)
        self.kv_spec = rank_kv_spec(inp, self.kv_format, 0, self.size)
        if config.distributed_init_method is None:
            host, port = "127.0.0.1", 0
        else:
            host, port = host_port(config.distributed_init_method)
        self._timeout = config.distributed_timeout
        if config.nnodes == 1:  # every rank is local: loopback only, whatever was named
            host = "127.0.0.1"
        self.store = dist.TCPStore(
            host,
            port,
            is_master=True,
            timeout=timedelta(seconds=self._timeout),
            wait_for_workers=False,
        )
        # the ranks' sockets carry pickles: only on the rendezvous address, never on every
        # interface (a trusted network, as torch.distributed's own ports need)
        bind = socket.gethostbyname(host)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # one subscription message per rank
        self._pub.setsockopt(zmq.SNDHWM, 0)
        self._pull = self._ctx.socket(zmq.PULL)
        steps = self._bind(self._pub, bind, host)
        results = self._bind(self._pull, bind, host)
        self._shm_path = None
        if config.nnodes == 1 and device_for(inp.model_config.device, 0).type == "cpu":
            from kvserve.model import shm

            capacity = shm.capacity_for(inp.max_num_batched_tokens, inp.spec.hidden_size)
            self._shm_path = shm.create(self.size, capacity)
            self.store.set(STORE_PREFIX + "shm", f"{self._shm_path}|{capacity}")
        self.store.set(STORE_PREFIX + "shard_inputs", pickle.dumps(inp))
        self.store.set(STORE_PREFIX + "results", results)
        self.store.set(STORE_PREFIX + "steps", steps)
        try:
            self.procs = start_ranks(config, host, self.store.port)
            self.ready = self._wait_ready()
        except BaseException:
            self.close()
            raise
        self._unlink_shm()  # every rank has mapped it
        self.num_blocks = min(r.num_blocks for r in self.ready)
        self.dense_masks = self.ready[0].dense_masks
        self.weight_bytes = [r.weight_bytes for r in self.ready]
        logger.info(
            "tensor parallel: %d ranks on %d node(s); weights per rank %s",
            self.size,
            config.nnodes,
            ", ".join(format_size(b) for b in self.weight_bytes),
        )

    def _unlink_shm(self) -> None:
        if self._shm_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._shm_path)
            self._shm_path = None

    @staticmethod
    def _bind(sock: zmq.Socket, bind: str, reach: str) -> str:
        port = sock.bind_to_random_port(f"tcp://{bind}")
        return f"tcp://{reach}:{port}"

    # ---- start-up ---------------------------------------------------------------------
    def _wait_ready(self) -> list[WorkerReady]:
        """Every rank's ``WorkerReady``, once every rank's step subscription has arrived
        too (a step published before that would not reach it)."""
        ready: dict[int, WorkerReady] = {}
        subscribed = 0
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        while len(ready) < self.size or subscribed < self.size:
            events = dict(poller.poll(200))
            if self._pub in events and self._pub.recv()[:1] == b"\x01":
                subscribed += 1
            if self._pull in events:
                msg = self._handle(pickle.loads(self._pull.recv()))
                if isinstance(msg, WorkerReady):
                    ready[msg.rank] = msg
            self._check_procs()
            if time.monotonic() > deadline:
                raise EngineError("tensor-parallel ranks did not finish loading their shards")
        return [ready[r] for r in range(self.size)]

    def start_cache(
        self,
        num_blocks: int,
        swap: bool,
        store_names: tuple[str, str] | None = None,
    ) -> None:
        """Every rank allocates ``num_blocks`` KV blocks (and a host swap when ``swap``,
        and moves blocks to and from a KV store when ``store_names`` — the stored blocks'
        model fingerprint and KV dtype, see ``block_format``); returns when all have."""
        self._store_names = store_names
        self._send(InitCache(num_blocks, swap, store_names is not None))
        parts: dict[int, tuple] = {}
        digests: dict[int, str | None] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(parts) < self.size:
            msg = self._recv(deadline, "allocating their KV caches")
            if isinstance(msg, CacheReady):
                parts[msg.rank] = msg.parts
                digests[msg.rank] = msg.digest
        self._parts = [parts[r] for r in range(self.size)]
        ranks = [digests[r] for r in range(self.size)]
        self._digest = None if all(d is None for d in ranks) else "/".join(map(str, ranks))

    # ---- the KV store -----------------------------------------------------------------
    def block_format(self) -> serde.BlockFormat:
        """How a stored block looks under this tensor-parallel size: per layer the parts
        of every rank (the payload is the ranks' shards in rank order); the KV dtype names
        the size, so a block stored at another size is a clean miss."""
        assert self._store_names is not None, "block_format() without a KV store"
        model_fingerprint, kv_dtype = self._store_names
        parts = tuple(p for rank_parts in self._parts for p in rank_parts)
        return serde.BlockFormat(
            model_fingerprint,
            f"{kv_dtype}/tp{self.size}",
            self.kv_spec.block_size,
            self.kv_spec.num_layers,
            parts,
            scales_digest=self._digest,
        )

    def save_blocks(self, saves: list[KVSave], store: TieredStore) -> int:
        """Collect every rank's shard of ``saves``' blocks, serialize, store (one batch);
        returns their count."""
        if not saves:
            return 0
        self._send(SaveBlocks([s.pages for s in saves]))
        rows: dict[int, torch.Tensor] = {}
        deadline = time.monotonic() + self._timeout + _MARGIN_S
        while len(rows) < self.size:
            msg = self._recv(deadline, "sending blocks to the KV store")
            if isinstance(msg, SavedRows):
                rows[msg.rank] = msg.rows
        whole = torch.cat([rows[r] for r in range(self.size)], dim=1)
        fmt = self.block_format()
        store.put(
            [(s.key, serde.encode(fmt, s.key, whole[j], s.tokens)) for j, s in enumerate(saves)]
        )
        return len(saves)

    # ---- steps ------------------------------------------------------------------------
    def step(self, out: SchedulerOutput) -> StepResult | None:
        """Execute ``out``'s copies and batch on every rank; rank 0's result (None when
        it schedules no tokens). Raises ``EngineError`` when a rank failed."""
        assert self._parts, "start_cache() first"
        self._send(out)
        deadline = time.monotonic() + self._timeout + _MARGIN_S
        while True:
            msg = self._recv(deadline, "answering a step")
            if isinstance(msg, StepDone):
                self._held = msg.swap_held
                self._copies = msg.request_copies
                self.comm_seconds = msg.comm_seconds
                return msg.result

    def swap_held(self) -> set[str]:
        """Request ids whose KV rank 0 held host copies of after the last step."""
        return set(self._held)

    def request_copies(self) -> int:
        """How many requests rank 0 kept a copy of after the last step."""
        return self._copies

    def check_health(self) -> None:
        """Raise ``EngineError`` when a local rank's process has exited or a rank reported
        a failure (cheap: called by the engine core while idle)."""
        self._check_procs()
        while self._pull.poll(0):
            self._handle(pickle.loads(self._pull.recv()))

    def _send(self, msg: Any) -> None:
        self._pub.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def _recv(self, deadline: float, what: str) -> Any:
        """The next answer from any rank; raises ``EngineError`` for a failure, a dead
        local rank or the deadline."""
        while True:
            if self._pull.poll(200):
                return self._handle(pickle.loads(self._pull.recv()))
            self._check_procs()
            if time.monotonic() > deadline:
                raise EngineError(f"tensor-parallel ranks did not finish {what} in time")

    @staticmethod
    def _handle(msg: Any) -> Any:
        if isinstance(msg, WorkerFailed):
            raise EngineError(f"tensor-parallel rank {msg.rank} failed:\n{msg.error}")
        return msg

    def _check_procs(self) -> None:
        first = self.config.node_rank * self.config.ranks_per_node
        for i, proc in enumerate(self.procs):
            if proc.poll() is not None:
                raise EngineError(
                    f"tensor-parallel rank {first + i} (pid {proc.pid}) exited with code "
                    f"{proc.returncode}"
                )

    def close(self) -> None:
        """Stop the ranks (idempotent); SIGKILL for any still running after 10 s."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._send(Shutdown())
        deadline = time.monotonic() + 10.0
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5.0)
        self._unlink_shm()
        self._pub.close(0)
        self._pull.close(0)
        self._ctx.term()


def run_headless(config: ParallelConfig) -> int:
    """A node other than 0: run its ranks until they exit; the worst exit code."""
    assert config.distributed_init_method is not None  # ParallelConfig checks it
    host, port = host_port(config.distributed_init_method)
    procs = start_ranks(config, host, port)
    logger.info("node %d: started %d ranks", config.node_rank, len(procs))
    try:
        return max(proc.wait() for proc in procs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
