"""``kvserve`` command line: ``generate`` (offline), ``plan`` (capacity), ``eval perplexity``
(quality), ``serve`` (OpenAI-compatible server), ``router`` (the front of a cluster of
servers), ``bench serve`` (load generator). Engine flags map one-to-one to ``EngineArgs``
fields, router flags to ``RouterConfig``; ``--model`` defaults to the bundled default model."""

from __future__ import annotations

import argparse
import logging
import sys

from kvserve.commands import bench, evaluate, generate, plan, serve, tenants

LEVELS = ("debug", "info", "warning", "error", "DEBUG", "INFO", "WARNING", "ERROR")
_LOG_HELP = "logging level (default: info)"


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand (each module of ``kvserve.commands`` adds its own);
    ``--log-level`` goes before or after the subcommand."""
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO", choices=LEVELS, help=_LOG_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (generate, serve, bench, tenants, evaluate, plan):
        command.register(sub)
    for sp in sub.choices.values():  # ``kvserve serve --log-level debug`` too
        sp.add_argument("--log-level", default=argparse.SUPPRESS, choices=LEVELS, help=_LOG_HELP)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the subcommand; its exit code, 2 (and one line on stderr) for a bad value or
    a missing file."""
    ns = build_parser().parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # the openai client logs every HTTP request at INFO: noise over progress bars (bench
    # serve) and over the server's own log
    for chatty in ("httpx", "httpx2", "httpcore", "httpcore2", "openai"):
        logging.getLogger(chatty).setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
