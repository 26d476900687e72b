"""Sweep analysis: accuracy curves, hallucination vs GER, consensus and recall by depth, the cliff, kvsieve vs kvpress.

Every function takes a pandas DataFrame of sweep rows (one per sample x policy x rate x mode) and
returns a new DataFrame or dict; nothing is modified in place. A row has at least the columns
`suite, task, index, mode, library, policy, rate, score, correct, abstained, hallucinated,
gold_logprob, gold_rank, kv_bytes, seconds, ger_layer, ger_model, recall_mean, consensus_mean,
agreement_mean, consensus_by_layer, recall_by_layer`. The full cache is the policy ``"full"`` at rate 0.

Accuracy is the share of correct samples in [0, 1]; `score` is the 0-100 string-match score.
GER and consensus follow arXiv 2603.01426 (see `kvsieve.harness.eval.routing`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from .stats import bootstrap_mean_ci

FULL = "full"
CURVE_KEYS: tuple[str, ...] = ("suite", "mode", "library", "policy")
SAMPLE_KEYS: tuple[str, ...] = ("task", "index")


def _require(df: pd.DataFrame, columns: Sequence[str], who: str) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ValueError(f"{who} needs the sweep columns {missing}; the frame has {list(df.columns)}")


def _full_rows(df: pd.DataFrame, suite: str, mode: str, library: str) -> pd.DataFrame:
    """The full-cache rows serving one curve: same suite, mode and library if there are any, else the
    same suite and mode, else the same suite; one row per sample."""
    full = df[(df["policy"] == FULL) & (df["suite"] == suite)]
    for narrower in (full[(full["mode"] == mode) & (full["library"] == library)], full[full["mode"] == mode]):
        if len(narrower):
            full = narrower
            break
    return full.drop_duplicates(subset=list(SAMPLE_KEYS))


def with_full_at_rate_zero(df: pd.DataFrame) -> pd.DataFrame:
    """The sweep rows plus, for every (suite, mode, library, policy) curve, its full-cache rows at rate 0.

    The ``"full"`` rows themselves stay as their own curve. A curve that swept rate 0 itself gets no copy.
    """
    _require(df, [*CURVE_KEYS, *SAMPLE_KEYS, "rate"], "with_full_at_rate_zero")
    parts = [df]
    curves = df[df["policy"] != FULL].groupby(list(CURVE_KEYS), sort=False)
    for (suite, mode, library, policy), rows in curves:
        if (rows["rate"] == 0).any():
            continue
        full = _full_rows(df, suite, mode, library).copy()
        full = full[full.set_index(list(SAMPLE_KEYS)).index.isin(rows.set_index(list(SAMPLE_KEYS)).index)]
        full["mode"], full["library"], full["policy"], full["rate"] = mode, library, policy, 0.0
        parts.append(full)
    return pd.concat(parts, ignore_index=True)


def accuracy_by_rate(df: pd.DataFrame) -> pd.DataFrame:
    """Per (suite, mode, library, policy, rate): mean score, accuracy, n, hallucination and abstention rates,
    mean gold log-prob, median gold rank, mean KV bytes, mean seconds and, for a sweep run with
    diagnostics, mean GER (`ger_layer`).

    The full-cache rows appear as rate 0 of every policy's curve (same samples), and as the ``"full"`` curve.
    """
    columns = ["score", "correct", "abstained", "hallucinated", "gold_logprob", "gold_rank", "kv_bytes", "seconds"]
    _require(df, [*CURVE_KEYS, *SAMPLE_KEYS, "rate", *columns], "accuracy_by_rate")
    rows = with_full_at_rate_zero(df)
    for flag in ("correct", "abstained", "hallucinated"):
        rows[flag] = rows[flag].astype(float)
    means = {
        "mean_score": ("score", "mean"),
        "accuracy": ("correct", "mean"),
        "n": ("correct", "size"),
        "hallucination_rate": ("hallucinated", "mean"),
        "abstention_rate": ("abstained", "mean"),
        "mean_gold_logprob": ("gold_logprob", "mean"),
        "median_gold_rank": ("gold_rank", "median"),
        "mean_kv_bytes": ("kv_bytes", "mean"),
        "mean_seconds": ("seconds", "mean"),
    }
    if "ger_layer" in rows:
        means["mean_ger"] = ("ger_layer", "mean")
    return rows.groupby([*CURVE_KEYS, "rate"], sort=True).agg(**means).reset_index()


def pearson(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> float:
    """Pearson correlation of the pairs where both values are finite; NaN with fewer than 2 pairs or no variance."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.shape != y.shape:
        raise ValueError(f"pearson needs two sequences of one length, got {x.shape} and {y.shape}")
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    if x.size < 2:
        return math.nan
    dx, dy = x - x.mean(), y - y.mean()
    denominator = math.sqrt(float((dx * dx).sum()) * float((dy * dy).sum()))
    if denominator == 0.0:
        return math.nan
    return float((dx * dy).sum() / denominator)


def hallucination_vs_ger(df: pd.DataFrame) -> dict[str, Any]:
    """Does hallucination rise with global eviction of the evidence? (arXiv 2603.01426, the safety cliff)

    Returns a dict:
        points: DataFrame per (policy, rate, mode) of `mean_ger` (mean `ger_layer`), `hallucination_rate`, `n`;
        r_points: Pearson r over those points (aggregate level);
        r_samples: Pearson r over individual samples, `hallucinated` as 0/1 vs `ger_layer` (point-biserial);
        n_points, n_samples, and `which`, a sentence saying which r is which.
    Rows without a GER (no evidence: NaN) are left out of both.
    """
    _require(df, ["policy", "rate", "mode", "hallucinated", "ger_layer"], "hallucination_vs_ger")
    rows = df[np.isfinite(df["ger_layer"].astype(float))].copy()
    rows["hallucinated"] = rows["hallucinated"].astype(float)
    points = (
        rows.groupby(["policy", "rate", "mode"], sort=True)
        .agg(mean_ger=("ger_layer", "mean"), hallucination_rate=("hallucinated", "mean"), n=("hallucinated", "size"))
        .reset_index()
    )
    return {
        "points": points,
        "r_points": pearson(points["mean_ger"], points["hallucination_rate"]),
        "r_samples": pearson(rows["ger_layer"], rows["hallucinated"]),
        "n_points": len(points),
        "n_samples": len(rows),
        "which": (
            "r_points: Pearson over (policy, rate, mode) points of mean GER (per-layer scope) vs hallucination rate; "
            "r_samples: Pearson over samples of GER vs hallucinated (0/1)"
        ),
    }


def layer_means(df: pd.DataFrame, column: str, name: str, by: Sequence[str] = ("policy", "rate")) -> pd.DataFrame:
    """Mean over samples of a per-layer list `column` (one value per layer in each row), for each group `by`.

    Long format: the `by` columns, `layer`, `name` (NaN-skipping mean over samples), `n` (samples).
    """
    _require(df, [*by, column], f"layer_means of {column}")
    out = []
    for key, rows in df.groupby(list(by), sort=True):
        group = dict(zip(by, key if isinstance(key, tuple) else (key,), strict=True))
        lists = [list(v) for v in rows[column] if v is not None and len(v)]
        if not lists:
            continue
        lengths = {len(v) for v in lists}
        if len(lengths) != 1:
            raise ValueError(f"{column} has different lengths {sorted(lengths)} within {group}")
        values = np.asarray(lists, dtype=float)
        finite = np.isfinite(values)
        sums = np.where(finite, values, 0.0).sum(axis=0)
        counts = finite.sum(axis=0)
        means = np.divide(sums, counts, out=np.full(sums.shape, np.nan), where=counts > 0)
        for layer, value in enumerate(means):
            out.append({**group, "layer": layer, name: float(value), "n": len(lists)})
    return pd.DataFrame(out, columns=[*by, "layer", name, "n"])


def consensus_by_depth(df: pd.DataFrame, by: Sequence[str] = ("policy", "rate")) -> pd.DataFrame:
    """Mean head consensus per layer for each group `by` (default (policy, rate)), from `consensus_by_layer`.

    Long format: the `by` columns, `layer`, `consensus`, `n` (`layer_means`). Consensus is over the query heads
    of one layer (arXiv 2603.01426).
    """
    return layer_means(df, "consensus_by_layer", "consensus", by)


def recall_by_depth(df: pd.DataFrame, by: Sequence[str] = ("policy", "rate")) -> pd.DataFrame:
    """Mean evidence recall per layer (the share of the evidence tokens a layer's kv-heads still store, averaged
    over them) for each group `by`, from `recall_by_layer`: the `by` columns, `layer`, `recall`, `n`."""
    return layer_means(df, "recall_by_layer", "recall", by)


def _steepest_drop(curve: list[tuple[float, float]]) -> tuple[float, float, float] | None:
    """(from_rate, to_rate, drop per unit rate) of the steepest fall between consecutive points; None if none falls."""
    best = None
    for (r0, a0), (r1, a1) in itertools.pairwise(curve):
        drop = (a0 - a1) / (r1 - r0)
        if drop > 0 and (best is None or drop > best[2]):
            best = (r0, r1, drop)
    return best


def cliff(df: pd.DataFrame, keep: float = 0.9) -> pd.DataFrame:
    """Where each (suite, mode, library, policy) curve breaks.

    Columns: `n_samples`; `full_accuracy` (full cache, same samples); `safe_rate`, the highest swept
    rate such that the accuracy at it and at every lower swept rate stays >= `keep` x full (None if the
    lowest rate already fails); `cliff_from`, `cliff_to`, `cliff_drop_per_rate`: the interval between
    consecutive rates (the full cache counting as rate 0) where accuracy falls fastest per unit rate
    (None when it never falls).
    """
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"keep must be in (0, 1], got {keep}")
    _require(df, [*CURVE_KEYS, *SAMPLE_KEYS, "rate", "correct"], "cliff")
    out = []
    for (suite, mode, library, policy), rows in df[df["policy"] != FULL].groupby(list(CURVE_KEYS), sort=True):
        samples = rows.set_index(list(SAMPLE_KEYS)).index.unique()
        full = _full_rows(df, suite, mode, library)
        full = full[full.set_index(list(SAMPLE_KEYS)).index.isin(samples)]
        full_accuracy = float(full["correct"].astype(float).mean()) if len(full) else math.nan
        by_rate = rows.assign(correct=rows["correct"].astype(float)).groupby("rate")["correct"].mean().sort_index()
        safe_rate = None
        for rate, accuracy in by_rate.items():
            if not accuracy >= keep * full_accuracy:
                break
            safe_rate = float(rate)
        curve = [(float(r), float(a)) for r, a in by_rate.items()]
        if len(full) and curve[0][0] > 0:
            curve.insert(0, (0.0, full_accuracy))
        steepest = _steepest_drop(curve)
        out.append(
            {
                "suite": suite,
                "mode": mode,
                "library": library,
                "policy": policy,
                "n_samples": len(samples),
                "full_accuracy": full_accuracy,
                "keep": keep,
                "safe_rate": safe_rate,
                "cliff_from": None if steepest is None else steepest[0],
                "cliff_to": None if steepest is None else steepest[1],
                "cliff_drop_per_rate": None if steepest is None else steepest[2],
            }
        )
    columns = [*CURVE_KEYS, "n_samples", "full_accuracy", "keep", "safe_rate", "cliff_from", "cliff_to"]
    table = pd.DataFrame(out, columns=[*columns, "cliff_drop_per_rate"])
    for column in ("safe_rate", "cliff_from", "cliff_to", "cliff_drop_per_rate"):  # keep None as None, not NaN
        table[column] = pd.Series([row[column] for row in out], dtype=object)
    return table


def library_side_by_side(df: pd.DataFrame) -> pd.DataFrame:
    """Per (rate, library, policy): accuracy, mean KV bytes actually held, mean wall seconds per sample, n.

    For the kvsieve-vs-kvpress table; the full cache shows as policy ``"full"`` at rate 0 per library.
    """
    _require(df, ["rate", "library", "policy", "correct", "kv_bytes", "seconds"], "library_side_by_side")
    return (
        df.assign(correct=df["correct"].astype(float))
        .groupby(["rate", "library", "policy"], sort=True)
        .agg(
            accuracy=("correct", "mean"),
            mean_kv_bytes=("kv_bytes", "mean"),
            mean_seconds=("seconds", "mean"),
            n=("correct", "size"),
        )
        .reset_index()
    )


def against_full(df: pd.DataFrame, n_boot: int = 2000, seed: int = 0) -> pd.DataFrame:
    """Per (suite, task, mode, library, policy, rate): the policy against the full cache on the same samples.

    Columns: `accuracy`, `full_accuracy`, `delta_logprob` (mean gold log-prob minus the full
    cache's) with a paired bootstrap 95% interval over samples (`lo`, `hi`), `n`, and `verdict`:
    ``"beats"`` when the interval is above 0 or the accuracy is higher with the log-prob not
    significantly lower, ``"falls short"`` in the mirror cases, else ``"level"``.
    """
    _require(df, [*CURVE_KEYS, *SAMPLE_KEYS, "rate", "correct", "gold_logprob"], "against_full")
    out = []
    for (suite, mode, library, policy, task, rate), rows in df[df["policy"] != FULL].groupby(
        [*CURVE_KEYS, "task", "rate"], sort=True
    ):
        full = _full_rows(df, suite, mode, library)
        paired = rows.merge(full[full["task"] == task], on=list(SAMPLE_KEYS), suffixes=("", "_full"))
        if paired.empty:
            continue
        diff = (paired["gold_logprob"] - paired["gold_logprob_full"]).to_numpy(dtype=float)
        lo, hi = bootstrap_mean_ci(diff, n_boot, seed)
        accuracy, full_accuracy = paired["correct"].astype(float).mean(), paired["correct_full"].astype(float).mean()
        better = lo > 0 or (accuracy > full_accuracy and hi >= 0)
        worse = hi < 0 or (accuracy < full_accuracy and lo <= 0)
        verdict = "beats" if better and not worse else "falls short" if worse and not better else "level"
        out.append(
            {
                "suite": suite, "task": task, "mode": mode, "library": library, "policy": policy, "rate": rate,
                "n": len(diff), "accuracy": accuracy, "full_accuracy": full_accuracy,
                "delta_logprob": float(diff.mean()), "lo": lo, "hi": hi, "verdict": verdict,
            }
        )  # fmt: skip
    return pd.DataFrame(out)
