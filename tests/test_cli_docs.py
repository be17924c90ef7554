"""The CLI and the README agree (issue 17): every engine flag has a row in the README's
flag table whose default is the parser's; each subcommand's own flags appear in its
README synopsis; engine flags have help texts; subcommands take only their own flags."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kvserve.cli import build_parser
from kvserve.config import EngineArgs

README = (Path(__file__).parents[1] / "README.md").read_text()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _table() -> dict[str, str]:
    """README flag-table rows: ``--flag`` → the default cell."""
    rows = {}
    for line in README.splitlines():
        m = re.match(r"\| `--(\[no-\])?([a-z0-9-]+)[^`]*` \| ([^|]*) \|", line)
        if m:
            rows["--" + m.group(2)] = m.group(3).strip()
    return rows


def _synopsis(command: str) -> str:
    m = re.search(rf"```\nkvserve {command} (.*?)```", README, re.S)
    assert m, f"README has no synopsis block for kvserve {command}"
    return m.group(1)


def _engine_flags() -> dict[str, argparse.Action]:
    serve = _subparsers(build_parser())["serve"]
    names = {"--" + n.replace("_", "-") for n in EngineArgs.__dataclass_fields__}
    return {o: a for a in serve._actions for o in a.option_strings if o in names}


def test_every_engine_flag_has_a_readme_row_with_its_default():
    rows = _table()
    for flag, action in _engine_flags().items():
        assert flag in rows, f"README's flag table has no row for {flag}"
        cell, default = rows[flag].replace("`", ""), action.default
        if isinstance(default, bool):
            assert cell == ("on" if default else "off"), flag
        elif isinstance(default, (int, float)) and not isinstance(default, bool):
            assert float(cell) == float(default), flag
        elif isinstance(default, str) and rows[flag].startswith("`"):
            assert cell == default, flag


def test_every_engine_flag_has_help():
    for flag, action in _engine_flags().items():
        assert action.help and len(action.help) > 10, f"{flag} has no help text"


@pytest.mark.parametrize("command", ["serve", "router", "generate"])
def test_a_subcommands_own_flags_are_in_its_synopsis(command):
    sub = _subparsers(build_parser())[command]
    text = _synopsis(command)
    for action in sub._actions:
        if action.dest in EngineArgs.__dataclass_fields__ and action.dest != "model":
            continue  # "[engine flags]": the table
        for opt in action.option_strings:
            if opt.startswith("--") and opt not in ("--help", "--log-level"):
                assert opt in text, f"kvserve {command} {opt} is missing from the README synopsis"


def test_cluster_flags_belong_to_serve_only():
    subs = _subparsers(build_parser())
    for command in ("generate", "eval"):
        parser = subs[command]
        if command == "eval":
            parser = _subparsers(parser)["perplexity"]
        opts = {o for a in parser._actions for o in a.option_strings}
        assert "--cluster" not in opts and "--replicate-every" not in opts, command
        with pytest.raises(SystemExit):
            parser.parse_args(["--cluster", "redis://x"])
    assert "--cluster" in {o for a in subs["serve"]._actions for o in a.option_strings}


def test_log_level_is_taken_before_or_after_the_subcommand():
    parser = build_parser()
    assert parser.parse_args(["--log-level", "debug", "plan"]).log_level == "debug"
    assert parser.parse_args(["plan", "--log-level", "warning"]).log_level == "warning"
    assert parser.parse_args(["plan"]).log_level == "INFO"
