"""The shared-memory collectives of local tensor-parallel ranks (``csrc/shm_comm.cpp``):
every rank gets the same bits, equal to the float32 sum in rank order rounded once, for
tensors smaller and larger than the segment (several rounds); a gather returns every
rank's tensor on rank 0; a rank whose peer never arrives fails within its timeout."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvserve.model import shm
from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.shm import ShmChannel

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from shm_peer import inputs  # noqa: E402 - the peer script's deterministic inputs


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_and_gather_across_processes(tmp_path, world):
    assert load_cpu_kernels()  # built once here, not concurrently in every peer
    capacity = 4096
    path = shm.create(world, capacity)
    try:
        peer = [sys.executable, str(HERE / "shm_peer.py"), path]
        procs = [
            subprocess.Popen([*peer, str(r), str(world), str(capacity), str(tmp_path / f"{r}.pt")])
            for r in range(world)
        ]
        assert [p.wait(120) for p in procs] == [0] * world
    finally:
        Path(path).unlink()
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    parts = [inputs(r) for r in range(world)]
    for i, xs in enumerate(zip(*parts, strict=True)):
        want = sum(x.float() for x in xs).to(xs[0].dtype)
        for res in results:
            got = res["reduced"][i]
            assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)), i
        assert torch.equal(results[0]["gathered"][i], torch.stack(list(xs)))
        assert all(res["gathered"][i] is None for res in results[1:])
    assert len({res["rounds"] for res in results}) == 1  # ranks stayed in step


def test_a_missing_peer_times_out(tmp_path):
    assert load_cpu_kernels()
    path = shm.create(2, 4096)
    try:
        ch = ShmChannel.open(path, 0, 2, 4096, timeout=0.5)
        t = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 did not arrive within 0\.5 s"):
            ch.all_reduce(torch.ones(4))
        assert time.monotonic() - t < 5
    finally:
        Path(path).unlink()
