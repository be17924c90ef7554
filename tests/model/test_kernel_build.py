"""Kernels built once (issue 50 item 5), with real processes and one full build shared:

- a first start compiling into an empty cache, SIGKILLed (its whole process group) while
  the compiler runs, leaves a lock and a work directory behind; the next start breaks the
  lock, builds, loads working ops within a bound, and leaves neither behind;
- a later start loads that build without compiling;
- a checkout at another path with the library an install put in its ``_kernels/`` loads
  that library, compiling nothing and touching no cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvserve
from kvserve.model import cpu_kernels as ck
from kvserve.testing.procs import wait_until

BUILD_S = 900  # one full build on 2 busy cores takes 1-3 min
START = """
import json, torch, kvserve
from kvserve.model import cpu_kernels as ck
from kvserve.model.ops import CpuKernelOps, TorchOps
ok = ck.load_cpu_kernels()
x, w = torch.randn(4, 256), torch.randn(256)
works = ok and torch.allclose(CpuKernelOps().rms_norm(x, w, 1e-5), TorchOps().rms_norm(x, w, 1e-5),
                              atol=1e-5)
print(json.dumps({"ok": ok, "works": bool(works), "library": str(ck.loaded_library()),
                  "package": kvserve.__file__}))
"""


@dataclass
class Run:
    out: dict
    log: str
    seconds: float


def _start(env: dict[str, str], cwd: Path, timeout: float = BUILD_S) -> Run:
    """A start in its own session (compilers included, which ninja puts in process groups of
    their own), from a directory that does not shadow the package; killed whole at the
    bound."""
    t = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", START], env=env, cwd=cwd,
        start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        _kill_session(proc.pid)
    assert proc.returncode == 0, err[-3000:]
    return Run(json.loads(out.splitlines()[-1]), err, time.monotonic() - t)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KVSERVE_PREBUILT_KERNELS"}
    return env | {"KVSERVE_KERNEL_BUILD_TIMEOUT": "60"} | extra


def _session(sid: int) -> dict[int, str]:
    """The live processes of session ``sid``: pid -> name."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, rest = text[text.index("(") + 1 : text.rindex(")")], text.rpartition(")")[2]
        state, _, _, session = rest.split()[:4]
        if int(session) == sid and state != "Z":
            found[int(stat.parent.name)] = name
    return found


def _kill_session(sid: int) -> None:
    def killed() -> bool:  # SIGKILL whatever is left of the session; True once none is
        pids = _session(sid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return not pids

    wait_until(killed, 30, f"session {sid} gone after SIGKILL")


@dataclass
class Recovered:
    cache: Path
    killed_pid: int
    left_behind: list[str]
    second: Run


@pytest.fixture(scope="module")
def recovered(tmp_path_factory) -> Recovered:
    """A build killed midway, then the start after it (the shared full build)."""
    root = tmp_path_factory.mktemp("ext")
    env = _env(TORCH_EXTENSIONS_DIR=str(root), KVSERVE_PREBUILT_KERNELS="0")
    cache = root / "kvserve"
    cwd = tmp_path_factory.mktemp("cwd")
    first = subprocess.Popen(
        [sys.executable, "-c", START], env=env, cwd=cwd,
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        def compiling() -> bool:
            assert first.poll() is None, "the first start ended before compiling"
            return "cc1plus" in _session(first.pid).values()

        wait_until(compiling, 120, "a compiler started by the first start")
    finally:
        _kill_session(first.pid)  # the process, ninja and the compilers
        first.wait(30)
    left_behind = sorted(p.name for p in cache.iterdir())
    return Recovered(cache, first.pid, left_behind, _start(env, cwd))


def test_a_build_killed_midway_does_not_block_the_next_start(recovered):
    name = ck.build_name()
    work = [n for n in recovered.left_behind if n.startswith(".build-")]
    assert f"{name}.lock" in recovered.left_behind and len(work) == 1  # the scenario is real
    assert f"{name}.so" not in recovered.left_behind
    second = recovered.second
    assert second.out["ok"] and second.out["works"]
    assert second.out["library"] == str(recovered.cache / f"{name}.so")
    assert f"breaking the stale lock file {recovered.cache / name}.lock" in second.log
    assert f"pid {recovered.killed_pid} on host" in second.log
    assert sorted(p.name for p in recovered.cache.iterdir()) == [f"{name}.so"]


def test_a_later_start_loads_the_build_without_compiling(recovered, tmp_path):
    env = _env(TORCH_EXTENSIONS_DIR=str(recovered.cache.parent), KVSERVE_PREBUILT_KERNELS="0")
    later = _start(env, tmp_path, timeout=120)
    assert later.out["ok"] and later.out["works"]
    assert later.out["library"] == str(recovered.cache / f"{ck.build_name()}.so")
    assert "building the CPU kernels" not in later.log


def test_a_checkout_elsewhere_loads_its_installed_library_without_compiling(
    recovered, tmp_path
):
    name = ck.build_name()
    checkout = tmp_path / "elsewhere"
    shutil.copytree(
        Path(kvserve.__file__).parent, checkout / "kvserve",
        ignore=shutil.ignore_patterns("__pycache__", "_kernels"),
    )  # fmt: skip
    installed = checkout / "kvserve" / "model" / "_kernels" / f"{name}.so"
    installed.parent.mkdir()
    shutil.copyfile(recovered.cache / f"{name}.so", installed)
    empty = tmp_path / "ext"
    env = _env(TORCH_EXTENSIONS_DIR=str(empty), PYTHONPATH=str(checkout))
    run = _start(env, tmp_path, timeout=120)
    assert run.out["package"] == str(checkout / "kvserve" / "__init__.py")
    assert run.out["ok"] and run.out["works"] and run.out["library"] == str(installed)
    assert "building the CPU kernels" not in run.log
    assert not empty.exists()  # nothing compiled, nothing cached

