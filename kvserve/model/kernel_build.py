"""Compiling kvserve's C++ CPU kernels: the one build that install and first start share.

Contract:

1. ``build_name()`` names a build by everything that decides its bits and where it may
   run: the sources (``csrc/*.cpp`` and ``*.h``, by content, never by path), the torch
   version, the Python version, the compiler flags and the CPU's feature flags (the code is
   ``-march=native``: a library built on another CPU is never loaded here, where it could
   die of SIGILL). Two checkouts or venvs with the same inputs share a name; a different
   input never loads another's ``.so``.
2. ``compile_kernels(dest)`` copies the sources into a fresh work directory inside
   ``dest``, names the build from that copy (an edit during the build cannot mislabel
   it), compiles there with torch's ``cpp_extension`` (no argument names the checkout, and
   torch's lock file is private to the work directory), loads the library into this
   process (the check that it links; at most once per process: ops register once) and
   renames ``<name>.so`` into ``dest`` atomically. ``dest`` holds a complete library or
   none, whatever kills the build; the work directory is removed unless the process dies.
3. This module imports only the standard library (torch when it builds), so it also runs
   as a script before kvserve's dependencies are installed: setup.py's build_ext runs
   ``python -P kernel_build.py --dest DIR`` with the interpreter being installed into.
   It compiles nothing where ``DIR`` already holds this build's name. Exit status 0: built
   or up to date (the path is stdout's last line); 2: no torch in this interpreter; 1: the
   build failed (the compiler's output is on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import os
import platform
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
PREFIX = "kvserve_cpu_kernels_"
SOURCES = (
    "paged_attention.cpp",
    "paged_attention_tiles.cpp",
    "paged_attention_amx.cpp",
    "fused_ops.cpp",
    "kv_quant.cpp",
    "shm_comm.cpp",
    "bf16_gemm.cpp",
    "bf16_gemm_amx.cpp",
    "decoder_stack.cpp",
    "gguf_gemm.cpp",
    "gguf_amx.cpp",
    "moe_experts.cpp",
    "gemma_ops.cpp",
    "gemma_stack.cpp",
)
# -ffast-math but no reassociation: batch invariance rests on it. One source compiled for
# two element types (an 8-bit decode row reads codes in place, a prefill row reads them
# converted to bf16) must give the same bits, and with reassociation GCC ordered the two
# differently (test_kv_tiles_8bit's @example).
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-associative-math", "-fopenmp")
LDFLAGS = ("-fopenmp",)


@functools.cache
def cpu_features() -> str:
    """This CPU's feature flags, sorted (``/proc/cpuinfo``'s first ``flags`` or ``Features``
    line), or the machine's architecture where there is no such line. A different line (a
    VM exposing fewer features, a kernel that lists a new flag) means a rebuild, never a
    library that does not run here."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return " ".join(sorted(set(value.split())))
    return platform.machine()


def build_name(csrc: Path | None = None) -> str:
    """The build's name, ``kvserve_cpu_kernels_<12 hex digits>`` (see contract 1)."""
    import torch

    h = hashlib.sha256()
    for path in sorted((csrc or CSRC).iterdir()):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    flags = f"{torch.__version__}|{sys.version_info[:2]}|{CFLAGS}|{LDFLAGS}|{cpu_features()}"
    h.update(flags.encode())
    return f"{PREFIX}{h.hexdigest()[:12]}"


def work_prefix(host: str, pid: int) -> str:
    """How the names of the work directories of process ``pid`` on ``host`` begin."""
    return f".build-{host}-{pid}-"


def compile_kernels(dest: Path, verbose: bool = False) -> Path:
    """Build the kernels into ``dest / <name>.so`` and load them (contract 2); the path."""
    from torch.utils.cpp_extension import load

    dest.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=work_prefix(socket.gethostname(), os.getpid()), dir=dest))
    try:
        src = work / "src"
        src.mkdir()
        for path in CSRC.iterdir():
            if path.suffix in (".cpp", ".h"):
                shutil.copyfile(path, src / path.name)
        name = build_name(src)
        built = load(
            name=name,
            sources=[str(src / s) for s in SOURCES],
            extra_cflags=list(CFLAGS),  # copies: torch appends its own flags to these
            extra_ldflags=list(LDFLAGS),
            extra_include_paths=[str(src)],
            build_directory=str(work),
            is_python_module=False,
            verbose=verbose,
        )
        final = dest / f"{name}.so"
        os.replace(built, final)
        return final
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Install-time entry point (contract 3)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dest", type=Path, required=True, help="where <name>.so goes")
    args = p.parse_args(argv)
    try:
        import torch
    except ImportError as e:
        print(f"kvserve: no torch in {sys.executable} ({e})", file=sys.stderr)
        return 2
    say = functools.partial(print, file=sys.stderr, flush=True)
    built = args.dest / f"{build_name()}.so"
    if built.is_file():  # a reinstall with nothing changed: the same inputs, the same library
        say(f"kvserve: the CPU kernels are up to date: {built}")
        print(built)
        return 0
    say(
        f"kvserve: compiling the CPU kernels for torch {torch.__version__} "
        f"({torch.__file__}) into {args.dest}; about 1-3 minutes"
    )
    start = time.monotonic()
    still = lambda s: say(f"kvserve: still compiling the CPU kernels ({s:.0f} s)")  # noqa: E731
    try:
        with progress(still, every=30.0):
            path = compile_kernels(args.dest, os.environ.get("KVSERVE_VERBOSE_BUILD") == "1")
    except Exception as e:
        say(f"kvserve: compiling the CPU kernels failed: {e}")
        return 1
    for old in args.dest.glob(f"{PREFIX}*.so"):  # earlier installs' sources
        if old != path:
            old.unlink(missing_ok=True)
    say(f"kvserve: compiled the CPU kernels in {time.monotonic() - start:.0f} s")
    print(path)
    return 0


@contextlib.contextmanager
def progress(report: Callable[[float], None], every: float) -> Iterator[None]:
    """Call ``report(seconds so far)`` every ``every`` seconds from a daemon thread until
    the block ends (a long compile that says nothing looks hung)."""
    start, done = time.monotonic(), threading.Event()

    def loop() -> None:
        while not done.wait(every):
            report(time.monotonic() - start)

    threading.Thread(target=loop, daemon=True).start()
    try:
        yield
    finally:
        done.set()


if __name__ == "__main__":
    sys.exit(main())
