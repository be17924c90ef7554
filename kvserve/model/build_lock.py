"""A lock file for a build, which a killed build cannot leave behind.

Contract:

1. ``BuildLock(path, what).acquire(timeout, done)`` returns True once this process holds
   ``path``: the file is created exclusively (``O_EXCL``) and holds one JSON line naming its
   owner (host, boot id, pid, the pid's start time, when it was taken). While it is held a
   heartbeat thread touches it every ``HEARTBEAT_S``. It returns False, holding nothing,
   as soon as ``done()`` is true (another process finished the work).
2. A lock whose owner is gone is broken (a warning says whose): on this host and boot,
   when its pid no longer runs or now runs another process (a different start time); on
   another boot of this host at once; from another host (or unreadable) when the file has
   not been touched for ``STALE_S`` while this process watched it (clocks are never
   compared). ``broken`` lists the owners broken. Breaking a live lock by mistake (pid
   namespaces) costs a duplicate build, never a wrong one: builds go to private work
   directories and are renamed into place whole.
3. While it waits it logs who holds the lock every ``LOG_S``; after ``timeout`` seconds it
   raises ``LockTimeout`` naming the file and its owner, and changes nothing.
4. ``release()`` stops the heartbeat and removes the file if it is still this process's.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)
HEARTBEAT_S = 10.0
STALE_S = 60.0
LOG_S = 10.0
POLL_S = 0.2


class LockTimeout(RuntimeError):
    """A lock stayed held by a live owner for longer than the caller would wait."""


@dataclass(frozen=True)
class Owner:
    host: str
    boot: str  # /proc/sys/kernel/random/boot_id, "" where there is none
    pid: int
    start: str  # the pid's start time in clock ticks since boot, "" where unknown
    since: float  # time.time() when the lock was taken

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}"


def me() -> Owner:
    """This process as a lock owner, now."""
    pid = os.getpid()
    return Owner(socket.gethostname(), _boot_id(), pid, _start_time(pid), time.time())


def running(owner: Owner) -> bool | None:
    """Whether ``owner``'s process still runs: None when that cannot be known from here
    (another host)."""
    here = me()
    if owner.host != here.host:
        return None
    if owner.boot != here.boot:
        return False  # the machine restarted since
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # runs, as another user
    return not owner.start or _start_time(owner.pid) in ("", owner.start)


class BuildLock:
    def __init__(self, path: Path, what: str) -> None:
        self.path = path
        self.what = what
        self.broken: list[Owner] = []
        self._text: str | None = None  # what this process wrote, while it holds the lock
        self._stop = threading.Event()

    def acquire(self, timeout: float, done: Callable[[], bool] = lambda: False) -> bool:
        """Contract 1-3."""
        start = time.monotonic()
        next_log = start + LOG_S
        watched: tuple[int, int] | None = None  # (inode, mtime ns) last seen...
        watched_at = start  # ...and since when
        while True:
            if done():
                return False
            if self._try_create():
                return True
            now = time.monotonic()
            try:
                st = self.path.stat()
                text = self.path.read_text()
            except FileNotFoundError:
                continue  # released meanwhile: try again at once
            owner = _parse(text)
            if (st.st_ino, st.st_mtime_ns) != watched:
                watched, watched_at = (st.st_ino, st.st_mtime_ns), now
            alive = running(owner) if owner else None
            if alive is None:
                alive = now - watched_at < STALE_S
            who = owner.describe() if owner else "an unreadable owner"
            if not alive:
                self._break(text, who)
                if owner:
                    self.broken.append(owner)
                continue
            if now - start >= timeout:
                raise LockTimeout(
                    f"gave up after {timeout:.0f} s waiting for {self.what} by {who}, which "
                    f"holds the lock file {self.path}; if no such build runs, delete that file"
                )
            if now >= next_log:
                next_log = now + LOG_S
                logger.warning(
                    "waiting for %s by %s (lock file %s, %.0f s so far, giving up at %.0f s)",
                    self.what, who, self.path, now - start, timeout,
                )  # fmt: skip
            time.sleep(POLL_S)

    def release(self) -> None:
        """Contract 4."""
        self._stop.set()
        if self._text is None:
            return
        try:
            if self.path.read_text() == self._text:
                self.path.unlink()
        except FileNotFoundError:
            pass
        self._text = None

    def _try_create(self) -> bool:
        text = json.dumps(asdict(me())) + "\n"
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
        self._text = text
        self._stop.clear()
        threading.Thread(target=self._heartbeat, daemon=True).start()
        return True

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def _break(self, text: str, who: str) -> None:
        logger.warning("breaking the stale lock file %s of %s (gone)", self.path, who)
        try:
            if self.path.read_text() == text:  # not a fresh lock taken meanwhile
                self.path.unlink()
        except FileNotFoundError:
            pass


def _parse(text: str) -> Owner | None:
    try:
        d = json.loads(text)
        return Owner(str(d["host"]), str(d["boot"]), int(d["pid"]), str(d["start"]),
                     float(d["since"]))  # fmt: skip
    except (ValueError, KeyError, TypeError):
        return None  # being written, or not ours


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rpartition(")")[2].split()[19]  # field 22, starttime
