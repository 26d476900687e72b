"""What a benchmark writes to benchmarks/results/: a JSON report, and Markdown rendered from that JSON alone.

Every benchmark declares what it writes as module-level `Output` constants and writes through them, so each
Markdown file is what rendering its JSON gives, and benchmarks/render_docs.py and tests/test_docs.py can list
which script writes which file (they import the scripts and collect the constants):

    TABLE = Output("decode_speed*", {"": markdown})   # decode_speed.json -> decode_speed.md; `*`: --out's part
    TABLE.write(report, "decode_speed_cuda")           # decode_speed_cuda.json, then decode_speed_cuda.md from it
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

#: Markdown from a JSON report, as read back from its file.
Renderer = Callable[[dict], str]


def named_for(stem: str, model: str | None) -> str:
    """`stem` for the default model (None), else STEM_MODEL with the model's name made an identifier."""
    return stem if model is None else f"{stem}_{re.sub(r'[^0-9A-Za-z]+', '_', model)}"


def _plain(value: object) -> object:
    """What `json` cannot write: numpy and torch scalars as their number, anything else as its text."""
    item = getattr(value, "item", None)
    return item() if callable(item) else str(value)


@dataclass(frozen=True)
class Output:
    """One JSON report a benchmark writes, and the files it writes next to it.

    `stem`: the JSON's name without `.json`; a `*` stands for the part a command-line option chooses.
    `tables`: Markdown rendered from the JSON alone, by the suffix it adds to the stem ("" for STEM.md).
    `extras`: other files written next to it and not rendered from the JSON (plots, pages), by their suffix.
    """

    stem: str
    tables: Mapping[str, Renderer] = field(default_factory=dict)
    extras: tuple[str, ...] = ()

    def named(self, stem: str) -> str:
        """`stem` when this output may be written under it; ArgumentTypeError if not (also argparse's `type=`)."""
        if not fnmatchcase(stem, self.stem):
            raise argparse.ArgumentTypeError(f"{stem!r} is not a results stem of this benchmark ({self.stem})")
        return stem

    def write(self, report: dict, stem: str | None = None, results: Path = RESULTS) -> Path:
        """Write STEM.json, then every table rendered from the JSON as stored (`render`); the JSON's path."""
        stem = self.named(stem or self.stem)
        results.mkdir(parents=True, exist_ok=True)
        path = results / f"{stem}.json"
        path.write_text(json.dumps(report, indent=2, default=_plain) + "\n")
        self.render(stem, results)
        return path

    def render(self, stem: str | None = None, results: Path = RESULTS) -> dict[Path, str]:
        """Write every table of STEM.json next to it, rendered from the file; each path and its text."""
        written = self.rendered(self.named(stem or self.stem), results)
        for path, text in written.items():
            path.write_text(text)
        return written

    def rendered(self, stem: str, results: Path = RESULTS) -> dict[Path, str]:
        """The path and text of every table of STEM.json, rendered from the file; nothing is written."""
        report = json.loads((results / f"{stem}.json").read_text())
        return {results / f"{stem}{suffix}.md": render(report) for suffix, render in self.tables.items()}

    def files(self) -> list[str]:
        """Name patterns (`fnmatch`) of every file this output writes."""
        names = [".json", *(f"{suffix}.md" for suffix in self.tables), *self.extras]
        return [f"{self.stem}{name}" for name in names]

    def stems(self, results: Path = RESULTS) -> list[str]:
        """The stems of this output's JSON reports under `results`."""
        return sorted(path.stem for path in results.glob("*.json") if fnmatchcase(path.stem, self.stem))

    def source(self, name: str) -> str | None:
        """The stem of the JSON that the Markdown file `name` is rendered from, when this output renders it."""
        for suffix in sorted(self.tables, key=len, reverse=True):  # "_summary" before ""
            stem = name.removesuffix(f"{suffix}.md")
            if stem != name and fnmatchcase(stem, self.stem):
                return stem
        return None
