"""Errors the engine raises to its callers (importable without loading the engine)."""

from __future__ import annotations


class EngineError(ValueError):
    """A request or configuration the engine cannot serve; the message says why."""


class StartupConfigError(EngineError):
    """The engine could not start because of its model or flags (the CLI exits 2)."""


class EngineDeadError(RuntimeError):
    """The engine core failed or exited; the server must report unhealthy."""


class QueueTimeout(RuntimeError):
    """A request had no output within its deadline (``--queue-timeout``); it was aborted."""
