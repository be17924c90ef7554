"""``kvserve router``: run the router app under uvicorn until a signal."""

from __future__ import annotations

import logging

import uvicorn

from kvserve.ha.coordination import MISSING_SECRET
from kvserve.router.app import build_router_app
from kvserve.router.config import RouterConfig

logger = logging.getLogger("kvserve.router")


def run_router(config: RouterConfig, log_level: str = "info") -> None:
    """Serve until a signal. Refuses to start without a cluster secret (SystemExit)."""
    if not config.cluster_secret:
        raise SystemExit(MISSING_SECRET.format(command="router"))
    for name in ("httpx", "httpx2"):  # no line per proxied request
        logging.getLogger(name).setLevel(logging.WARNING)
    app = build_router_app(config)
    logger.info("router for cluster %s on http://%s:%d", config.cluster, config.host, config.port)
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level=log_level.lower(),
        timeout_graceful_shutdown=config.graceful_timeout,
        access_log=False,
    )
