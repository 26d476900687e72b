"""A sweep folder -> one self-contained HTML page: the tables of `eval.analysis` and the figures, inlined."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

import pandas as pd

from ...selection.protection import DEFAULT_N_RECENT, DEFAULT_N_SINK
from ..eval.analysis import accuracy_by_rate, cliff, consensus_by_depth, hallucination_vs_ger, library_side_by_side
from ..eval.results_table import read_results
from .figures import plot_accuracy_vs_rate, plot_consensus_by_depth, plot_hallucination_vs_ger

RESULTS_FILE = "results.jsonl"
MANIFEST_FILE = "sweep.json"

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
table { border-collapse: collapse; font-size: 13px; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 3px 7px; text-align: right; }
th { background: #f3f3f3; }
td:first-child, th:first-child { text-align: left; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
.note { color: #555; font-size: 13px; }
"""


def load_results(folder: str | Path) -> pd.DataFrame:
    """The rows of a sweep folder: its Parquet table, or its results log where that is newer."""
    path = Path(folder) / RESULTS_FILE
    rows = read_results(path)
    if rows.empty:
        raise FileNotFoundError(f"{path} holds no sweep rows; run `kvsieve sweep --out {folder}` first")
    return rows


def _table(frame: pd.DataFrame, formats: dict[str, str] | None = None) -> str:
    shown = frame.copy()
    for column, spec in (formats or {}).items():
        if column in shown:
            shown[column] = shown[column].map(lambda v, s=spec: "" if v is None or v != v else format(v, s))
    return shown.to_html(index=False, border=0, na_rep="")


def _image(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img src="data:image/png;base64,{data}" alt="{html.escape(path.stem)}">'


def accuracy_pivot(table: pd.DataFrame) -> pd.DataFrame:
    """Accuracy (%) per (suite, mode, library, policy) and rate, the rates as columns."""
    pivot = table.pivot_table(
        index=["suite", "mode", "library", "policy"], columns="rate", values="accuracy", aggfunc="first"
    )
    pivot.columns = [f"{rate:.0%}" for rate in pivot.columns]
    return (100 * pivot).round(1).reset_index()


def _manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def write_report(folder: str | Path) -> Path:
    """Write `report.html` (and its figures as PNGs) into a sweep folder; returns the page's path."""
    folder = Path(folder)
    rows = load_results(folder)
    table = accuracy_by_rate(rows)
    halluc = hallucination_vs_ger(rows)
    consensus = consensus_by_depth(rows[rows["policy"] != "full"])
    cliffs = cliff(rows)
    figures = folder / "figures"
    parts = [f"<h1>kvsieve sweep: {html.escape(folder.name)}</h1>"]
    manifest = _manifest(folder)
    if manifest:
        parts.append(f'<p class="note">{html.escape(json.dumps(manifest))}</p>')
    parts.append(
        f'<p class="note">{len(rows)} rows, {rows["sample"].nunique()} samples, tasks: '
        f"{html.escape(', '.join(dict.fromkeys(rows['task'])))}. Rate = evicted share of the evictable entries "
        f"(the first {DEFAULT_N_SINK} and the last {DEFAULT_N_RECENT} tokens of the compressed prompt protected); "
        "kvpress ratios are converted to evict "
        "the same number of entries. Accuracy = every expected string in the answer (RULER string match, "
        "case-insensitive).</p>"
    )
    parts.append("<h2>Accuracy (%) by rate</h2>" + _table(accuracy_pivot(table)))
    for suite in dict.fromkeys(table["suite"]):
        path = plot_accuracy_vs_rate(table[table["suite"] == suite], figures / f"accuracy_{suite}.png", title=suite)
        parts.append(_image(path))
    parts.append(
        "<h2>The cliff</h2><p class='note'>Highest swept rate that keeps at least 90% of the full cache's "
        "accuracy on the same samples, and where accuracy falls fastest.</p>" + _table(cliffs)
    )
    details = table.drop(columns=["n"]).copy()
    details["mean_kv_MiB"] = details.pop("mean_kv_bytes") / 2**20
    fmt = {c: ".3f" for c in ("accuracy", "hallucination_rate", "abstention_rate", "mean_ger", "mean_seconds")}
    fmt |= {"mean_score": ".1f", "mean_gold_logprob": ".2f", "mean_kv_MiB": ".2f"}
    parts.append("<h2>Every curve point</h2>" + _table(details, fmt))
    r_points, r_samples = halluc["r_points"], halluc["r_samples"]
    path = plot_hallucination_vs_ger(halluc["points"], r_points, figures / "hallucination_vs_ger.png")
    parts.append(
        f"<h2>Hallucination vs Global Eviction Ratio</h2><p class='note'>{html.escape(halluc['which'])}. "
        f"r_points = {r_points:.3f} over {halluc['n_points']} points; r_samples = {r_samples:.3f} over "
        f"{halluc['n_samples']} samples.</p>" + _image(path)
    )
    if len(consensus):
        path = plot_consensus_by_depth(consensus, figures / "consensus_by_depth.png")
        parts.append(
            "<h2>Head consensus by depth</h2><p class='note'>Distinct argmax tokens over the query heads of one "
            "layer / heads (H per layer), after compression; low = rigid routing.</p>" + _image(path)
        )
    if (rows["library"] == "kvpress").any():
        side = library_side_by_side(rows)
        parts.append(
            "<h2>kvsieve and kvpress side by side</h2><p class='note'>KV bytes actually held after compression "
            "(kvpress's AdaKV masks entries and keeps every byte) and wall seconds per sample (kvsieve: eviction "
            "and answer from the shared prefill, plus the prefill divided by the configurations; kvpress: its "
            "own prefill and answer).</p>" + _table(side, {c: ".3f" for c in side.columns if side[c].dtype == float})
        )
    maps = sorted((folder / "maps").glob("*.png")) if (folder / "maps").is_dir() else []
    if maps:
        parts.append("<h2>Eviction maps</h2>")
        parts += [f"<h3>{html.escape(m.stem)}</h3>{_image(m)}" for m in maps]
    page = folder / "report.html"
    page.write_text(
        f"<!doctype html><meta charset='utf-8'><title>kvsieve sweep</title><style>{_STYLE}</style>" + "\n".join(parts)
    )
    return page
