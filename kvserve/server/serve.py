"""``kvserve serve``: load the engine, run the app under uvicorn, drain on SIGTERM/SIGINT.

SIGHUP re-reads the tenants file (``--tenants``) and applies it without dropping running
requests; an invalid file is logged and the old tenants stay.

Shutdown: the first signal marks the server draining (``/ready`` → 503, new requests → 503)
and uvicorn stops accepting connections, then waits up to ``graceful_timeout`` seconds for
running requests and streams to finish; shortly before that deadline, the requests still
running are ended (a 503, or an error event a router resumes elsewhere), so none is
cancelled mid-flight; then the engine core is told to shut down (it flushes the KV store
and exits). The engine core runs in its own process
(``engine.core_proc``); if it dies, running streams end with an error event, new requests
and ``/health`` get 503, and the server exits 1.
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
from kvserve.engine.async_llm import AsyncLLM
from kvserve.engine.messages import SetTenantBudgets
from kvserve.errors import EngineError, StartupConfigError
from kvserve.server.app import build_app
from kvserve.server.config import ServerConfig

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


def _open_kv_events(engine_args: EngineArgs, config: ServerConfig):
    """The KV event publisher when this worker publishes (``--cluster`` or
    ``--kv-events-port``), bound before the engine loads: a port in use is refused at
    start (SystemExit), not found out later. It listens on the advertised host when the
    server listens everywhere, and seals its hashes with the cluster secret."""
    if not engine_args.kv_events_enabled:
        return None
    import zmq

    from kvserve.kv.events import events_key
    from kvserve.server.kv_events import KVEventPublisher, bind_host

    port = engine_args.kv_events_port or 0
    if not 0 <= port < 65536:
        raise SystemExit(f"kvserve serve: --kv-events-port must be in 0..65535, got {port}")
    host = bind_host(config.host, config.advertise_url)
    key = events_key(config.cluster_secret)
    try:
        return KVEventPublisher(engine_args.node_id or "", host, port, key)
    except zmq.ZMQError as e:
        raise SystemExit(f"kvserve serve: cannot publish KV events on port {port}: {e}") from None


def _start_heartbeat(engine: AsyncLLM, config: ServerConfig, kv_events=None):
    """With ``--cluster``: register this worker and refresh its lease (a third of it)
    until the returned stop function is called (which deregisters it). Runs in the API
    server process, so the engine core's loop never waits for it."""
    info = engine.info
    if info.cluster is None or info.node_id is None:
        return lambda: None
    from kvserve.ha.coordination import Coordinator, secret_fingerprint

    coord, node = Coordinator.from_url(info.cluster), info.node_id
    fingerprint = secret_fingerprint(config.cluster_secret)
    url = config.advertise_url or f"http://{config.host}:{config.port}"
    stop = threading.Event()
    kv_info: dict = {}
    if kv_events is not None:  # what a router needs to index this worker's blocks
        from kvserve.server.kv_events import advertised_endpoint

        kv_info = {
            "kv_events": advertised_endpoint(config.host, kv_events.port, config.advertise_url),
            "block_size": info.block_size,
            "cache_keys": info.cache_keys,
            "tenant_isolation": info.tenant_isolation,
            "tokenizer_fp": engine.tokenizer.fingerprint if engine.tokenizer else None,
        }

    tenants = config.tenants
    max_waiting = config.max_waiting_requests
    if tenants is not None:
        max_waiting = tenants.total_queue_bound(max_waiting)

    def beat() -> None:
        while not stop.is_set():
            try:
                s = engine.stats()
                coord.heartbeat(
                    node,
                    url,
                    running=s.running,
                    waiting=s.waiting,
                    max_waiting=max_waiting,  # a router sheds when every worker is there
                    completion_rate=engine.completion_rate(),
                    kv_usage=s.kv_blocks_used / max(s.kv_blocks_total, 1),
                    secret_fp=fingerprint,
                    role=config.role,
                    **kv_info,
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
    """Serve until a signal; returns after a graceful shutdown. Exits 2 when the engine
    core cannot start because of the model or the flags (``StartupConfigError``), 1 when
    it cannot start otherwise or dies while serving (a supervisor restarts the server). Refuses
    ``--cluster`` without a cluster secret before loading anything (SystemExit)."""
    if engine_args.cluster and not config.cluster_secret:
        from kvserve.ha.coordination import MISSING_SECRET

        raise SystemExit(MISSING_SECRET.format(command="serve"))
    kv_events = _open_kv_events(engine_args, config)
    try:
        engine = AsyncLLM.start(engine_args, config.cluster_secret, log_level)
    except EngineError as e:
        logger.error("the engine could not start: %s", e)
        raise SystemExit(2 if isinstance(e, StartupConfigError) else 1) from None
    info = engine.info
    if kv_events is not None and not info.kv_events:  # (prefix caching is off)
        kv_events.close()
        kv_events = None
    if kv_events is not None:
        kv_events.node = info.node_id or f"{config.host}:{config.port}"
        engine.on_kv_events = kv_events.publish
    if config.tenants is not None:
        budgets = config.tenants.resolve(info.num_blocks, info.block_size, info.bytes_per_block)
        for b in budgets.values():
            logger.info(
                "tenant %s: priority %d, reservation %d blocks, limit %d blocks",
                b.tenant.name,
                b.tenant.priority,
                b.reservation_blocks,
                b.limit_blocks,
            )
    server: _DrainingServer | None = None
    died = False

    async def watch_engine() -> None:
        nonlocal died
        await engine.dead.wait()
        died = True
        logger.error("the engine core died: answering 503 and exiting")
        await asyncio.sleep(0.5)  # running streams get their error event first
        if server is not None:
            server.should_exit = True

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.attach()
        watcher = asyncio.create_task(watch_engine())
        if kv_events is not None:
            kv_events.start()
        if config.tenants is not None:
            await engine.call(SetTenantBudgets(app.state.kv.budgets(config.tenants)))
        try:
            yield
        finally:
            watcher.cancel()
            await engine.shutdown(config.graceful_timeout)  # flushes queued KV store writes
            if kv_events is not None:
                kv_events.close()
            logger.info("engine stopped")

    app = build_app(engine, config, lifespan)
    app.state.kv.kv_events = kv_events
    stop_heartbeat = _start_heartbeat(engine, config, kv_events)

    def drain() -> None:
        if not app.state.kv.draining:
            logger.info("draining: refusing new requests, finishing running ones")
            # before uvicorn's own deadline cancels what still runs (with a traceback),
            # end those requests: a 503 or an error event, which a router resumes elsewhere
            grace = config.graceful_timeout
            margin = min(2.0, grace / 4)
            loop = asyncio.get_event_loop()
            loop.call_soon_threadsafe(loop.call_later, grace - margin, end_running)
        app.state.kv.draining = True

    def end_running() -> None:
        n = engine.end_all("the server is shutting down")
        if n:
            logger.warning("graceful timeout: ended %d running request(s)", n)

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
        engine.client.kill()  # (uvicorn never started the app, e.g. port in use: it runs)
    if died:
        raise SystemExit(1)
