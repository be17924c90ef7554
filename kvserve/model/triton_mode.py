"""Whether Triton's interpreter is on: a leaf the Triton backend and its kernel modules
both read (the kernels when they are defined, the backend before it imports them)."""

from __future__ import annotations

import os


def interpreting() -> bool:
    """Is Triton's interpreter on (``TRITON_INTERPRET``, read as Triton reads it)?"""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
