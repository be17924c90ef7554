"""C++ CPU kernels, compiled on first use with the local compiler and cached by torch.

``load_cpu_kernels()`` returns True when ``torch.ops.kvserve`` has the paged attention
(decode and prefill rows), the fused element-wise ops (RMSNorm, add+RMSNorm, SiLU-and-mul,
RoPE), the quantized KV writes, the bf16 GEMM of the linear layers, the decoder stack in one
call and the shared-memory collectives of local tensor-parallel ranks. A machine without a
working compiler/ninja gets False (and a logged reason); callers then fall back to the
portable PyTorch path.

The build is cached under torch's extension directory (``TORCH_EXTENSIONS_DIR``) with a
name keyed by a hash of the sources (``csrc/*.cpp`` and ``*.h``), the torch version, the
Python version and the compiler flags: two checkouts or venvs on one host never rebuild
each other's kernels, and a changed source never loads a stale ``.so``. torch builds under
a lock file in that directory, so two processes starting at once build it once.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
_SOURCES = [
    CSRC / n
    for n in (
        "paged_attention.cpp",
        "paged_attention_tiles.cpp",
        "paged_attention_amx.cpp",
        "fused_ops.cpp",
        "kv_quant.cpp",
        "shm_comm.cpp",
        "bf16_gemm.cpp",
        "bf16_gemm_amx.cpp",
        "decoder_stack.cpp",
    )
]
# -ffast-math but no reassociation: batch invariance rests on it. One source compiled for
# two element types (an 8-bit decode row reads codes in place, a prefill row reads them
# converted to bf16) must give the same bits, and with reassociation GCC ordered the two
# differently (test_kv_tiles_8bit's @example).
_CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-associative-math", "-fopenmp")
_LDFLAGS = ("-fopenmp",)
_OPS = (
    "paged_attention", "rms_norm", "add_rms_norm", "silu_and_mul", "rope",
    "shm_all_reduce", "shm_gather", "quantize_kv", "write_kv", "bf16_linear",
    "bf16_linear_silu_mul", "argmax_rows", "decoder_stack",
)  # fmt: skip


def build_name() -> str:
    """The extension's cache name: ``kvserve_cpu_kernels_<12 hex digits>``."""
    h = hashlib.sha256()
    for path in sorted(CSRC.glob("*")):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(f"{torch.__version__}|{sys.version_info[:2]}|{_CFLAGS}|{_LDFLAGS}".encode())
    return f"kvserve_cpu_kernels_{h.hexdigest()[:12]}"


def _build_dir(name: str) -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


@functools.cache
def load_cpu_kernels() -> bool:
    """Build (first time, ~40 s on 2 cores) and load the kernels; True on success.

    Logs one line before a build so a first start does not look hung. Thread-unsafe
    (call it from one thread; processes are safe).
    """
    try:
        name = build_name()
        built = (_build_dir(name) / f"{name}.so").is_file()
        if not built:
            logger.warning(
                "building the CPU kernels into %s (first start with these sources only, "
                "~40 s on 2 cores)",
                _build_dir(name),
            )
        start = time.monotonic()
        done = threading.Event()
        if not built:  # progress: a line every 10 s while the compiler runs
            threading.Thread(target=_report, args=(done, start), daemon=True).start()
        try:
            _load(name)
        finally:
            done.set()
        if not built:
            logger.warning("built the CPU kernels in %.0f s", time.monotonic() - start)
        return all(hasattr(torch.ops.kvserve, op) for op in _OPS)
    except Exception as e:
        logger.warning("CPU attention kernel unavailable (%s); using the PyTorch path", e)
        return False


def kernels_loaded() -> bool:
    """True when ``load_cpu_kernels()`` already ran in this process and succeeded. Never
    builds or loads anything (for code that only uses the kernels where they are in use)."""
    return load_cpu_kernels.cache_info().currsize > 0 and load_cpu_kernels()


def _report(done: threading.Event, start: float) -> None:
    while not done.wait(10.0):
        logger.warning("still building the CPU kernels (%.0f s)", time.monotonic() - start)


def _load(name: str) -> None:
    from torch.utils.cpp_extension import load

    load(
        name=name,
        sources=[str(s) for s in _SOURCES],
        extra_cflags=list(_CFLAGS),  # copies: torch appends its own flags to these
        extra_ldflags=list(_LDFLAGS),
        extra_include_paths=[str(CSRC)],
        is_python_module=False,
        verbose=os.environ.get("KVSERVE_VERBOSE_BUILD") == "1",
    )
