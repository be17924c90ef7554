"""tcmalloc for the processes that run the model on a CPU, without the user asking.

A CPU step allocates and frees multi-MB activations in every layer; glibc's malloc hands
much of that back to the kernel and faults it in again, and its arenas contend between the
OpenMP threads. vLLM's CPU guide tells users to preload tcmalloc (``LD_PRELOAD``) for that
reason; kvserve does it for them where a process is started for the purpose:

- ``kvserve serve`` spawns the engine core with tcmalloc in its ``LD_PRELOAD`` when the
  device is a CPU and a tcmalloc is installed (``preloaded_for_children``); the
  tensor-parallel ranks the core starts inherit it. The API server itself keeps glibc.
- The offline ``LLM`` runs the engine in the caller's process, where an allocator can no
  longer be swapped in: ``hint_in_process`` logs once how to preload it.

``KVSERVE_TCMALLOC`` chooses: unset or ``1`` finds one (the minimal build first), ``0`` never
preloads (and no hint is logged), a path preloads that library and is refused at start
(``ValueError``) when it is not a file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

ENV = "KVSERVE_TCMALLOC"
_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
)
_NAMES = (
    "libtcmalloc_minimal.so.4",
    "libtcmalloc_minimal.so",
    "libtcmalloc.so.4",
    "libtcmalloc.so",
)
# tcmalloc prints a stack for every allocation above 1 GiB unless told otherwise: a KV cache
# is one such allocation, and the line reads like an error
_REPORT_ENV = "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"
_REPORT_BYTES = str(1 << 40)
_hinted = False


def find_tcmalloc() -> str | None:
    """Path of an installed tcmalloc shared library (the minimal build first, then the
    full one; system directories, then this Python's prefix), or None."""
    dirs = (*_DIRS, os.path.join(sys.prefix, "lib"))
    for name in _NAMES:
        for d in dirs:
            path = os.path.join(d, name)
            if os.path.isfile(path):
                return path
    return None


@dataclass(frozen=True)
class TcmallocChoice:
    """What ``KVSERVE_TCMALLOC`` asks for: the library to preload (None: none) and, when
    there is none, whether the user turned it off (then nothing is logged about it)."""

    library: str | None
    disabled: bool = False


def choose(setting: str | None) -> TcmallocChoice:
    """Read a ``KVSERVE_TCMALLOC`` value (None when unset). Raises ``ValueError`` for a
    value that is neither 0, 1 nor the path of a file."""
    value = (setting or "").strip()
    if value == "0":
        return TcmallocChoice(None, disabled=True)
    if value in ("", "1"):
        return TcmallocChoice(find_tcmalloc())
    if not Path(value).is_file():
        raise ValueError(
            f"{ENV}={value!r}: not a file; set it to 0 (no tcmalloc), 1 (find one) or the "
            "path of a tcmalloc shared library"
        )
    return TcmallocChoice(value)


def loaded(pid: int | str = "self") -> bool:
    """True when process ``pid`` (default: this one) has a tcmalloc mapped (Linux; False
    where /proc cannot tell)."""
    try:
        return "tcmalloc" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def preload_value(current: str | None, library: str) -> str:
    """``LD_PRELOAD`` with ``library`` first; ``current`` as it is when it already names a
    tcmalloc (the user's own choice wins)."""
    if current and "tcmalloc" in current:
        return current
    return f"{library}:{current}" if current else library


@contextlib.contextmanager
def preloaded_for_children(device_type: str) -> Iterator[str | None]:
    """While open, processes started from this one (multiprocessing spawn, exec) preload
    tcmalloc: ``LD_PRELOAD`` (and tcmalloc's large-allocation report threshold, unless
    set) in ``os.environ`` for the duration, both restored on exit. Yields the library,
    or None when nothing was changed: not a CPU device, ``KVSERVE_TCMALLOC=0``, none
    installed, or ``LD_PRELOAD`` already names one. Raises ``ValueError`` for a bad
    ``KVSERVE_TCMALLOC`` (``choose``)."""
    choice = choose(os.environ.get(ENV))
    current = os.environ.get("LD_PRELOAD")
    if device_type != "cpu" or choice.library is None or (current and "tcmalloc" in current):
        yield None
        return
    saved = {k: os.environ.get(k) for k in ("LD_PRELOAD", _REPORT_ENV)}
    os.environ["LD_PRELOAD"] = preload_value(current, choice.library)
    os.environ.setdefault(_REPORT_ENV, _REPORT_BYTES)
    try:
        yield choice.library
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def hint_in_process(device_type: str) -> None:
    """Log once per process (info: it is worth a few percent) how to get tcmalloc when
    this process runs a CPU engine without one (nothing when it has one, or
    ``KVSERVE_TCMALLOC=0``)."""
    global _hinted
    if _hinted or device_type != "cpu" or loaded():
        return
    try:
        choice = choose(os.environ.get(ENV))
    except ValueError:
        return  # refused where the value is used (the server's start)
    if choice.disabled:
        return
    _hinted = True
    if choice.library is None:
        logger.info(
            "no tcmalloc installed: CPU steps run on glibc's malloc; install it "
            "(Debian/Ubuntu: apt-get install libtcmalloc-minimal4) for faster steps"
        )
    else:
        logger.info(
            "this process runs the engine on the CPU with glibc's malloc; start it with "
            "LD_PRELOAD=%s for faster steps (kvserve serve does this for its engine core)",
            choice.library,
        )
