"""The router's tokenizers, one per fingerprint: ``--tokenizer``'s, and those taken from
the workers themselves (``GET /internal/tokenizer``, ``server.tokenizer_export``), so
prefix-aware placement needs no flag.

Contract:

1. ``get(fp)`` is the tokenizer whose ``Tokenizer.fingerprint`` is ``fp``, or None. A
   request is tokenized only for the fingerprints its candidate workers registered
   (``tokenizer_fp``), so workers of different models never share a tokenizer.
2. ``follow(workers)`` (after every registry read) starts, for each fingerprint some
   trusted worker (``trusted``: its cluster secret matches) registers and the router does
   not have, one fetch from such a worker — the next one in id order on each retry. It
   awaits nothing: until a fetch succeeded, requests for those workers are placed by load.
   A fetched tokenizer that no registered worker uses any more is dropped (a model
   rolled out replaces its tokenizer rather than adding one).
3. A fetch downloads asynchronously and rebuilds and verifies in a thread
   (``asyncio.to_thread``): the event loop never waits for the parsing as a whole, only
   for one GIL-holding step of it at a time (~0.1 s for SmolLM2's 49k-token vocabulary).
4. A failed fetch (unreachable, an HTTP error, an export that does not rebuild to its
   fingerprint) never fails a request: it is logged once per fingerprint (WARNING; later
   failures at DEBUG), counted (``kvserve_router_tokenizer_fetches_total{outcome}``) and
   retried after a backoff doubling from ``BACKOFF_S`` to ``MAX_BACKOFF_S``.
5. ``--tokenizer``'s tokenizer (``load_override``: ValueError when the path has none)
   serves the workers with its fingerprint, which are never fetched from, and is never
   dropped; workers with other fingerprints are still fetched from.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvserve.model.tokenizer import Tokenizer, load_tokenizer
from kvserve.router.workers import Worker
from kvserve.server.tokenizer_export import TOKENIZER_PATH, rebuild_tokenizer

logger = logging.getLogger("kvserve.router")

BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0


def load_override(path: str | None) -> Tokenizer | None:
    """The tokenizer of ``--tokenizer PATH`` (a model directory, or the directory of a
    ``tokenizer.json``); None without a path. Raises ValueError when there is none."""
    if path is None:
        return None
    p = Path(path)
    tok = load_tokenizer(p.parent if p.is_file() else p)
    if tok is None:
        raise ValueError(f"--tokenizer {path}: no tokenizer.json there")
    return tok


@dataclass
class _Attempts:
    """A fingerprint not fetched yet: failures so far, no try before ``retry_at``."""

    failures: int = 0
    retry_at: float = 0.0


class Tokenizers:
    def __init__(
        self,
        override: Tokenizer | None,
        client: Callable[[Worker], httpx.AsyncClient],
        secret: str | None,
        timeout: float,
        trusted: Callable[[Worker], bool] = lambda w: True,
        metrics: Any = None,
    ):
        self.override = override
        self.client = client  # a worker's connection pool (WorkerPool.client)
        self.secret = secret
        self.timeout = httpx.Timeout(60.0, connect=timeout)  # megabytes may follow
        self.trusted = trusted
        self.metrics = metrics
        self._by_fp: dict[str, Tokenizer] = {}
        self.sources: dict[str, str] = {}  # fp → where it came from (for /router/workers)
        if override is not None:
            self._by_fp[override.fingerprint] = override
            self.sources[override.fingerprint] = f"--tokenizer {override.source}"
        self._attempts: dict[str, _Attempts] = {}
        self._fetching: dict[str, asyncio.Task] = {}

    def get(self, fp: str | None) -> Tokenizer | None:
        return self._by_fp.get(fp) if fp else None

    def count(self, source: str) -> int:
        """Tokenizers held from ``flag`` (``--tokenizer``) or ``worker``."""
        flag = int(self.override is not None and self.override.fingerprint in self._by_fp)
        return flag if source == "flag" else len(self._by_fp) - flag

    def view(self) -> dict[str, Any]:
        """For ``/router/workers``: each tokenizer held (fingerprint → source) and each
        fingerprint still wanted (→ failures so far)."""
        return {
            "held": dict(self.sources),
            "pending": {fp: a.failures for fp, a in self._attempts.items()},
        }

    # ---- following the registry ---------------------------------------------------------
    def follow(self, workers: Mapping[str, Worker]) -> None:
        """Start a fetch for each fingerprint wanted and not held (see the contract)."""
        wanted: dict[str, list[Worker]] = {}
        for w in sorted(workers.values(), key=lambda w: w.node_id):
            fp = w.info.get("tokenizer_fp")
            if isinstance(fp, str) and fp and self.trusted(w):
                wanted.setdefault(fp, []).append(w)
        keep = set(wanted) | ({self.override.fingerprint} if self.override else set())
        for fp in [fp for fp in self._by_fp if fp not in keep]:
            logger.info("tokenizer %s: no registered worker uses it any more; dropped", fp)
            del self._by_fp[fp], self.sources[fp]
        for fp in [fp for fp in self._attempts if fp not in wanted]:
            del self._attempts[fp]
        now = time.monotonic()
        for fp, ws in wanted.items():
            if fp in self._by_fp or fp in self._fetching:
                continue
            attempts = self._attempts.setdefault(fp, _Attempts())
            if now < attempts.retry_at:
                continue
            w = ws[attempts.failures % len(ws)]
            self._fetching[fp] = asyncio.get_running_loop().create_task(self._fetch(fp, w))

    async def _fetch(self, fp: str, w: Worker) -> None:
        start = time.monotonic()
        outcome, why = "failed", ""
        try:
            headers = {"X-Kvserve-Cluster-Secret": self.secret} if self.secret else {}
            r = await self.client(w).get(
                w.url + TOKENIZER_PATH, headers=headers, timeout=self.timeout
            )
            if r.status_code != 200:
                why = f"HTTP {r.status_code}: {r.text[:200]}"
            else:
                outcome = "refused"  # from here on a failure is the export's
                tok = await asyncio.to_thread(rebuild_tokenizer, r.content, fp)
                outcome = "ok"
        except Exception as e:  # anything at all: a miss, retried, never a failed request
            why = repr(e) if outcome == "failed" else str(e)
        finally:
            self._fetching.pop(fp, None)
        if self.metrics is not None:
            self.metrics.tokenizer_fetches.labels(outcome).inc()
        attempts = self._attempts.get(fp)
        if outcome != "ok":
            if attempts is None:  # the fingerprint left the registry meanwhile
                return
            attempts.failures += 1
            backoff = min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (attempts.failures - 1))
            attempts.retry_at = time.monotonic() + backoff
            log = logger.warning if attempts.failures == 1 else logger.debug
            log(
                "tokenizer %s from worker %s: %s; its workers are placed by load until a "
                "fetch succeeds (retrying with backoff; further failures logged at DEBUG)",
                fp, w.node_id, why,
            )  # fmt: skip
            return
        failures = attempts.failures if attempts is not None else 0
        self._attempts.pop(fp, None)
        self._by_fp[fp] = tok
        self.sources[fp] = f"worker {w.node_id}"
        logger.info(
            "tokenizer %s taken from worker %s (%s, %d tokens) in %.2f s%s: prefix "
            "routing for its workers",
            fp, w.node_id, tok.source, tok.vocab_size, time.monotonic() - start,
            f" after {failures} failed tries" if failures else "",
        )  # fmt: skip

    async def stop(self) -> None:
        """Cancel the fetches in flight."""
        tasks = list(self._fetching.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
