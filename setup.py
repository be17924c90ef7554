"""Compiles kvserve's C++ CPU kernels at install: ``pip install -e .`` puts the library in
``kvserve/model/_kernels/`` (git-ignored), a wheel (``pip wheel .``) carries it there.

torch is deliberately not a build requirement (an unpinned one pulls a multi-GB CUDA build,
a pinned one ties every user to one build), so pip's isolated build environment has no
torch. The kernels are compiled against the torch of the environment being installed into
instead: ``build_ext`` runs ``kvserve/model/kernel_build.py`` in a subprocess of the
interpreter pip installs into (the backend's ``sys.executable``; ``KVSERVE_BUILD_PYTHON``
names another) with pip's isolation undone. pip isolates the backend only through the
environment: ``PYTHONPATH`` set to a directory whose ``sitecustomize.py`` drops the
interpreter's site-packages and adds the build requirements', and ``PYTHONNOUSERSITE=1``.
Where ``PYTHONPATH`` holds that directory (it replaced the user's), both are removed;
otherwise the environment is left as it is (``--no-build-isolation``). ``PATH`` keeps the
build requirements' scripts first, so the ``ninja`` of ``[build-system]`` runs the build.

This is sound because the library's name hashes what it was compiled against (torch and
Python versions, sources, flags, CPU features) and the runtime loads only the name it
computes itself: whatever torch the subprocess found, a mismatch is never loaded, it only
costs a compile at first start. No torch, or a failed compile, is one line (``pip -v``
shows it), ``_kernels/install-build.txt`` for the runtime's log, and a successful install.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
SCRIPT = ROOT / "kvserve" / "model" / "kernel_build.py"
KERNELS = Path("kvserve", "model", "_kernels")
NOTE = "install-build.txt"  # kvserve.model.cpu_kernels.INSTALL_NOTE


class BinaryDistribution(Distribution):
    """A distribution with a native library: build_ext runs, wheels are platform-tagged."""

    def has_ext_modules(self) -> bool:
        return True


class BuildKernels(build_ext):
    """``build_ext`` that compiles the CPU kernels (see the module docstring)."""

    def run(self) -> None:
        dest = ROOT / KERNELS if self.inplace else Path(self.build_lib) / KERNELS
        dest.mkdir(parents=True, exist_ok=True)
        (dest / NOTE).unlink(missing_ok=True)
        python = os.environ.get("KVSERVE_BUILD_PYTHON") or sys.executable
        cmd = [python, "-P", str(SCRIPT), "--dest", str(dest)]
        proc = subprocess.run(cmd, env=target_env(), stdout=subprocess.PIPE, text=True)
        sys.stdout.write(proc.stdout)  # the compiler's lines under KVSERVE_VERBOSE_BUILD=1
        if proc.returncode == 0:
            self._outputs = [proc.stdout.strip().splitlines()[-1]]
            return
        if proc.returncode == 2:
            note = f"no torch in {python} at install: install torch first, then kvserve"
        else:
            note = f"compiling at install failed under {python}: `pip install -v` shows why"
        (dest / NOTE).write_text(note + "\n")
        print(f"kvserve: CPU kernels not compiled ({note}); first start compiles them", flush=True)
        self._outputs = [str(dest / NOTE)]

    def get_outputs(self) -> list[str]:
        return list(getattr(self, "_outputs", []))

    def get_output_mapping(self) -> dict[str, str]:
        return {}


def target_env() -> dict[str, str]:
    """``os.environ`` with pip's build isolation undone (see the module docstring)."""
    env = dict(os.environ)
    entries = [Path(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if any((p / "sitecustomize.py").is_file() and (p.parent / "overlay").is_dir() for p in entries):
        env.pop("PYTHONPATH")
        env.pop("PYTHONNOUSERSITE", None)
    return env


setup(distclass=BinaryDistribution, cmdclass={"build_ext": BuildKernels})
