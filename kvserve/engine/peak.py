"""PeakTracker: the maximum of a value (KV blocks in use) over the last minute, five
minutes and hour, from per-second maxima; ``record`` is O(1) on the step path."""

from __future__ import annotations

import time
from collections import deque


class PeakTracker:
    """Maximum of a value over the last 1m/5m/1h, from per-second maxima."""

    def __init__(self, horizon: int = 3600):
        self.horizon = horizon
        self._buckets: deque[list[float]] = deque()  # [second, max]

    def record(self, value: float, now: float | None = None) -> None:
        sec = int(time.monotonic() if now is None else now)
        if self._buckets and self._buckets[-1][0] == sec:
            if value > self._buckets[-1][1]:
                self._buckets[-1][1] = value
        else:
            self._buckets.append([sec, value])
        while self._buckets and self._buckets[0][0] <= sec - self.horizon:
            self._buckets.popleft()

    def peak(self, window: float, now: float | None = None) -> float:
        """The largest value recorded in the last ``window`` seconds (0 if none)."""
        t = time.monotonic() if now is None else now
        return max((v for s, v in self._buckets if s > t - window - 1), default=0.0)
