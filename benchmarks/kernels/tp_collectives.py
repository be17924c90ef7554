"""All-reduce latency between two local ranks: gloo over loopback vs kvserve's
shared-memory collective (``csrc/shm_comm.cpp``), at the sizes a SmolLM2 step moves
(hidden 576, bf16: 8 and 32 decode rows, a 2048-token prefill chunk).

Each rank is its own process pinned to one core, as the tensor-parallel workers are.

    python benchmarks/kernels/tp_collectives.py
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

ROWS = (8, 32, 2048)
HIDDEN = 576


def rank_main(rank: int, port: int, shm_path: str, capacity: int) -> None:
    import torch
    import torch.distributed as dist

    from kvserve.model.cpu_kernels import load_cpu_kernels
    from kvserve.model.shm import ShmChannel

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    torch.set_num_threads(1)
    assert load_cpu_kernels()
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    shm = ShmChannel.open(shm_path, rank, 2, capacity, 30.0)
    out = {}
    for rows in ROWS:
        x = torch.randn(rows, HIDDEN).to(torch.bfloat16)
        n = 2000 if rows < 100 else 200
        for name, fn in (("gloo", dist.all_reduce), ("shm", shm.all_reduce)):
            for _ in range(n // 10):
                fn(x)
            dist.barrier()
            t = time.perf_counter()
            for _ in range(n):
                fn(x)
            out[f"{name}_{rows}x{HIDDEN}_us"] = 1e6 * (time.perf_counter() - t) / n
    if rank == 0:
        print(json.dumps(out))
    dist.destroy_process_group()


def main() -> None:
    if len(sys.argv) > 1:
        rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
        return
    from kvserve.model import shm
    from kvserve.model.cpu_kernels import load_cpu_kernels

    assert load_cpu_kernels()  # built once here, not by both ranks at once
    capacity = shm.capacity_for(2048, HIDDEN)
    path = shm.create(2, capacity)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, str(r), str(port), path, str(capacity)],
                stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                text=True,
            )
            for r in range(2)
        ]
        result = json.loads(procs[0].communicate(timeout=600)[0].strip().splitlines()[-1])
        procs[1].wait(60)
    finally:
        os.unlink(path)
    for rows in ROWS:
        g, m = result[f"gloo_{rows}x{HIDDEN}_us"], result[f"shm_{rows}x{HIDDEN}_us"]
        print(f"{rows:>5} x {HIDDEN} bf16: gloo {g:8.1f} us   shm {m:7.1f} us   {g / m:6.1f}x")


if __name__ == "__main__":
    main()
