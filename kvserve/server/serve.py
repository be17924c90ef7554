"""``kvserve serve``: load the engine, run the app under uvicorn, drain on SIGTERM/SIGINT.

SIGHUP re-reads the tenants file (``--tenants``) and applies it without dropping running
requests; an invalid file is logged and the old tenants stay.

Shutdown: the first signal marks the server draining (``/ready`` → 503, new requests → 503)
and uvicorn stops accepting connections, then waits up to ``graceful_timeout`` seconds for
running requests and streams to finish; then the engine thread stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

import uvicorn

from kvserve.config import EngineArgs
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.app import ServerConfig, build_app

logger = logging.getLogger("kvserve")


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_exit, on_hangup):
        super().__init__(config)
        self._on_exit = on_exit
        self._on_hangup = on_hangup

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not on this platform
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(self._on_hangup()))

    def handle_exit(self, sig: int, frame) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            # drained gracefully: exit with status 0 instead of re-raising the signal
            self._captured_signals.clear()


def _start_heartbeat(engine: AsyncLLMEngine, config: ServerConfig):
    """With ``--cluster``: register this worker and refresh its lease (a third of it)
    until the returned stop function is called (which deregisters it)."""
    replicator = engine.engine.replicator
    if replicator is None:
        return lambda: None
    coord, node = replicator.coord, replicator.node_id
    url = config.advertise_url or f"http://{config.host}:{config.port}"
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            try:
                s = engine.stats()
                coord.heartbeat(
                    node,
                    url,
                    running=s["running"],
                    waiting=s["waiting"],
                    kv_usage=s["kv_blocks_used"] / max(s["kv_blocks_total"], 1),
                )
            except Exception as e:  # Redis away: keep trying; the lease lapses meanwhile
                logger.warning("cluster heartbeat failed: %s", e)
            stop.wait(coord.lease_ms / 3000)

    thread = threading.Thread(target=beat, name="kvserve-heartbeat", daemon=True)
    thread.start()
    logger.info("cluster: node %s at %s", node, url)

    def finish() -> None:
        stop.set()
        thread.join(5)
        with contextlib.suppress(Exception):
            coord.deregister(node)

    return finish


def run_server(engine_args: EngineArgs, config: ServerConfig, log_level: str = "info") -> None:
    """Serve until a signal; returns after a graceful shutdown."""
    llm_engine = LLMEngine(engine_args)
    if llm_engine.replicator is not None and llm_engine.replicator.pusher is not None:
        llm_engine.replicator.pusher.secret = config.cluster_secret
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
    engine = AsyncLLMEngine(llm_engine)
    app = build_app(engine, config)
    engine.start()
    stop_heartbeat = _start_heartbeat(engine, config)

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

    async def hangup() -> None:
        try:
            new = await app.state.kv.reload_tenants()
        except ValueError as e:
            logger.error("SIGHUP: tenants not reloaded: %s", e)
        else:
            logger.info("SIGHUP: reloaded %d tenants from %s", len(new.tenants), new.source)

    server = _DrainingServer(uv_config, drain, hangup)
    logger.info("serving %s on http://%s:%d", app.state.kv.model_name, config.host, config.port)
    try:
        server.run()
    finally:
        stop_heartbeat()
        engine.shutdown()
        llm_engine.close()  # flushes queued KV store writes
        logger.info("engine stopped")
