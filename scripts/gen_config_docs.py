"""Write docs/configuration.md from the CLI's own parsers (every flag, default, choices
and help text), so the reference cannot drift from ``kvserve --help``.

    python scripts/gen_config_docs.py

tests/test_cli_docs.py fails when docs/configuration.md is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "docs" / "configuration.md"

from kvserve.cli import build_parser  # noqa: E402
from kvserve.config import EngineArgs  # noqa: E402

INTRO = """# Configuration reference

Generated from the CLI's parsers by `scripts/gen_config_docs.py`; do not edit. Engine
flags map one-to-one to `kvserve.EngineArgs` fields (`--max-num-seqs` is `max_num_seqs`,
for `LLM(...)` too) and are the same for `generate`, `serve` and `eval perplexity`, except
that the cluster flags exist only on `serve`. `--log-level` goes before or after the
subcommand. Environment: `KVSERVE_CLUSTER_SECRET` (the cluster secret),
`KVSERVE_CACHE_DIR` (converted GGUF checkpoints), `KVSERVE_NO_MALLOC_TUNING=1`,
`KVSERVE_HUGEPAGES=0` (no huge pages for the KV cache and weights), `KVSERVE_TCMALLOC`
(`0`: no tcmalloc for a CPU engine core; a path: that library),
`TORCH_EXTENSIONS_DIR` (CPU kernels compiled at a first start go to its `kvserve/`),
`KVSERVE_PREBUILT_KERNELS=0` (ignore the CPU kernels compiled at install),
`KVSERVE_KERNEL_BUILD_TIMEOUT` (seconds a start waits for another's kernel build, 900).
"""


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _rows(parser: argparse.ArgumentParser, keep) -> list[str]:
    rows = []
    for a in parser._actions:
        if not a.option_strings or a.dest in ("help", "log_level") or not keep(a):
            continue
        flags = ", ".join(f"`{o}`" for o in a.option_strings)
        if a.default is argparse.SUPPRESS or a.default in (None, [], ()):
            default = ""
        else:
            default = f"`{a.default}`"
        choices = ", ".join(f"`{c}`" for c in a.choices) if a.choices else ""
        text = (a.help or "").replace(" (default: %(default)s)", "")
        rows.append(f"| {flags} | {default} | {_cell(choices)} | {_cell(text)} |")
    return rows


def _table(rows: list[str]) -> str:
    return "\n".join(["| flag | default | choices | meaning |", "|---|---|---|---|", *rows])


def render() -> str:
    parser = build_parser()
    subs = _subparsers(parser)
    engine = set(EngineArgs.__dataclass_fields__)
    parts = [INTRO, "## Engine flags (`generate`, `serve`, `eval perplexity`)\n"]
    parts.append(_table(_rows(subs["serve"], lambda a: a.dest in engine)))
    commands = [(name, sub) for name, sub in subs.items()]
    for name, sub in commands:
        nested = _subparsers(sub)
        for sub_name, parser_ in nested.items() if nested else [("", sub)]:
            rows = _rows(parser_, lambda a: a.dest not in engine or a.dest == "model")
            if not rows:
                continue
            title = f"kvserve {name} {sub_name}".strip()
            parts.append(f"\n## `{title}`\n\n{_cell(parser_.description or '')}\n".rstrip() + "\n")
            parts.append(_table(rows))
    return "\n".join(parts) + "\n"


def main() -> int:
    OUT.write_text(render())
    print(f"wrote {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
