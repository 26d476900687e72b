"""A diagnostic folder (`kvsieve diagnose --out DIR`) -> `diagnostic.md` with its tables and the worked case."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from ..eval.attribution import MODES_OF_FAILURE
from ..eval.contract_diagnostic import ATTENTION_MASS
from ..eval.diagnostic_tables import failure_mix, fixes, raises_margin, worked_case
from ..eval.results_table import read_results
from .tables import markdown_table

DIAGNOSTIC_FILE = "diagnostic.jsonl"
DIAGNOSTIC_MANIFEST = "diagnostic.json"
DIAGNOSTIC_PAGE = "diagnostic.md"
WORKED_MAP = "worked_case.png"


def load_diagnostic(folder: str | Path) -> pd.DataFrame:
    """The rows of a diagnostic folder: its Parquet table, or its results log where that is newer."""
    path = Path(folder) / DIAGNOSTIC_FILE
    rows = read_results(path)
    if rows.empty:
        raise FileNotFoundError(f"{path} holds no diagnostic rows; run `kvsieve diagnose --out {folder}` first")
    return rows


def _pct(value: float, interval: list[float] | None = None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    text = f"{100 * value:.0f}%"
    return f"{text} [{100 * interval[0]:.0f}, {100 * interval[1]:.0f}]" if interval else text


def raises_markdown(rows: pd.DataFrame) -> str:
    table = raises_margin(rows)
    body = [
        [
            r.policy,
            f"{r.rate:.0%}",
            f"{_pct(r.positive, r.positive_ci)} (n={r.n_positive})",
            f"{_pct(r.non_positive, r.non_positive_ci)} (n={r.n_non_positive})",
        ]
        for r in table.itertuples()
    ]
    return markdown_table(["scalar", "rate", "positive-margin cases", "non-positive cases"], body)


def failures_markdown(rows: pd.DataFrame) -> str:
    table = failure_mix(rows)
    header = ["scalar", "rate", "cases", "failures", *MODES_OF_FAILURE, "oracle repairs"]
    columns = ["cases", "failures", *MODES_OF_FAILURE, "oracle_repairs"]
    body = [[r["policy"], f"{r['rate']:.0%}", *(str(r[c]) for c in columns)] for _, r in table.iterrows()]
    return markdown_table(header, body)


def fixes_markdown(rows: pd.DataFrame) -> str:
    table = fixes(rows)
    body = [
        [
            r.contract,
            r.mode,
            f"{r.rate:.0%}",
            str(r.cases),
            _pct(r.accuracy),
            f"{r.margin:+.2f} [{r.margin_ci[0]:+.2f}, {r.margin_ci[1]:+.2f}]",
        ]
        for r in table.itertuples()
    ]
    return markdown_table(["contract", "mode", "rate", "cases", "accuracy", "mean margin"], body)


def worked_markdown(rows: pd.DataFrame) -> str:
    case = worked_case(rows)
    if case is None:
        return "No failure of attention mass in these rows."
    failure = case[case["scalar"] & (case["policy"] == ATTENTION_MASS)].iloc[0]
    lines = [
        f"Case `{failure['sample']}` ({failure['task']}, {failure['mode']}), rate {failure['rate']:.0%}: "
        f"attention mass fails (margin {failure['margin']:+.2f}, full cache {failure['full_margin']:+.2f}); "
        f"attribution: **{failure['failure']}** (missed evidence: {failure['missed']}, a head evicts a whole "
        f"span: {failure['evicted_spans']}, a head keeps a span in part: {failure['partial_spans']}).",
        "",
    ]
    columns = ["policy", "fix", "rate", "margin", "rival", "correct", "failure"]
    shown = case.assign(rate=case["rate"].map("{:.0%}".format), margin=case["margin"].map("{:+.2f}".format))
    body = [[str(r[c]) if r[c] != "" else "-" for c in columns] for _, r in shown.iterrows()]
    lines.append(markdown_table(columns, body))
    return "\n".join(lines)


def write_diagnostic_page(folder: str | Path) -> Path:
    """Write `diagnostic.md` into a diagnostic folder; returns its path."""
    folder = Path(folder)
    rows = load_diagnostic(folder)
    manifest: dict[str, Any] = {}
    if (folder / DIAGNOSTIC_MANIFEST).exists():
        manifest = json.loads((folder / DIAGNOSTIC_MANIFEST).read_text())
    sections = [
        "# Fixed-contract diagnostic (arXiv 2605.08234)",
        "",
        f"Settings: `{json.dumps(manifest)}`" if manifest else "",
        "",
        "## When does a scalar raise the margin over attention mass?",
        "",
        raises_markdown(rows),
        "",
        "## Failure modes (failures: full-cache margin > 0, this margin <= 0)",
        "",
        failures_markdown(rows),
        "",
        "## The fixes, alone and in sequence",
        "",
        fixes_markdown(rows),
        "",
        "## A worked case",
        "",
        worked_markdown(rows),
        "",
    ]
    if (folder / WORKED_MAP).exists():
        sections += [f"![eviction map of the worked case]({WORKED_MAP})", ""]
    page = folder / DIAGNOSTIC_PAGE
    page.write_text("\n".join(sections))
    return page
