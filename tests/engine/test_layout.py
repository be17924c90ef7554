"""The package's shape: no import cycles between modules (counting imports inside functions
and under TYPE_CHECKING) nor between packages, ``kv/`` bookkeeping only, files of one job
(no module over 500 lines, the engine core's ``llm_engine.py`` at most 300)."""

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


def _packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between packages (``kvserve.kv``; a top-level module is its own entry):
    A -> B when some module of A imports one of B."""

    def package(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2])

    packages: dict[str, set[str]] = {package(m): set() for m in graph}
    for module, targets in graph.items():
        packages[package(module)].update(package(t) for t in targets)
    for name, targets in packages.items():
        targets.discard(name)
    return packages


def test_no_package_cycles():
    """Packages form layers (model below kv below store below sched below worker below
    engine below server below router): a cycle would let each of them reach any other."""
    assert _cycle(_packages(_imports(_modules()))) is None


def test_kv_is_bookkeeping():
    """``kv/`` holds block tables, hashes and events; the tensors live in ``model/``."""
    for path in (ROOT / "kv").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names] if isinstance(node, ast.Import)
                else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            )  # fmt: skip
            assert not [n for n in names if n.split(".")[0] == "torch"], path.name


def test_packages_graph():
    graph = {"kvserve.kv.a": {"kvserve.model.b"}, "kvserve.model.b": {"kvserve.kv.c"},
             "kvserve.kv.c": set()}  # fmt: skip
    assert _packages(graph) == {"kvserve.kv": {"kvserve.model"}, "kvserve.model": {"kvserve.kv"}}
    assert _cycle(_packages(graph)) == ["kvserve.kv", "kvserve.model", "kvserve.kv"]


def test_a_cycle_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_module_sizes():
    sizes = {name: len(p.read_text().splitlines()) for name, p in _modules().items()}
    assert {n: s for n, s in sizes.items() if s > 500} == {}
    assert sizes["kvserve.engine.llm_engine"] <= 300


def _setattr_targets(tree: ast.AST) -> list[str]:
    """The first argument of every ``setattr(...)`` call, as source."""
    return [
        ast.unparse(node.args[0])
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        and node.func.id == "setattr" and node.args
    ]  # fmt: skip


def _deep_assignments(tree: ast.AST) -> list[str]:
    """Assignments into a part of the object or engine at hand (``self.runner.host_swap =
    …``, ``engine.replicator.pusher.secret = …``), as source."""
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else []
        )  # fmt: skip
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Attribute):
                root = t.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in ("self", "engine"):
                    found.append(ast.unparse(t))
    return found


def test_no_setattr_wiring():
    """Parts are built by their constructors: no ``setattr`` anywhere (model surgery goes
    through ``register_module``; the one exception silences ``torch.nn.init`` while a
    model is built on the meta device), and the engine assembles nothing into a part
    after building it."""
    calls = {
        name: targets
        for name, path in _modules().items()
        if (targets := [t for t in _setattr_targets(ast.parse(path.read_text()))
                        if t != "torch.nn.init"])
    }  # fmt: skip
    assert calls == {}
    engine = {
        name: found
        for name, path in _modules().items()
        if name.startswith("kvserve.engine.")
        and (found := _deep_assignments(ast.parse(path.read_text())))
    }
    assert engine == {}


def test_wiring_checks_find_it():
    tree = ast.parse(
        "setattr(self, 'kv', kv)\nself.runner.host_swap = s\nself.kv = kv\nr.request.n = 1\n"
    )
    assert _setattr_targets(tree) == ["self"]
    assert _deep_assignments(tree) == ["self.runner.host_swap"]


def test_the_engine_step_reads_as_three_moves():
    """``LLMEngine.step()`` is schedule → execute → update, at most 15 lines (docstring
    aside); the bookkeeping is the scheduler's ``update_from_output``."""
    tree = ast.parse((ROOT / "engine" / "llm_engine.py").read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LLMEngine")
    step = next(n for n in engine.body if isinstance(n, ast.FunctionDef) and n.name == "step")
    body = step.body[1:] if isinstance(step.body[0], ast.Expr) else step.body
    assert body[-1].end_lineno - body[0].lineno + 1 <= 15
    calls = {n.func.attr for n in ast.walk(step) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute)}  # fmt: skip
    assert {"schedule", "update_from_output"} <= calls
