"""The CLI and its docs agree (issue 17): docs/configuration.md is what the parsers
generate; every engine flag has a row in docs/serving.md's flag table whose default is the
parser's; each subcommand's own flags appear in its synopsis; every flag has a help text;
subcommands take only their own flags."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

from kvserve.cli import build_parser
from kvserve.config import EngineArgs

ROOT = Path(__file__).parents[1]
SERVING = (ROOT / "docs" / "serving.md").read_text()
SYNOPSES = SERVING + (ROOT / "docs" / "high-availability.md").read_text()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _table() -> dict[str, str]:
    """docs/serving.md flag-table rows: ``--flag`` → the default cell."""
    rows = {}
    for line in SERVING.splitlines():
        m = re.match(r"\| `--(\[no-\])?([a-z0-9-]+)[^`]*` \| ([^|]*) \|", line)
        if m:
            rows["--" + m.group(2)] = m.group(3).strip()
    return rows


def _synopsis(command: str) -> str:
    m = re.search(rf"```\nkvserve {command} (.*?)```", SYNOPSES, re.S)
    assert m, f"the docs have no synopsis block for kvserve {command}"
    return m.group(1)


def _engine_flags() -> dict[str, argparse.Action]:
    serve = _subparsers(build_parser())["serve"]
    names = {"--" + n.replace("_", "-") for n in EngineArgs.__dataclass_fields__}
    return {o: a for a in serve._actions for o in a.option_strings if o in names}


def test_every_engine_flag_has_a_readme_row_with_its_default():
    rows = _table()
    for flag, action in _engine_flags().items():
        assert flag in rows, f"docs/serving.md's flag table has no row for {flag}"
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
                assert opt in text, f"kvserve {command} {opt} is missing from its synopsis"


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


def test_configuration_reference_is_generated_from_the_parsers():
    spec = importlib.util.spec_from_file_location("gen", ROOT / "scripts" / "gen_config_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (ROOT / "docs" / "configuration.md").read_text() == gen.render(), (
        "docs/configuration.md is stale: python scripts/gen_config_docs.py"
    )


def test_every_flag_of_every_subcommand_has_help():
    def walk(parser: argparse.ArgumentParser, name: str):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    yield from walk(sub, f"{name} {sub_name}")
            elif action.option_strings and action.dest != "help":
                yield name, action

    for name, action in walk(build_parser(), "kvserve"):
        assert action.help, f"{name} {action.option_strings[0]} has no help text"


def test_the_readmes_generate_example_writes_code_not_a_loop():
    import subprocess
    import sys

    readme = (ROOT / "README.md").read_text()
    m = re.search(r"`kvserve generate (--prompt \"[^\"]+\"[^`]*)`", readme)
    assert m, "the README shows no kvserve generate example"
    args = re.findall(r'"[^"]*"|\S+', m.group(1))
    args = [a.strip('"') for a in args]
    out = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "generate", *args, "--kv-cache-memory", "16MiB"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    words = out.stdout.split()
    assert len(words) > 10
    grams = [tuple(words[i : i + 4]) for i in range(len(words) - 3)]
    most = max(grams.count(g) for g in grams)
    assert most <= 3, f"the example loops: {out.stdout[:500]!r}"


def test_the_readmes_gguf_command_finds_the_file():
    """The README's real-model command: its ``$(python -c …)`` prints the GGUF path (the
    package itself cannot be imported without its llama.cpp dependencies)."""
    import subprocess
    import sys

    readme = (ROOT / "README.md").read_text()
    m = re.search(r"kvserve serve --model \"\$\(python -c '([^']+)'\)\"", readme)
    assert m, "the README shows no GGUF serve command"
    out = subprocess.run([sys.executable, "-c", m.group(1)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip())
    assert path.suffix == ".gguf" and path.is_file()
