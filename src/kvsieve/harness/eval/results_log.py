"""A results log: rows appended to a JSONL file as they are made, so an interrupted run resumes where it stopped."""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def read_rows(path: Path) -> list[Row]:
    """The rows of a results file (a partly written last line, from an interrupted run, is dropped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class StaleRowsError(ValueError):
    """A results file holds rows that this run would make otherwise (resuming would mix the two)."""


class ResultsLog:
    """Every row of a run, old and new; `path=None` keeps them in memory only.

    Args:
        path: the JSONL file; the rows it holds are read back, new rows are appended.
        key: what identifies a row (a rerun skips the keys it already holds).
        made_by: the fields that say what made a row, which its key does not (e.g. the retention gates a
            policy read): added to each new row, and checked on the rows read back: a row whose fields
            differ is an error (`StaleRowsError`), never a row silently kept.
    """

    def __init__(
        self, path: str | Path | None, key: Callable[[Row], Hashable], made_by: Callable[[Row], Row] | None = None
    ) -> None:
        self.path = Path(path) if path is not None else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.key = key
        self.made_by = made_by or (lambda row: {})
        self.rows = read_rows(self.path) if self.path else []
        self._check_made_by()
        self.done = {key(r) for r in self.rows}
        if self.path and self.path.exists() and self.path.stat().st_size and not self.path.read_bytes().endswith(b"\n"):
            with self.path.open("a") as f:  # an interrupted write left half a line: new rows start on their own
                f.write("\n")

    def __contains__(self, key: Hashable) -> bool:
        return key in self.done

    def extend(self, rows: list[Row]) -> None:
        """Add `rows` (a cell's), written to the file together in one write."""
        rows = [row | self.made_by(row) for row in rows]
        self.rows += rows
        self.done |= {self.key(row) for row in rows}
        if self.path:
            with self.path.open("a") as f:
                f.write("".join(json.dumps(row) + "\n" for row in rows))

    def _check_made_by(self) -> None:
        """A clear error if a row read back was made otherwise than this run would make it."""
        stale = [(row, made) for row in self.rows if (made := self.made_by(row)) and _differs(row, made)]
        if not stale:
            return
        row, made = stale[0]
        was = {name: row.get(name, "(not recorded)") for name in made}
        raise StaleRowsError(
            f"{self.path} holds {len(stale)} rows made otherwise than this run would make them, e.g. {self.key(row)} "
            f"with {was}, where this run has {made}. Write to another results file, or remove those rows to make "
            "them again"
        )


def _differs(row: Row, made: Row) -> bool:
    return any(row.get(name) != value for name, value in made.items())
