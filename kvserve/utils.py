"""Small helpers shared by several packages: size parsing, device choice, math."""

from __future__ import annotations

import re

import torch

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(value: str | int | float) -> int:
    """Parse a byte size such as ``4GiB``, ``512MB``, ``1.5G`` or ``1048576`` into bytes.

    ``GiB``/``Gi`` are powers of 1024; ``GB`` and a bare ``G`` are powers of 1000
    (the Kubernetes convention).
    Raises ValueError with the offending text when it cannot be parsed.
    """
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"size must be non-negative, got {value}")
        return int(value)
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(f"cannot parse size {value!r}; use e.g. 4GiB, 512MB or a byte count")
    number, unit, binary, _ = m.groups()
    base = 1024 if binary else 1000
    return int(float(number) * base ** _POWERS[unit.lower()])


def format_size(n: int | float) -> str:
    """Format bytes with binary units (``1.50 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative integers."""
    return -(-a // b)


def resolve_device(device: str) -> torch.device:
    """Turn ``auto`` into ``cuda`` when a GPU is visible, else ``cpu``; validate the rest."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return dev


_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


DTYPE_NAMES = tuple(_DTYPES)


def parse_dtype(name: str) -> torch.dtype:
    """Map a dtype name (``bfloat16``, ``float16``, ``float32`` and aliases) to torch."""
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(
            f"unsupported dtype {name!r}; choose one of float32, float16, bfloat16"
        ) from None
