"""docs/benchmarks.md carries the tables of benchmarks/results/*.md verbatim (benchmarks/render_docs.py)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "benchmarks" / "results"


def _renderer() -> ModuleType:
    """benchmarks/render_docs.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("render_docs", ROOT / "benchmarks" / "render_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render_docs = _renderer()


def test_benchmarks_doc_matches_results() -> None:
    stale = render_docs.check(DOC, RESULTS)
    assert stale == [], f"docs/benchmarks.md is stale in {stale}: run python benchmarks/render_docs.py"


def test_a_changed_results_file_makes_the_doc_stale_until_rendered(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results, ignore=shutil.ignore_patterns("*.json", "*.png"))
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC.read_text())
    table = results / "decode_speed.md"
    table.write_text(table.read_text().replace("| full |", "| full (rerun) |", 1))
    assert render_docs.check(doc, results) == ["decode_speed.md"]
    assert render_docs.main(["--check", "--doc", str(doc), "--results", str(results)]) == 1
    assert render_docs.main(["--doc", str(doc), "--results", str(results)]) == 0
    assert render_docs.check(doc, results) == []
    assert "| full (rerun) |" in doc.read_text()


def test_a_marker_naming_a_missing_results_file_is_an_error(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC.read_text() + "\n<!-- results: no_such_benchmark.md -->\n<!-- end results -->\n")
    with pytest.raises(render_docs.RenderError, match=r"'no_such_benchmark\.md' names .*no_such_benchmark\.md"):
        render_docs.check(doc, RESULTS)
    doc.write_text("<!-- results: decode_speed.md#9 -->\n<!-- end results -->\n")
    with pytest.raises(render_docs.RenderError, match=r"asks for table 9; .* has 1"):
        render_docs.check(doc, RESULTS)
