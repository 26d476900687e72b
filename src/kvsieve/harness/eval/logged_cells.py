"""A protocol's cells run into its results log: each cell's rows appended once, when the cell is done."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ..progress import ProgressCallback
from ..runners import Runner, Work
from .results_log import ResultsLog, Row
from .results_table import write_table


class LoggedCell(Protocol):
    @property
    def size(self) -> int:
        """Rows the cell makes (its share of the progress)."""
        ...


def run_logged(
    runner: Runner,
    work: Work[LoggedCell, list[Row]],
    cells: Sequence[LoggedCell],
    log: ResultsLog,
    total: int,
    progress: ProgressCallback | None = None,
) -> None:
    """Run `cells` on `runner`, appending each one's rows to `log` in the cells' order; write the Parquet table.

    A cell's rows reach the log together, after the cell is done, so a run killed mid-cell leaves
    none of them and a resumed run makes the cell again. `total`: rows of the whole run, old ones too.
    """
    done = total - sum(cell.size for cell in cells)
    if progress:
        progress(done, total)
    for cell, rows in zip(cells, runner.map(work, cells), strict=True):
        log.extend(rows)
        done += cell.size
        if progress:
            progress(done, total)
    if log.path:
        write_table(log.rows, log.path)
