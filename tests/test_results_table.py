"""Results as Parquet beside the JSONL log: the same rows, read back in one call, and the log when it is newer."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pandas as pd
import pytest
import torch

from extras import needs_kvpress
from kvsieve.harness.eval import run_sweep
from kvsieve.harness.eval.contract_diagnostic import run_diagnostic
from kvsieve.harness.eval.results_log import read_rows
from kvsieve.harness.eval.results_table import read_results, table_path, write_table
from kvsieve.harness.report.diagnostic_page import load_diagnostic
from kvsieve.harness.report.html import RESULTS_FILE, load_results
from kvsieve.harness.runners import LocalRunner
from test_sweep import make_sample


def _same_rows(table: pd.DataFrame, rows: list[dict]) -> None:
    """The table holds exactly `rows`, every column and value (lists as lists), in order."""
    assert list(table.columns) == list(dict.fromkeys(key for row in rows for key in row))
    assert len(table) == len(rows)
    for got, expected in zip(table.to_dict("records"), rows, strict=True):
        for key, value in expected.items():
            cell = got[key]
            if isinstance(value, list):
                assert list(cell) == pytest.approx(value), key
            elif isinstance(value, float):
                assert cell == pytest.approx(value, nan_ok=True), key
            else:
                assert cell == value, key


@needs_kvpress
@torch.no_grad()
def test_a_sweep_writes_its_rows_as_parquet_and_the_report_reads_them(lm, tok, tmp_path):
    log = tmp_path / RESULTS_FILE
    rows = run_sweep(
        LocalRunner(lm, tok), [make_sample(0)], "snapkv,kvpress:knorm", [0.5], ("agnostic", "aware"), results=log
    )
    assert table_path(log) == tmp_path / "results.parquet" and table_path(log).exists()
    table = pd.read_parquet(table_path(log))
    _same_rows(table, read_rows(log))
    assert table["recall_by_layer"].map(len).eq(len(lm.model.layers)).all(), "per-layer lists survive"
    _same_rows(load_results(tmp_path), read_rows(log))
    assert len(rows) == len(table) == 6
    # a row appended to the log by hand (after the table): the report reads the log
    extra = read_rows(log)[0] | {"sample": "by hand"}
    with log.open("a") as f:
        f.write(json.dumps(extra) + "\n")
    later = table_path(log).stat().st_mtime + 1
    os.utime(log, (later, later))
    assert len(load_results(tmp_path)) == 7 and "by hand" in set(load_results(tmp_path)["sample"])
    # a resumed run with nothing to do writes the table again: every row, the hand-made one included
    run_sweep(LocalRunner(lm, tok), [make_sample(0)], "snapkv,kvpress:knorm", [0.5], ("agnostic", "aware"), results=log)
    _same_rows(pd.read_parquet(table_path(log)), read_rows(log))


@torch.no_grad()
def test_a_diagnostic_writes_its_rows_as_parquet(lm, tok, tmp_path):
    sample = replace(make_sample(1, "7654321"), candidates=(" 1234567", " 5555555"))
    log = tmp_path / "diagnostic.jsonl"
    run_diagnostic(LocalRunner(lm, tok), [sample], ["snapkv"], [0.6], ("agnostic",), results=log)
    _same_rows(load_diagnostic(tmp_path), read_rows(log))
    assert table_path(log).exists()


def test_without_a_table_the_log_is_read_and_an_empty_folder_is_named(tmp_path):
    log = tmp_path / "results.jsonl"
    rows = [{"policy": "full", "rate": 0.0, "ids": [1, 2]}, {"policy": "snapkv", "rate": 0.5, "ids": [3]}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _same_rows(read_results(log), rows)
    write_table(rows[:1], log)  # a table older than the log is not read
    os.utime(log, (table_path(log).stat().st_mtime + 1,) * 2)
    assert len(read_results(log)) == 2
    with pytest.raises(FileNotFoundError, match="holds no sweep rows; run `kvsieve sweep --out"):
        load_results(tmp_path / "empty")
