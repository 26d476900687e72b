"""Render benchmarks/results/*.md from their JSON, then the generated tables of the docs (`DOCS`) from those.

Every benchmark writes a JSON report and the Markdown rendered from it alone, through the `Output`s it
declares (benchmarks/results_io.py); this script renders that Markdown again from the JSON, so a changed
renderer needs no rerun. Every table of the doc sits between two marker lines, with one blank line on each
side of its text:

    <!-- results: NAME.md -->      the whole of benchmarks/results/NAME.md
    <!-- results: NAME.md#K -->    its K-th table (from 1) and the caption paragraph right after it
    <!-- end results -->

Prose stays outside the markers and is never touched. With --check nothing is written: it lists the stale
results files and regions and exits 1 when there are any (tests/test_docs.py runs the same checks).

    python benchmarks/render_docs.py [--check]
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

from results_io import RESULTS, Output

HERE = Path(__file__).resolve().parent
DOC = HERE.parent / "docs" / "benchmarks.md"
#: The docs with generated tables: every benchmark's in DOC, the vLLM plugin's serving table in its own page too.
DOCS = (DOC, HERE.parent / "docs" / "vllm.md")
#: The modules of this folder that are not benchmarks.
HELPERS = ("render_docs", "results_io", "gates_provenance", "policy_args")
START = re.compile(r"<!-- results: (?P<name>[\w.-]+\.md)(?:#(?P<table>\d+))? -->")
END = "<!-- end results -->"


class RenderError(ValueError):
    """A marker the renderer cannot follow: malformed, unclosed, or naming a missing file or table."""


def _tables(lines: list[str]) -> list[tuple[int, int]]:
    """(start, stop) line spans of each table, its caption paragraph (a plain paragraph right after it) included."""
    spans, i = [], 0
    while i < len(lines):
        if not lines[i].startswith("|"):
            i += 1
            continue
        start = i
        while i < len(lines) and lines[i].startswith("|"):
            i += 1
        stop, j = i, i
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j > i and j < len(lines) and not lines[j].startswith(("|", "#", "!", "<")):
            while j < len(lines) and lines[j].strip():
                j += 1
            stop = i = j
        spans.append((start, stop))
    return spans


def results_text(name: str, table: int | None, results: Path = RESULTS) -> str:
    """The text a marker stands for: a results file without its outer blank lines, or its `table`-th table."""
    path = results / name
    if not path.is_file():
        raise RenderError(f"the marker '{name}' names {path}, which does not exist")
    text = path.read_text().strip("\n")
    if table is None:
        return text
    lines, spans = text.splitlines(), _tables(text.splitlines())
    if not 1 <= table <= len(spans):
        raise RenderError(f"the marker '{name}#{table}' asks for table {table}; {path} has {len(spans)}")
    start, stop = spans[table - 1]
    return "\n".join(lines[start:stop])


def _marker(line: str, number: int) -> tuple[str, int | None] | None:
    """The (file, table) a start marker names; None for any other line."""
    if not line.startswith("<!-- results"):
        return None
    match = START.fullmatch(line.strip())
    if match is None:
        raise RenderError(f"line {number}: malformed marker {line!r} (expected '<!-- results: NAME.md[#K] -->')")
    return match["name"], None if match["table"] is None else int(match["table"])


def render(doc: str, results: Path = RESULTS) -> tuple[str, list[str], list[str]]:
    """The doc with every marked region rewritten, the regions' labels, and the labels of those that changed."""
    lines, out, labels, stale = doc.split("\n"), [], [], []
    i = 0
    while i < len(lines):
        out.append(lines[i])
        marker = _marker(lines[i], i + 1)
        if marker is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == END), None)
        inner = lines[i + 1 : end]
        if end is None or any(_marker(line, i + 1) for line in inner):
            raise RenderError(f"line {i + 1}: marker {lines[i].strip()!r} has no '{END}' before the next one")
        label = marker[0] + ("" if marker[1] is None else f"#{marker[1]}")
        fresh = ["", *results_text(*marker, results=results).split("\n"), ""]
        labels.append(label)
        if inner != fresh:
            stale.append(label)
        out += [*fresh, lines[end]]
        i = end + 1
    return "\n".join(out), labels, stale


def check(doc: Path = DOC, results: Path = RESULTS) -> list[str]:
    """The labels of the regions of `doc` that differ from their results files (empty: up to date)."""
    return render(doc.read_text(), results)[2]


def outputs() -> dict[str, list[Output]]:
    """Each benchmark of this folder, by script name, and the outputs it declares (its module-level `Output`s).

    The scripts are imported as top-level modules: this folder must be on `sys.path` (it is when a script runs).
    """
    found = {}
    for path in sorted(HERE.glob("*.py")):
        if path.stem not in HELPERS:
            module = importlib.import_module(path.stem)
            found[path.stem] = [value for value in vars(module).values() if isinstance(value, Output)]
    return found


def stale_results(declared: dict[str, list[Output]], results: Path = RESULTS) -> dict[Path, str]:
    """Every Markdown results file that differs from rendering its JSON (or is missing), with the rendered text."""
    stale = {}
    for output in (output for found in declared.values() for output in found):
        for stem in output.stems(results):
            for path, text in output.rendered(stem, results).items():
                if not path.is_file() or path.read_text() != text:
                    stale[path] = text
    return stale


def main(argv: list[str] | None = None) -> int:
    """Render the results files, then the docs' regions (or only check both); 1 when --check finds stale ones."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when anything is stale")
    parser.add_argument("--doc", type=Path, action="append", help="a doc to render (default: every one of DOCS)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    files = stale_results(outputs(), args.results)
    for path, text in files.items():
        print(f"{path.name}: {'stale' if args.check else 're-rendered'} (not what its JSON renders to)")
        if not args.check:
            path.write_text(text)
    stale_regions = sum(render_doc(doc, args.results, args.check) for doc in args.doc or DOCS)
    if args.check:
        advice = ", run render_docs.py" if files or stale_regions else ""
        print(f"{len(files)} results files stale; {stale_regions} doc regions stale{advice}")
        return 1 if files or stale_regions else 0
    print(f"{len(files)} results files re-rendered; {stale_regions} doc regions rewritten")
    return 0


def render_doc(doc: Path, results: Path, check_only: bool) -> int:
    """Render (or only check) the generated regions of one doc; how many were stale."""
    text, labels, stale = render(doc.read_text(), results)
    for label in labels:
        state = "stale" if label in stale and check_only else "rewritten" if label in stale else "up to date"
        print(f"{doc.name} {label}: {state}")
    if stale and not check_only:
        doc.write_text(text)
    return len(stale)


if __name__ == "__main__":
    sys.exit(main())
