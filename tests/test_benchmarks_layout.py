"""benchmarks/ is sorted by what a script measures — ``peers/`` (kvserve beside another
engine), ``kernels/`` (one kernel or op, A/B), ``features/`` (a capability's scenario) —
and its scripts share code through ``kvserve.testing`` (the tests' harness too), never by
putting another folder on ``sys.path``."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

BENCH = Path(__file__).parents[1] / "benchmarks"
FOLDERS = ("peers", "kernels", "features")
TOP = ("figures.py", "reference.py")  # BENCHMARKS.md's table and its renderer
# what only a peer's own environment has (the scripts import it inside the peer's run)
PEER_ONLY = {"vllm", "llama_cpp"}


def _scripts() -> list[Path]:
    return sorted(p for p in BENCH.rglob("*.py") if ".models" not in p.parts)


def test_every_script_is_in_its_folder():
    for path in _scripts():
        rel = path.relative_to(BENCH)
        if len(rel.parts) == 1:
            assert rel.name in TOP, f"{rel}: put it in one of {FOLDERS}"
        else:
            assert len(rel.parts) == 2 and rel.parts[0] in FOLDERS, rel


def test_scripts_import_installed_modules_or_their_own_folder():
    stems = {p.stem: p.parent for p in _scripts()}
    for path in _scripts():
        source = path.read_text()
        assert "sys.path" not in source, f"{path.relative_to(BENCH)} edits sys.path"
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in stems:
                    assert stems[top] == path.parent, (
                        f"{path.relative_to(BENCH)} imports {top} from another folder: "
                        "move what they share to kvserve/testing"
                    )
                elif top not in PEER_ONLY:
                    assert importlib.util.find_spec(top) is not None, (path.name, top)
