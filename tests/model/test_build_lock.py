"""The kernel build's lock (``kvserve/model/build_lock.py``) with real processes: a lock
whose owner died, or whose pid now runs another process, is broken at once; a live owner's
is waited for until the bound, then the error names the file and the owner; a foreign
host's lock is broken only once nobody touches it; the holder's heartbeat keeps it fresh."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from kvserve.model import build_lock
from kvserve.model.build_lock import BuildLock, LockTimeout, Owner, me
from kvserve.testing.procs import wait_until


def _write(path: Path, owner: Owner) -> None:
    path.write_text(json.dumps(asdict(owner)) + "\n")


def _owner_of(proc: subprocess.Popen) -> Owner:
    return replace(me(), pid=proc.pid, start=build_lock._start_time(proc.pid))


@pytest.fixture
def sleeper():
    """A live process (it waits on its stdin until the test ends)."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)  # fmt: skip
    yield proc
    proc.kill()
    proc.wait(10)


def test_the_lock_of_a_dead_process_is_broken_at_once(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    owner = _owner_of(proc)
    assert proc.wait(30) == 0
    lock = tmp_path / "k.lock"
    _write(lock, owner)
    got = BuildLock(lock, "a build")
    t = time.monotonic()
    assert got.acquire(timeout=30)
    assert time.monotonic() - t < 5
    assert got.broken == [owner]
    assert json.loads(lock.read_text())["pid"] == me().pid
    got.release()
    assert not lock.exists()


def test_a_pid_that_now_runs_another_process_does_not_hold_the_lock(tmp_path):
    lock = tmp_path / "k.lock"
    stale = replace(me(), start="1")  # this pid, but started at another time
    _write(lock, stale)
    got = BuildLock(lock, "a build")
    assert got.acquire(timeout=30) and got.broken == [stale]
    got.release()


def test_a_live_owner_is_waited_for_until_the_bound_then_its_death_frees_the_lock(
    tmp_path, sleeper
):
    lock = tmp_path / "k.lock"
    _write(lock, _owner_of(sleeper))
    before = lock.read_text()
    t = time.monotonic()
    with pytest.raises(LockTimeout, match=rf"pid {sleeper.pid} on host .*{lock}"):
        BuildLock(lock, "a build").acquire(timeout=1.0)
    assert 1.0 <= time.monotonic() - t < 5
    assert lock.read_text() == before  # gave up, changed nothing
    sleeper.kill()
    sleeper.wait(10)
    got = BuildLock(lock, "a build")
    assert got.acquire(timeout=30) and [o.pid for o in got.broken] == [sleeper.pid]
    got.release()


def test_waiting_ends_when_the_work_is_done(tmp_path, sleeper):
    lock = tmp_path / "k.lock"
    _write(lock, _owner_of(sleeper))
    done = tmp_path / "k.so"
    # The holder "finishes" while this process waits (at its third look); nothing is
    # taken or broken.
    looks = itertools.count(1)

    def finished() -> bool:
        if next(looks) == 3:
            done.touch()
        return done.exists()

    got = BuildLock(lock, "a build")
    assert got.acquire(timeout=30, done=finished) is False
    assert next(looks) == 4 and got.broken == [] and lock.exists()


def test_a_foreign_hosts_lock_is_broken_only_once_nobody_touches_it(tmp_path, monkeypatch):
    monkeypatch.setattr(build_lock, "STALE_S", 1.0)
    lock = tmp_path / "k.lock"
    foreign = replace(me(), host="elsewhere")
    _write(lock, foreign)
    # Touched whenever the waiter looks, standing in for the other host's heartbeat: held.
    def heartbeat() -> bool:
        os.utime(lock)
        return False

    with pytest.raises(LockTimeout, match="elsewhere"):
        BuildLock(lock, "a build").acquire(timeout=2.5, done=heartbeat)
    t = time.monotonic()
    got = BuildLock(lock, "a build")
    assert got.acquire(timeout=30) and got.broken == [foreign]
    assert time.monotonic() - t < 5
    got.release()


def test_the_holder_touches_its_lock_and_releases_only_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(build_lock, "HEARTBEAT_S", 0.1)
    lock = tmp_path / "k.lock"
    got = BuildLock(lock, "a build")
    assert got.acquire(timeout=5)
    first = lock.stat().st_mtime_ns
    wait_until(lambda: lock.stat().st_mtime_ns != first, 5, "the holder's heartbeat")
    assert lock.stat().st_mtime_ns != first
    _write(lock, replace(me(), host="elsewhere"))  # someone broke it and took it
    got.release()
    assert lock.exists()  # theirs, not removed
