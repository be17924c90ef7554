"""The ``kvserve`` subcommands, one module each: ``register(sub)`` adds the command's
parser (its flags, its help) to ``kvserve.cli``'s subparsers and sets ``func``, the
function ``kvserve.cli.main`` calls with the parsed namespace (its return value is the
exit code)."""

from __future__ import annotations

import argparse


def model_or_default(ns: argparse.Namespace) -> None:
    """Fill ``ns.model`` with the bundled default model when no ``--model`` was given."""
    if ns.model is None:
        from kvserve.default_model import default_model_path

        ns.model = str(default_model_path())
