"""The package's shape: no import cycles (counting imports inside functions and under
TYPE_CHECKING), files of one job (no module over 500 lines, the engine core's
``llm_engine.py`` at most 300)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvserve

ROOT = Path(kvserve.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Every kvserve module a module imports, at any level (TYPE_CHECKING included)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in mods and t != name)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*path[path.index(n) :], n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycles():
    assert _cycle(_imports(_modules())) is None


def test_a_cycle_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_module_sizes():
    sizes = {name: len(p.read_text().splitlines()) for name, p in _modules().items()}
    assert {n: s for n, s in sizes.items() if s > 500} == {}
    assert sizes["kvserve.engine.llm_engine"] <= 300
