"""BENCHMARKS.md is what ``benchmarks/reference.py`` renders from the result files: CI
regenerates it and fails on any difference, so a figure cannot go stale on the page."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def _reference():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("reference", ROOT / "benchmarks" / "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_is_what_the_result_files_say():
    assert _reference().main(["--check"]) == 0, "rerun: python benchmarks/reference.py"


def test_a_changed_result_changes_the_page(tmp_path, monkeypatch):
    ref = _reference()
    results = tmp_path / "results"
    shutil.copytree(ROOT / "benchmarks" / "results", results)
    path = results / "offline_real_int8.json"
    data = json.loads(path.read_text())
    data["results"]["vllm"]["median_output_tok_s"] *= 2
    path.write_text(json.dumps(data))
    monkeypatch.setattr(ref, "RESULTS", results)
    assert ref.main(["--check"]) == 1
    page = ref.render()
    assert "661.7" in page and "**0.85×**" not in page and "0.85×" in page


def test_every_figure_names_a_result_file_and_a_notebook_section():
    ref = _reference()
    headings = [
        line[3:] for line in (ROOT / ref.NOTEBOOK).read_text().splitlines()
        if line.startswith("## ")
    ]  # fmt: skip
    for figure in ref.FIGURES:
        assert all((ref.RESULTS / name).is_file() for name in figure.result), figure.capability
        assert ref._anchor(figure.section, headings)
