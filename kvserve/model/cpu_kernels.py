"""C++ CPU kernels, compiled on first use with the local compiler and cached by torch.

``load_cpu_kernels()`` returns True when ``torch.ops.kvserve`` has the paged decode
attention and the fused element-wise ops (RMSNorm, add+RMSNorm, SiLU-and-mul, RoPE).
A machine without a working compiler/ninja gets False (and a logged reason); callers then
fall back to the portable PyTorch path.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
_SOURCES = [Path(__file__).parent / "csrc" / n for n in ("paged_decode.cpp", "fused_ops.cpp")]


@functools.cache
def load_cpu_kernels() -> bool:
    """Build (first time, ~10 s) and load the kernels; True on success. Thread-unsafe."""
    try:
        from torch.utils.cpp_extension import load

        load(
            name="kvserve_cpu_kernels",
            sources=[str(s) for s in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
        return all(
            hasattr(torch.ops.kvserve, op)
            for op in ("paged_decode", "rms_norm", "add_rms_norm", "silu_and_mul", "rope")
        )
    except Exception as e:
        logger.warning("CPU attention kernel unavailable (%s); using the PyTorch path", e)
        return False
