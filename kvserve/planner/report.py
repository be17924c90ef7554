"""Readable side-by-side table of plans (rich)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kvserve.planner.capacity import Plan
from kvserve.planner.usage import UsageReport
from kvserve.utils import format_size


def print_plans(plans: list[Plan], console: Console | None = None) -> None:
    """One column per plan; rows are the quantities an operator sizes hardware with."""
    table = Table(title="kvserve capacity plan")
    table.add_column("")
    for p in plans:
        table.add_column(p.label, justify="right")
    rows = [
        ("model", lambda p: p.model),
        ("GPU (memory x utilization)", lambda p: p.gpu),
        ("concurrency", lambda p: f"{p.concurrency:,}"),
        ("weights", lambda p: format_size(p.weight_bytes)),
        ("KV layout", lambda p: p.kv_layout),
        ("KV bytes / token", lambda p: f"{p.kv_bytes_per_token:,}"),
        ("context + output tokens / request (blocks)", lambda p: f"{p.tokens_per_request:,}"),
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
    console = console or Console()
    console.print(table)
    for p in plans:
        if p.fit_note:
            console.print(f"{p.label}: does not fit: {p.fit_note}")


def print_usage(r: UsageReport, console: Console | None = None) -> None:
    """Percentiles of KV demand, the recommendation, and the daily/weekly shape."""
    console = console or Console()
    table = Table(title=f"KV demand: {r.samples:,} samples over {r.span_s / 86400:.1f} days")
    table.add_column("statistic")
    table.add_column("KV bytes", justify="right")
    for name, value in (("P50", r.p50), ("P95", r.p95), ("P99", r.p99), ("max", r.max)):
        table.add_row(name, format_size(value))
    table.add_row(f"recommended (P99 × {1 + r.headroom:.2f})", format_size(r.recommended_bytes))
    console.print(table)
    peak = max((v for v in r.hourly_mean if v == v), default=0.0) or 1.0
    console.print(
        "mean demand by hour (UTC): "
        + " ".join("·" if v != v else "▁▂▃▄▅▆▇█"[min(7, int(8 * v / peak))] for v in r.hourly_mean)
    )
    days = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]
    console.print(
        "mean demand by weekday: "
        + ", ".join(
            f"{d} {format_size(v)}" for d, v in zip(days, r.weekday_mean, strict=True) if v == v
        )
    )
