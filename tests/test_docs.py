"""docs/benchmarks.md carries the tables of benchmarks/results/*.md verbatim, and each of those is what the
benchmark script that writes it renders from its JSON (benchmarks/render_docs.py, benchmarks/results_io.py)."""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import re
import shutil
import sys
from fnmatch import fnmatchcase
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from conftest import tiny_llama
from kvsieve.modeling.gates import RetentionGates, gate_shape
from kvsieve.selection import checkpoint
from kvsieve.selection.checkpoint import TrainRecord, model_fingerprint, save_gates
from kvsieve.selection.merge import WindowMerge
from kvsieve.selection.projection import Chunks

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"


def _benchmarks_module(name: str) -> ModuleType:
    """A module of benchmarks/, which is no package: its scripts import its helpers by name, so it goes on sys.path."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


render_docs = _benchmarks_module("render_docs")
results_io = _benchmarks_module("results_io")


@pytest.fixture(scope="module")
def declared() -> dict[str, list]:
    """Every benchmark script and the outputs it declares (imports them all, without running any)."""
    return render_docs.outputs()


def _writers(name: str, declared: dict[str, list]) -> list[str]:
    """The scripts whose declared outputs include a file called `name`."""
    return [
        script
        for script, outputs in declared.items()
        if any(fnmatchcase(name, pattern) for output in outputs for pattern in output.files())
    ]


def _markers(text: str) -> list[str]:
    """The results files the doc's generated regions copy, in order (a region's label is NAME.md or NAME.md#K)."""
    return [label.split("#")[0] for label in render_docs.render(text)[1]]


def test_every_table_of_the_doc_sits_in_a_generated_region() -> None:
    inside, loose = False, []
    for number, line in enumerate(DOC.read_text().split("\n"), 1):
        if line.startswith("<!-- results"):
            inside = True
        elif line.strip() == render_docs.END:
            inside = False
        elif line.startswith("|") and not inside:
            loose.append(number)
    assert loose == [], f"docs/benchmarks.md has table lines outside <!-- results --> markers: {loose}"


def test_every_benchmark_declares_what_it_writes(declared: dict[str, list]) -> None:
    silent = [script for script, outputs in declared.items() if not outputs]
    assert silent == [], f"benchmarks declaring no Output (benchmarks/results_io.py): {silent}"
    assert len(declared) >= 20


def test_every_results_file_is_written_by_one_script(declared: dict[str, list]) -> None:
    files = sorted(path.name for path in RESULTS.iterdir() if path.is_file())
    claims = {name: _writers(name, declared) for name in files}
    assert {name: who for name, who in claims.items() if len(who) != 1} == {}, "no script, or several, write these"


def test_every_results_file_the_doc_cites_exists_and_a_script_writes_it(declared: dict[str, list]) -> None:
    text = DOC.read_text()
    # results files are named in lower case; the doc's intro writes the placeholder benchmarks/results/NAME.md
    cited = set(_markers(text)) | set(re.findall(r"benchmarks/results/([a-z0-9_.-]+\.[a-z]+)", text))
    assert len(cited) > 40
    missing = sorted(name for name in cited if not (RESULTS / name).is_file())
    assert missing == [], f"docs/benchmarks.md cites results files that do not exist: {missing}"
    assert {name: who for name in cited if len(who := _writers(name, declared)) != 1} == {}


def test_every_table_of_the_doc_is_rendered_from_json(declared: dict[str, list]) -> None:
    outputs = [output for found in declared.values() for output in found]
    for name in _markers(DOC.read_text()):
        sources = [stem for output in outputs if (stem := output.source(name)) is not None]
        assert len(sources) == 1, f"{name}: rendered by {len(sources)} declared outputs, not one"
        assert (RESULTS / f"{sources[0]}.json").is_file(), f"{name}: its JSON {sources[0]}.json is missing"


def test_results_markdown_is_what_its_json_renders_to(declared: dict[str, list]) -> None:
    stale = sorted(path.name for path in render_docs.stale_results(declared))
    assert stale == [], f"{stale} differ from rendering their JSON: run python benchmarks/render_docs.py"


@pytest.mark.parametrize("doc", render_docs.DOCS, ids=lambda doc: doc.name)
def test_each_doc_matches_results(doc: Path) -> None:
    stale = render_docs.check(doc, RESULTS)
    assert stale == [], f"docs/{doc.name} is stale in {stale}: run python benchmarks/render_docs.py"


def test_a_changed_json_makes_its_markdown_and_the_doc_stale_until_rendered(
    tmp_path: Path, declared: dict[str, list]
) -> None:
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results, ignore=shutil.ignore_patterns("*.png"))
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC.read_text())
    report = json.loads((results / "decode_speed.json").read_text())
    report["rows"][0]["cache"] = "full (rerun)"
    (results / "decode_speed.json").write_text(json.dumps(report))
    assert list(render_docs.stale_results(declared, results)) == [results / "decode_speed.md"]
    assert render_docs.check(doc, results) == []  # the doc follows the Markdown, which is not rendered yet
    assert render_docs.main(["--check", "--doc", str(doc), "--results", str(results)]) == 1
    assert render_docs.main(["--doc", str(doc), "--results", str(results)]) == 0
    assert render_docs.stale_results(declared, results) == {}
    assert render_docs.check(doc, results) == []
    assert "| full (rerun) |" in (results / "decode_speed.md").read_text()
    assert "| full (rerun) |" in doc.read_text()


def test_an_output_renders_from_the_stored_json_under_its_own_stems(tmp_path: Path) -> None:
    output = results_io.Output("demo*", {"": lambda r: f"{r['x']} {r['pair']}\n", "_summary": lambda r: "sum\n"})
    path = output.write({"x": np.float32(1.5), "pair": (1, 2)}, "demo_a", results=tmp_path)
    assert path == tmp_path / "demo_a.json"
    assert (tmp_path / "demo_a.md").read_text() == "1.5 [1, 2]\n"  # the tuple as the JSON stores it
    assert (tmp_path / "demo_a_summary.md").read_text() == "sum\n"
    assert output.files() == ["demo*.json", "demo*.md", "demo*_summary.md"]
    assert output.stems(tmp_path) == ["demo_a"]
    assert output.source("demo_a_summary.md") == output.source("demo_a.md") == "demo_a"
    assert output.source("other.md") is None
    with pytest.raises(argparse.ArgumentTypeError, match="'other' is not a results stem"):
        output.write({}, "other", results=tmp_path)
    assert not (tmp_path / "other.json").exists()


def test_a_marker_naming_a_missing_results_file_is_an_error(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC.read_text() + "\n<!-- results: no_such_benchmark.md -->\n<!-- end results -->\n")
    with pytest.raises(render_docs.RenderError, match=r"'no_such_benchmark\.md' names .*no_such_benchmark\.md"):
        render_docs.check(doc, RESULTS)
    doc.write_text("<!-- results: decode_speed.md#9 -->\n<!-- end results -->\n")
    with pytest.raises(render_docs.RenderError, match=r"asks for table 9; .* has 1"):
        render_docs.check(doc, RESULTS)


def test_a_report_names_the_shipped_gates_its_trimkv_rows_read(tmp_path, monkeypatch):
    provenance = _benchmarks_module("gates_provenance")
    model = tiny_llama()
    assert provenance.default_gates(model) is None, "no shipped checkpoint was trained for a random model"
    assert provenance.gates_note(None) == ""
    record = TrainRecord("tiny", model_fingerprint(model), 8, "global", 1.0, 3, 48, 0, {}, 1.5)
    for seed, name in enumerate(("replaced-tiny", "tiny")):  # the default is the one named after the model
        torch.manual_seed(seed)
        save_gates(RetentionGates(gate_shape(model, width=8)), record, tmp_path / name)
    monkeypatch.setattr(checkpoint, "SHIPPED", tmp_path)
    gates = provenance.default_gates(model)
    weights = {folder.name: (folder / checkpoint.WEIGHTS_FILE).read_bytes() for folder in tmp_path.iterdir()}
    digests = {name: hashlib.sha256(data).hexdigest()[:12] for name, data in weights.items()}
    assert digests["tiny"] != digests["replaced-tiny"]
    assert gates == {"name": "tiny", "sha256": digests["tiny"]}
    assert provenance.gates_note(gates) == f" `trimkv` read the shipped gates `tiny` (weights {digests['tiny']})."
    recording = RetentionGates(gate_shape(model, width=8), projection=Chunks(chunk_size=4), merge=WindowMerge(parts=4))
    save_gates(recording, record, tmp_path / "tiny")
    gates = provenance.default_gates(model)
    assert gates["projection"] == "projection=chunk,chunk_size=4" and gates["merge"] == "merge=window,parts=4"
    assert provenance.gates_note(gates).endswith(
        "(weights " + gates["sha256"] + ", `projection=chunk,chunk_size=4` and `merge=window,parts=4` where a policy "
        "names none)."
    )
