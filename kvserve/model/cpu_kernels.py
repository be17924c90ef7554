"""C++ CPU kernels: compiled at install, loaded at start; compiled at first start otherwise.

``load_cpu_kernels()`` returns True when ``torch.ops.kvserve`` has the paged attention
(decode and prefill rows), the fused element-wise ops (RMSNorm, add+RMSNorm, SiLU-and-mul,
RoPE), the quantized KV writes, the bf16 GEMM of the linear layers, the decoder stack in one
call and the shared-memory collectives of local tensor-parallel ranks. It loads, in order:

1. the library ``pip install`` compiled (setup.py), ``_kernels/<build_name()>.so`` beside
   this module, unless ``KVSERVE_PREBUILT_KERNELS=0``;
2. one compiled at an earlier start, ``<cache>/<build_name()>.so``, where ``<cache>`` is
   ``$TORCH_EXTENSIONS_DIR/kvserve`` (torch's default: ``~/.cache/torch_extensions``);
3. else it compiles one into ``<cache>`` (``kernel_build.compile_kernels``: a private work
   directory, renamed into place whole) under ``<cache>/<name>.lock`` (``build_lock``): one
   process builds, the others wait for it and load its library; a lock left by a killed
   build is broken; a wait longer than ``KVSERVE_KERNEL_BUILD_TIMEOUT`` seconds (900) ends
   with an error naming the lock file.

The name (``kernel_build.build_name``) hashes the sources, torch, Python, the compiler flags
and the CPU's features, never a path: two checkouts or venvs on one host share a build
when those agree and never load each other's otherwise, and a wheel compiled on another CPU
is rebuilt here, not run. A machine without a working compiler/ninja gets False (and a
logged reason); callers then fall back to the portable PyTorch path.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from kvserve.model import kernel_build
from kvserve.model.build_lock import BuildLock, LockTimeout
from kvserve.model.kernel_build import build_name

__all__ = ["build_name", "kernels_loaded", "load_cpu_kernels", "loaded_library"]
logger = logging.getLogger(__name__)
PREBUILT = Path(__file__).parent / "_kernels"
INSTALL_NOTE = "install-build.txt"  # setup.py's one line on why it built nothing
_OPS = (
    "paged_attention", "rms_norm", "add_rms_norm", "silu_and_mul", "rope",
    "shm_all_reduce", "shm_gather", "quantize_kv", "write_kv", "bf16_linear",
    "bf16_linear_silu_mul", "argmax_rows", "decoder_stack", "gguf_linear", "gemma_rms_norm",
    "gelu_tanh_and_mul", "gemma_stack",
)  # fmt: skip
_loaded: Path | None = None


def cache_dir() -> Path:
    """Where first starts compile the kernels: ``$TORCH_EXTENSIONS_DIR/kvserve``."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / "kvserve"


def prebuilt_dir() -> Path | None:
    """The install's libraries (``_kernels/``), or None under ``KVSERVE_PREBUILT_KERNELS=0``."""
    value = os.environ.get("KVSERVE_PREBUILT_KERNELS", "1")
    if value not in ("0", "1"):
        raise ValueError(f"KVSERVE_PREBUILT_KERNELS must be 0 or 1, not {value!r}")
    return PREBUILT if value == "1" else None


def build_timeout() -> float:
    """``KVSERVE_KERNEL_BUILD_TIMEOUT``: seconds to wait for another process's build."""
    value = os.environ.get("KVSERVE_KERNEL_BUILD_TIMEOUT", "900")
    try:
        timeout = float(value)
    except ValueError:
        timeout = -1.0
    if not timeout > 0:
        raise ValueError(f"KVSERVE_KERNEL_BUILD_TIMEOUT must be seconds > 0, not {value!r}")
    return timeout


@functools.cache
def load_cpu_kernels() -> bool:
    """Load (or build, then load) the kernels; True on success. Thread-unsafe (call it from
    one thread; processes are safe)."""
    global _loaded
    try:
        name = build_name()
        prebuilt = prebuilt_dir()
        path = prebuilt / f"{name}.so" if prebuilt else None
        if path is None or not path.is_file():
            path = _build_or_wait(cache_dir(), name, prebuilt)
        if path != _loaded:  # else compiled (and so loaded) by this process
            torch.ops.load_library(str(path))
        _loaded = path
        logger.debug("loaded the CPU kernels from %s", path)
        return all(hasattr(torch.ops.kvserve, op) for op in _OPS)
    except Exception as e:
        logger.warning("CPU attention kernel unavailable (%s); using the PyTorch path", e)
        return False


def kernels_loaded() -> bool:
    """True when ``load_cpu_kernels()`` already ran in this process and succeeded. Never
    builds or loads anything (for code that only uses the kernels where they are in use)."""
    return load_cpu_kernels.cache_info().currsize > 0 and load_cpu_kernels()


def loaded_library() -> Path | None:
    """The ``.so`` this process loaded the kernels from (None before or without them)."""
    return _loaded


def _build_or_wait(cache: Path, name: str, prebuilt: Path | None) -> Path:
    """``<cache>/<name>.so``, compiled here (then already loaded: ``_loaded``) or by the
    process holding the lock."""
    global _loaded
    final = cache / f"{name}.so"
    if final.is_file():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    lock = BuildLock(cache / f"{name}.lock", "the CPU kernel build")
    try:
        if not lock.acquire(build_timeout(), done=final.is_file):
            return final  # another process built it while this one waited
    except LockTimeout as e:
        raise RuntimeError(f"{e} (KVSERVE_KERNEL_BUILD_TIMEOUT sets the wait)") from None
    try:
        for owner in lock.broken:  # what killed builds left behind
            for work in cache.glob(kernel_build.work_prefix(owner.host, owner.pid) + "*"):
                shutil.rmtree(work, ignore_errors=True)
        if final.is_file():  # built between the check and the lock
            return final
        logger.warning(
            "building the CPU kernels into %s (%s; ~1-3 min on 2 cores)", cache, _why(prebuilt)
        )
        start = time.monotonic()
        verbose = os.environ.get("KVSERVE_VERBOSE_BUILD") == "1"
        with kernel_build.progress(_still_building, every=10.0):
            _loaded = kernel_build.compile_kernels(cache, verbose=verbose)
        logger.warning("built the CPU kernels in %.0f s", time.monotonic() - start)
        return _loaded
    finally:
        lock.release()


def _why(prebuilt: Path | None) -> str:
    """Why there was no library from the install, for the log line before a build."""
    if prebuilt is None:
        return "KVSERVE_PREBUILT_KERNELS=0"
    try:
        note = (prebuilt / INSTALL_NOTE).read_text().strip()
    except OSError:
        note = ""
    return note or (
        f"none in {prebuilt} matches these sources, torch, Python and CPU; `pip install -e .` "
        "compiles them at install"
    )


def _still_building(seconds: float) -> None:
    logger.warning("still building the CPU kernels (%.0f s)", seconds)
