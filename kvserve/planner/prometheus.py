"""KV demand from Prometheus (``kvserve plan --prometheus URL --range 14d``).

Reads ``sum(kvserve_kv_cache_used_bytes)`` (every scraped kvserve: the cluster's demand; a
different PromQL expression with ``--query``) through the HTTP API's ``query_range``, in
windows of at most 10,000 points (Prometheus refuses more than 11,000 per query), and hands
the samples to the same analysis as ``--usage FILE``.
"""

from __future__ import annotations

import json
import re
import time
import urllib.parse
import urllib.request

import numpy as np

DEFAULT_QUERY = "sum(kvserve_kv_cache_used_bytes)"
_MAX_POINTS = 10_000
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """``90s``, ``15m``, ``2h``, ``14d``, ``1w`` (or plain seconds) → seconds.
    Raises ValueError for anything else."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if not m or float(m[1]) <= 0:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 15m, 2h, 14d)")
    return float(m[1]) * _UNITS[m[2] or "s"]


def _query_range(
    url: str, query: str, start: float, end: float, step: float, timeout: float
) -> list[tuple[float, float]]:
    params = urllib.parse.urlencode(
        {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
    )
    try:
        with urllib.request.urlopen(
            f"{url.rstrip('/')}/api/v1/query_range?{params}", timeout=timeout
        ) as r:
            body = json.loads(r.read())
    except OSError as e:
        raise ValueError(f"Prometheus at {url} did not answer: {e}") from None
    if body.get("status") != "success":
        raise ValueError(f"Prometheus error: {body.get('error', body)}")
    result = body["data"]["result"]
    if len(result) > 1:
        raise ValueError(
            f"the query {query!r} returns {len(result)} series; aggregate it to one (e.g. sum(...))"
        )
    return [(float(t), float(v)) for t, v in result[0]["values"]] if result else []


def load_prometheus(
    url: str,
    range_s: float,
    step_s: float,
    query: str = DEFAULT_QUERY,
    end: float | None = None,
    timeout: float = 30.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Timestamps and used bytes over the last ``range_s`` seconds at ``step_s``.
    Raises ValueError when Prometheus fails or has no samples."""
    if step_s <= 0:
        raise ValueError("step must be positive")
    end = time.time() if end is None else end
    start = end - range_s
    points: list[tuple[float, float]] = []
    t = start
    while t <= end:
        t_end = min(end, t + step_s * (_MAX_POINTS - 1))
        points += _query_range(url, query, t, t_end, step_s, timeout)
        t = t_end + step_s
    if not points:
        raise ValueError(f"Prometheus has no samples of {query!r} in the last {range_s:g}s")
    ts = np.asarray([p[0] for p in points])
    used = np.asarray([p[1] for p in points])
    order = np.argsort(ts, kind="stable")
    return ts[order], used[order]
