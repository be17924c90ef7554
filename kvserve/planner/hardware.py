"""Accelerator memory table for the planner (vendor-published capacities)."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3
GB = 10**9


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_bytes: int


_TABLE = [
    Accelerator("A100-40GB", 40 * GIB),
    Accelerator("A100-80GB", 80 * GIB),
    Accelerator("H100-80GB", 80 * GIB),
    Accelerator("H200-141GB", 141 * GB),
    Accelerator("L40S-48GB", 48 * GIB),
    Accelerator("L4-24GB", 24 * GIB),
    Accelerator("A10-24GB", 24 * GIB),
    Accelerator("RTX4090-24GB", 24 * GIB),
    Accelerator("MI300X-192GB", 192 * GIB),
]
ACCELERATORS = {a.name.lower(): a for a in _TABLE}


def find_accelerator(name: str) -> Accelerator:
    """Look a GPU up by name, case-insensitively (``h100-80gb``); ValueError lists choices."""
    try:
        return ACCELERATORS[name.lower()]
    except KeyError:
        choices = ", ".join(a.name for a in _TABLE)
        raise ValueError(f"unknown GPU {name!r}; known: {choices} (or pass --gpu-memory)") from None
