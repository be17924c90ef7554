"""Readable side-by-side table of plans (rich)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kvserve.planner.capacity import Plan
from kvserve.utils import format_size


def print_plans(plans: list[Plan], console: Console | None = None) -> None:
    """One column per plan; rows are the quantities an operator sizes hardware with."""
    table = Table(title="kvserve capacity plan")
    table.add_column("")
    for p in plans:
        table.add_column(p.label, justify="right")
    rows = [
        ("model", lambda p: p.model),
        ("weights", lambda p: format_size(p.weight_bytes)),
        ("KV bytes / token", lambda p: f"{p.kv_bytes_per_token:,}"),
        ("tokens / request (blocks)", lambda p: f"{p.tokens_per_request:,}"),
        ("KV / request", lambda p: format_size(p.kv_bytes_per_request)),
        (
            "KV total",
            lambda p: f"{format_size(p.kv_bytes_total)} ({p.kv_bytes_total / 1e9:.1f} GB)",
        ),
        ("KV room per GPU", lambda p: format_size(p.kv_bytes_per_gpu_available)),
        ("max concurrency / replica", lambda p: f"{p.max_concurrency_per_replica:,}"),
        ("GPUs needed", lambda p: "does not fit" if p.gpus_needed is None else str(p.gpus_needed)),
    ]
    for name, fmt in rows:
        table.add_row(name, *(fmt(p) for p in plans))
    (console or Console()).print(table)
