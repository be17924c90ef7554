"""The GPU memory plan's arithmetic (worked cases) and the profiling forward pass, which
must run through every attention backend (it once built metadata only the SDPA path
reads: the Triton backend would have failed at the first CUDA start)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_engine

from kvserve.errors import EngineError
from kvserve.worker.gpu_memory import plan_kv_memory, profile_forward

GiB = 1024**3
MiB = 1024**2


def test_an_80_gib_gpu_with_an_8b_model():
    """H100 80 GiB at 0.9: 72 GiB, less 16 GiB of bf16 weights, 3 GiB of activations,
    0.5 GiB of graphs and 0.5 GiB of CUDA context leaves 52 GiB of KV."""
    plan = plan_kv_memory(80 * GiB, 0.9, 16 * GiB, 3 * GiB, GiB // 2, GiB // 2)
    assert plan.kv == 52 * GiB
    table = plan.table()
    assert "= KV cache" in table and "52.00 GiB" in table and "× utilization 0.9" in table


def test_no_room_is_refused_with_the_table():
    with pytest.raises(EngineError, match=r"no GPU memory left(.|\n)*− weights"):
        plan_kv_memory(24 * GiB, 0.5, 14 * GiB, GiB, 0, 300 * MiB)
    with pytest.raises(EngineError, match="gpu_memory_utilization"):
        plan_kv_memory(24 * GiB, 1.5, GiB, GiB, 0, 0)


@pytest.mark.parametrize("backend", ["triton", "cpu", "torch"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_profiling_pass_runs_through_every_backend(model_dirs, backend, arch):
    if backend == "cpu" and torch.cuda.is_available():
        backend = "torch"  # the C++ kernels are CPU-only
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    engine = make_engine(model_dirs[arch], device=dev, dtype="float32", attention_backend=backend)
    profile_forward(engine.runner.model, engine.kv_spec, engine.kv_format, 50, torch.device(dev))
