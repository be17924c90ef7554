"""``kvserve serve`` (the OpenAI-compatible server of one engine, or another node's
tensor-parallel ranks) and ``kvserve router`` (the front of a cluster)."""

from __future__ import annotations

import argparse
import dataclasses
import logging

from kvserve.commands import model_or_default
from kvserve.config import EngineArgs
from kvserve.flags import add_flags, from_flags
from kvserve.router.config import RouterConfig
from kvserve.server.config import ServerConfig


def register(sub: argparse._SubParsersAction) -> None:
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    EngineArgs.add_cli_args(sv, serve=True)
    add_flags(sv, ServerConfig)
    sv.set_defaults(func=serve)
    rt = sub.add_parser("router", help="OpenAI-compatible front of a cluster (failover)")
    add_flags(rt, RouterConfig)
    rt.set_defaults(func=router)


def serve(ns: argparse.Namespace) -> int:
    """Serve until stopped; on a node other than 0, run its ranks only. Raises
    ``ValueError`` for flags that do not go together."""
    from kvserve.server.serve import run_server

    model_or_default(ns)
    engine_args = EngineArgs.from_cli(ns)
    parallel = engine_args.parallel_config()
    if parallel.node_rank > 0:  # another node's ranks only: no engine core, no server
        from kvserve.worker.executor import run_headless

        logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(message)s")
        return run_headless(parallel)
    config = from_flags(ServerConfig, ns)
    if config.tenants is not None and engine_args.prefix_cache_isolation is None:
        # tenants do not learn from one another's TTFT what the others sent
        engine_args = dataclasses.replace(engine_args, prefix_cache_isolation="tenant")
    elif config.tenants is not None and engine_args.prefix_cache_isolation == "none":
        logging.getLogger("kvserve").warning(
            "--prefix-cache-isolation none with --tenants: tenants share prefix blocks, so a "
            "tenant can tell from its time to first token whether another sent a prompt"
        )
    if config.role != "both" and not engine_args.cluster:
        raise ValueError("--role prefill|decode needs --cluster (a router hands requests over)")
    if config.role == "prefill" and "standby" not in engine_args.replicate_to:
        # the prompt's blocks go straight to the decode worker (the router makes it the
        # request's standby), besides the shared tier
        engine_args = dataclasses.replace(
            engine_args, replicate_to=(*engine_args.replicate_to, "standby")
        )
    run_server(engine_args, config, ns.log_level)
    return 0


def router(ns: argparse.Namespace) -> int:
    """Route until stopped."""
    from kvserve.router.serve import run_router

    run_router(from_flags(RouterConfig, ns), ns.log_level)
    return 0
