"""PNG of recorded KV demand: distribution with percentiles, and the time series."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvserve.planner.usage import UsageReport


def plot_usage(ts: np.ndarray, used: np.ndarray, report: UsageReport, out: str | Path) -> None:
    """Write a two-panel PNG to ``out`` (needs matplotlib: ``pip install kvserve[plot]``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 1024**2
    fig, (hist, series) = plt.subplots(1, 2, figsize=(12, 4.5))
    hist.hist(used / mib, bins=50, color="#4c72b0")
    series.plot((ts - ts[0]) / 86400, used / mib, lw=0.6, color="#4c72b0")
    for name, value, style in (
        ("P95", report.p95, ":"),
        ("P99", report.p99, "--"),
        (f"recommended (P99 × {1 + report.headroom:.2f})", report.recommended_bytes, "-"),
    ):
        hist.axvline(value / mib, ls=style, color="#c44e52", label=name)
        series.axhline(value / mib, ls=style, color="#c44e52", label=name)
    hist.set(title="KV demand distribution", xlabel="KV in use (MiB)", ylabel="samples")
    series.set(title="KV demand over time", xlabel="days", ylabel="KV in use (MiB)")
    hist.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
