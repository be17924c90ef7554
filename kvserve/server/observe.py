"""Request metrics of a response as its choices update: time to first token, inter-token
latency, generated tokens, end-to-end latency and finish reasons (``ServerMetrics``)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvserve.request import RequestOutput
from kvserve.server.metrics import ServerMetrics
from kvserve.server.render import ChoiceState


class Observer:
    """Started when the response's sequences were added (the latencies' origin)."""

    def __init__(self, metrics: ServerMetrics, model_name: str):
        self.metrics = metrics
        self.name = model_name
        self.start = time.monotonic()

    def observe(self, c: ChoiceState, out: RequestOutput) -> None:
        """Count ``out`` — the next snapshot of ``c`` — before ``c`` takes it."""
        m, name = self.metrics, self.name
        now = time.monotonic()
        n_new = len(out.outputs[0].token_ids) - c.num_tokens
        if n_new > 0:
            if c.num_tokens == 0:
                m.ttft.labels(name).observe(now - self.start)
            elif c.last_token_time is not None:
                m.itl.labels(name).observe(now - c.last_token_time)
            c.last_token_time = now
            m.generation_tokens.labels(name).inc(n_new)
        if out.finished:
            m.e2e.labels(name).observe(now - self.start)
            reason = out.outputs[0].finish_reason or "abort"
            m.request_success.labels(name, reason).inc()

    def aborted(self, choices: Sequence[ChoiceState]) -> None:
        """Count the choices that had not finished as aborted (as the engine's own aborts
        are): their client went away or their generator was closed."""
        left = sum(c.finish_reason is None for c in choices)
        if left:
            self.metrics.request_success.labels(self.name, "abort").inc(left)
