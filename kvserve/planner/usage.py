"""KV usage recording (engine side) and its analysis (``kvserve plan --usage FILE``).

The engine appends one JSON line per interval: timestamp, used/total blocks, bytes per
block, usage ratio and used blocks per tenant. The planner reads the lines back and sizes
KV memory from the distribution of demand: P99 × (1 + headroom) by default, with warnings
when the data are too short to contain weekly patterns (< 14 days) or have gaps.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np

TWO_WEEKS_S = 14 * 24 * 3600


class UsageRecorder:
    """Appends a usage sample to ``path`` at most every ``interval_s`` seconds."""

    def __init__(self, path: str | Path, interval_s: float):
        if interval_s <= 0:
            raise ValueError(f"kv_usage_interval must be positive, got {interval_s}")
        self.interval_s = interval_s
        # the recorder owns the file until close()
        self._file: IO[str] = Path(path).open("a", encoding="utf-8")  # noqa: SIM115
        self._next = 0.0

    def due(self) -> bool:
        """Whether the next ``maybe_record`` would write (lets callers skip computing it)."""
        return time.time() >= self._next

    def maybe_record(
        self,
        used_blocks: int,
        total_blocks: int,
        bytes_per_block: int,
        tenants: dict[str, int] | None = None,
    ) -> bool:
        """Write a sample if the interval has passed; returns whether it wrote one.
        ``tenants`` maps tenant → used blocks (demand; shared blocks count per holder)."""
        now = time.time()
        if now < self._next:
            return False
        self._next = now + self.interval_s
        sample = {
            "ts": round(now, 3),
            "used_blocks": used_blocks,
            "total_blocks": total_blocks,
            "bytes_per_block": bytes_per_block,
            "usage": used_blocks / total_blocks,
        }
        if tenants is not None:
            sample["tenants"] = tenants
        self._file.write(json.dumps(sample) + "\n")
        self._file.flush()
        return True

    def close(self) -> None:
        self._file.close()


@dataclass
class UsageReport:
    """Demand statistics in bytes of KV, and what to buy."""

    samples: int
    span_s: float
    p50: float
    p95: float
    p99: float
    max: float
    headroom: float
    recommended_bytes: float
    hourly_mean: list[float]  # mean demand by hour of day (UTC), NaN where no data
    weekday_mean: list[float]  # Monday = 0
    warnings: list[str] = field(default_factory=list)


def load_usage(path: str | Path, tenant: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Timestamps and used bytes (of ``tenant`` only, when given: 0 in samples where it
    held nothing) from a JSONL file, sorted by time.

    Raises ValueError naming the line that is not a sample.
    """
    ts, used = [], []
    with Path(path).open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                s = json.loads(line)
                ts.append(float(s["ts"]))
                blocks = s["used_blocks"] if tenant is None else s.get("tenants", {}).get(tenant, 0)
                used.append(float(blocks) * float(s["bytes_per_block"]))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{n}: not a usage sample ({e})") from None
    if not ts:
        raise ValueError(f"{path}: no usage samples")
    order = np.argsort(ts)
    return np.asarray(ts)[order], np.asarray(used)[order]


def analyze(ts: np.ndarray, used: np.ndarray, headroom: float = 0.15) -> UsageReport:
    """Percentiles (nearest rank), recommendation and weekly/daily shape of demand."""
    pct = {q: float(np.percentile(used, q, method="inverted_cdf")) for q in (50, 95, 99)}
    span = float(ts[-1] - ts[0])
    step = float(np.median(np.diff(ts))) if len(ts) > 1 else 0.0
    warnings = []
    if span + step < TWO_WEEKS_S:  # n samples a step apart cover n steps of time
        warnings.append(
            f"the data cover {span / 86400:.1f} days; at least 14 are needed to see weekly patterns"
        )
    if len(ts) > 2:
        gaps = np.diff(ts)
        big = gaps > 3 * step
        if big.any():
            warnings.append(
                f"{int(big.sum())} gap(s) longer than 3× the sampling interval "
                f"({step:.0f} s); the longest is {float(gaps.max()) / 3600:.1f} h"
            )
    hours = ((ts // 3600) % 24).astype(int)
    days = ((ts // 86400 + 3) % 7).astype(int)  # 1970-01-01 was a Thursday
    hourly = [
        float(used[hours == h].mean()) if (hours == h).any() else float("nan") for h in range(24)
    ]
    weekday = [
        float(used[days == d].mean()) if (days == d).any() else float("nan") for d in range(7)
    ]
    return UsageReport(
        samples=len(ts),
        span_s=span,
        p50=pct[50],
        p95=pct[95],
        p99=pct[99],
        max=float(used.max()),
        headroom=headroom,
        recommended_bytes=pct[99] * (1 + headroom),
        hourly_mean=hourly,
        weekday_mean=weekday,
        warnings=warnings,
    )
