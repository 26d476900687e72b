"""A results log as one Parquet table beside it, so a large sweep loads in one call (pandas, polars, pyarrow).

The JSONL log (`results_log.ResultsLog`) stays the record a run appends to and resumes from; when a
run ends, every row it holds is written to ``<log>.parquet`` (``results.jsonl`` -> ``results.parquet``)
by `pyarrow`. Readers take the table when it is at least as new as the log, else the log itself
(a run that was interrupted, or a log appended to by hand).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from .results_log import Row, read_rows


def table_path(log: Path) -> Path:
    """Where the Parquet table of the log `log` lives: beside it, ``.parquet`` for ``.jsonl``."""
    return log.with_suffix(".parquet")


def write_table(rows: Sequence[Row], log: Path) -> Path:
    """Write `rows` (every row of the log `log`) as its Parquet table; returns the table's path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = table_path(log)
    partial = path.with_suffix(".parquet.partial")
    pq.write_table(pa.Table.from_pylist(list(rows)), partial)
    partial.replace(path)  # readers never see half a table
    return path


def read_results(log: Path) -> pd.DataFrame:
    """The rows of the log `log`: from its Parquet table when that is at least as new, else from the log."""
    path = table_path(log)
    if path.exists() and (not log.exists() or path.stat().st_mtime >= log.stat().st_mtime):
        return pd.read_parquet(path)
    return pd.DataFrame(read_rows(log))
