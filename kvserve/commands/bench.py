"""``kvserve bench serve``: the load generator for OpenAI-compatible servers
(``kvserve.bench_serve``)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from kvserve.bench_serve import add_args

    bn = sub.add_parser("bench", help="benchmarks against a running server")
    bn_sub = bn.add_subparsers(dest="bench_command", required=True)
    bs = bn_sub.add_parser("serve", help="async load generator for OpenAI-compatible servers")
    add_args(bs)
    bs.set_defaults(func=bench_serve)


def bench_serve(ns: argparse.Namespace) -> int:
    from kvserve.bench_serve import main

    return main(ns)
