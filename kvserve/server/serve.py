"""``kvserve serve``: load the engine, run the app under uvicorn, drain on SIGTERM/SIGINT.

Shutdown: the first signal marks the server draining (``/ready`` → 503, new requests → 503)
and uvicorn stops accepting connections, then waits up to ``graceful_timeout`` seconds for
running requests and streams to finish; then the engine thread stops.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import uvicorn

from kvserve.config import EngineArgs
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.app import ServerConfig, build_app

logger = logging.getLogger("kvserve")


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_exit):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            # drained gracefully: exit with status 0 instead of re-raising the signal
            self._captured_signals.clear()


def run_server(engine_args: EngineArgs, config: ServerConfig, log_level: str = "info") -> None:
    """Serve until a signal; returns after a graceful shutdown."""
    llm_engine = LLMEngine(engine_args)
    if config.tenants is not None:
        kv = llm_engine.kv
        budgets = config.tenants.resolve(
            kv.num_blocks, kv.block_size, llm_engine.kv_spec.bytes_per_block
        )
        for b in budgets.values():
            logger.info(
                "tenant %s: priority %d, reservation %d blocks, limit %d blocks",
                b.tenant.name,
                b.tenant.priority,
                b.reservation_blocks,
                b.limit_blocks,
            )
        logger.warning(
            "tenant KV reservations and limits are validated but not yet enforced by the "
            "scheduler; tenants currently separate API keys, usage samples and (with "
            "--prefix-cache-isolation tenant) the prefix cache"
        )
    engine = AsyncLLMEngine(llm_engine)
    app = build_app(engine, config)
    engine.start()

    def drain() -> None:
        if not app.state.kv.draining:
            logger.info("draining: refusing new requests, finishing running ones")
        app.state.kv.draining = True

    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=log_level.lower(),
        timeout_graceful_shutdown=config.graceful_timeout,
        access_log=False,
    )
    server = _DrainingServer(uv_config, drain)
    logger.info("serving %s on http://%s:%d", app.state.kv.model_name, config.host, config.port)
    try:
        server.run()
    finally:
        engine.shutdown()
        logger.info("engine stopped")
