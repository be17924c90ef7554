"""Command-line flags made from a config dataclass's fields.

A field made by ``flag(...)`` carries its help text, choices and how the command line
spells it; ``add_flags(parser, Config)`` adds one ``--field-name`` per such field and
``from_flags(Config, namespace)`` builds the config back from the parsed flags. The
defaults live once, on the dataclass (the parser shows them), so the CLI cannot restate
them wrongly. ``EngineArgs``, ``ServerConfig`` and ``RouterConfig`` are made this way.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_KEY = "kvserve_flag"


@dataclass(frozen=True)
class FlagSpec:
    """How one field appears on the command line.

    ``kind``: the value's type where the default (None) does not say it; ``repeat``: the
    flag may be given again, the field is the tuple of its values; ``env``: the variable
    read when the flag is absent; ``parse``: turns the flag's text into the field's value
    (applied by ``from_flags``); ``name``: the flag when it is not ``--field-name``;
    ``serve_only``: only ``kvserve serve`` has it; ``negative``: a second flag that sets a
    boolean False (``--no-prefix-caching``); ``required``: whether a field without a
    default must be given (else it is None when absent).
    """

    help: str
    choices: tuple[str, ...] | None = None
    kind: type | None = None
    metavar: str | None = None
    repeat: bool = False
    env: str | None = None
    parse: Callable[[str], Any] | None = None
    name: str | None = None
    serve_only: bool = False
    negative: str | None = None
    required: bool = True


def flag(default: Any = dataclasses.MISSING, help: str = "", **spec: Any) -> Any:
    """A dataclass field that is also a flag (``FlagSpec``'s keywords); no default: the
    flag is required."""
    return dataclasses.field(default=default, metadata={_KEY: FlagSpec(help, **spec)})


def _spec(f: dataclasses.Field) -> FlagSpec | None:
    return f.metadata.get(_KEY)


def add_flags(parser: argparse.ArgumentParser, cls: type, *, serve: bool = True) -> None:
    """One flag per ``flag(...)`` field of ``cls``, its default shown in the help; the
    serve-only ones only when ``serve``."""
    for f in dataclasses.fields(cls):
        spec = _spec(f)
        if spec is None or (spec.serve_only and not serve):
            continue
        flag_name = spec.name or "--" + f.name.replace("_", "-")
        if f.default is dataclasses.MISSING:
            parser.add_argument(
                flag_name,
                dest=f.name,
                required=spec.required,
                metavar=spec.metavar,
                help=spec.help,
            )
            continue
        if isinstance(f.default, bool):
            action = argparse.BooleanOptionalAction
            parser.add_argument(
                flag_name, dest=f.name, action=action, default=f.default, help=spec.help
            )
            if spec.negative:
                parser.add_argument(
                    spec.negative,
                    dest=f.name,
                    action="store_false",
                    help=f"same as --no-{flag_name.removeprefix('--')}",
                )
            continue
        if spec.repeat:
            parser.add_argument(
                flag_name, dest=f.name, action="append", metavar=spec.metavar, help=spec.help
            )
            continue
        kind = spec.kind or (str if spec.parse or f.default is None else type(f.default))
        shown = spec.help if f.default in (None, ()) else f"{spec.help} (default: %(default)s)"
        parser.add_argument(
            flag_name,
            dest=f.name,
            type=kind,
            default=None if spec.parse else f.default,
            choices=spec.choices,
            metavar=spec.metavar,
            help=shown,
        )


def from_flags(cls: type, ns: argparse.Namespace) -> Any:
    """``cls`` from the flags ``add_flags`` added: repeated flags as tuples, an absent
    flag with ``env`` from that variable, ``parse`` applied to the text given."""
    values = {}
    for f in dataclasses.fields(cls):
        spec = _spec(f)
        if spec is None or not hasattr(ns, f.name):  # not this command's: the default
            continue
        value = getattr(ns, f.name)
        if spec.repeat:
            value = tuple(value or ())
        if not value and spec.env:  # absent or empty: the environment's, if set
            value = os.environ.get(spec.env) or None
        if spec.parse is not None:
            value = spec.parse(value) if value else None
        values[f.name] = value
    return cls(**values)
