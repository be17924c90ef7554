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
    """Look a GPU up by name, case-insensitively: the full name (``h100-80gb``) or, when
    only one size exists, the model alone (``L40S``, ``H100``). ValueError lists choices
    (an ambiguous model, ``A100``, names its sizes)."""
    key = name.lower()
    if key in ACCELERATORS:
        return ACCELERATORS[key]
    sizes = [a for a in _TABLE if a.name.lower().split("-")[0] == key]
    if len(sizes) == 1:
        return sizes[0]
    choices = ", ".join(a.name for a in (sizes or _TABLE))
    what = "ambiguous GPU" if sizes else "unknown GPU"
    raise ValueError(f"{what} {name!r}; choose one of: {choices} (or pass --gpu-memory)")
