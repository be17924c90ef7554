"""A real small filesystem for disk-full tests: a tmpfs of a given size, mounted for the
duration of a ``with`` (the tests run as root, as CI does; a failed mount fails the test)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """``path`` as the mount point of a ``size`` tmpfs (``256k``); unmounted on exit."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)
