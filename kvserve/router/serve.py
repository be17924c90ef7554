"""``kvserve router``: run the router app under uvicorn until a signal."""

from __future__ import annotations

import logging

import uvicorn

from kvserve.router.app import build_router_app
from kvserve.router.config import RouterConfig

logger = logging.getLogger("kvserve.router")


def run_router(config: RouterConfig, log_level: str = "info") -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per proxied request
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
