"""The fixed-contract diagnostic's tables, from its rows (`contract_diagnostic.run_diagnostic`).

- `raises_margin`: per scalar and rate, the share of cases where the scalar's margin is above
  attention mass's, separately for positive-margin cases (the full cache's margin > 0) and the
  others, with 95% bootstrap intervals (the seed's 72.6% vs 32.4% shape);
- `failure_mix`: per scalar and rate, how the failures split into the failure modes;
- `fixes`: accuracy and mean margin of each named contract, per mode and rate;
- `worked_case`: one failure of attention mass that a fix repairs, to show in the report.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .attribution import MODES_OF_FAILURE
from .contract_diagnostic import ATTENTION_MASS, FIXES
from .stats import bootstrap_mean_ci

CASE = ["sample", "mode", "rate"]

#: The label of the evidence-first oracle among the named contracts.
ORACLE = FIXES[-1][0]


def _share(values: pd.Series) -> tuple[float, float, float, int]:
    """Mean of 0/1 values, its 95% bootstrap interval and the count (NaN when empty)."""
    if values.empty:
        return np.nan, np.nan, np.nan, 0
    lo, hi = bootstrap_mean_ci(values.to_numpy(dtype=float))
    return float(values.mean()), lo, hi, len(values)


def raises_margin(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (scalar, rate): share of positive- and non-positive-margin cases where the scalar beats attention mass."""
    scalars = rows[rows["scalar"]]
    mass = scalars[scalars["policy"] == ATTENTION_MASS].set_index(CASE)["margin"]
    out = []
    for (policy, rate), group in scalars[scalars["policy"] != ATTENTION_MASS].groupby(["policy", "rate"]):
        group = group.set_index(CASE)
        raised = (group["margin"] > mass.reindex(group.index)).astype(float)
        positive = group["full_margin"] > 0
        pos, pos_lo, pos_hi, n_pos = _share(raised[positive])
        neg, neg_lo, neg_hi, n_neg = _share(raised[~positive])
        out.append(
            {"policy": policy, "rate": rate, "positive": pos, "positive_ci": [pos_lo, pos_hi], "n_positive": n_pos}
            | {"non_positive": neg, "non_positive_ci": [neg_lo, neg_hi], "n_non_positive": n_neg}
        )
    return pd.DataFrame(out)


def failure_mix(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (policy, rate) of the scalars: cases, failures, the count of each failure mode, and how many
    failures the evidence-first oracle repairs (its margin at the same case and rate > 0)."""
    scalars = rows[rows["scalar"]]
    oracle = rows[rows["fix"] == ORACLE].set_index(CASE)["margin"]
    out = []
    for (policy, rate), group in scalars.groupby(["policy", "rate"]):
        failed = group[group["failure"] != ""]
        counts = failed["failure"].value_counts()
        repaired = int((oracle.reindex(failed.set_index(CASE).index) > 0).sum())
        out.append(
            {"policy": policy, "rate": rate, "cases": len(group), "failures": len(failed)}
            | {mode: int(counts.get(mode, 0)) for mode in MODES_OF_FAILURE}
            | {"oracle_repairs": repaired}
        )
    return pd.DataFrame(out)


def fixes(rows: pd.DataFrame) -> pd.DataFrame:
    """Per named contract, mode and rate: accuracy and mean margin, with a 95% interval of the margin."""
    labels = [label for label, *_ in FIXES]
    named = rows[rows["fix"] != ""]
    out = []
    for (label, mode, rate), group in named.groupby(["fix", "mode", "rate"]):
        lo, hi = bootstrap_mean_ci(group["margin"].to_numpy(dtype=float))
        out.append(
            {"contract": label, "mode": mode, "rate": rate, "cases": len(group), "accuracy": group["correct"].mean()}
            | {"margin": group["margin"].mean(), "margin_ci": [lo, hi]}
        )
    frame = pd.DataFrame(out)
    if frame.empty:
        return frame
    order = {label: i for i, label in enumerate(labels)}
    return frame.sort_values(["mode", "rate", "contract"], key=lambda c: c.map(order) if c.name == "contract" else c)


def worked_case(rows: pd.DataFrame) -> pd.DataFrame | None:
    """The rows of one case where attention mass fails with a named cause and some fix holds (None if there is none).

    Prefers explained failures (missed, mis-scored, broken) and, among them, the largest repair.
    """
    mass = rows[(rows["policy"] == ATTENTION_MASS) & rows["scalar"] & (rows["failure"] != "")]
    if mass.empty:
        return None
    best, best_gain = None, -np.inf
    for _, failure in mass.iterrows():
        case = rows[(rows["sample"] == failure["sample"]) & (rows["mode"] == failure["mode"])]
        at_rate = case[(case["rate"] == failure["rate"]) & (case["fix"] != "")]
        gain = at_rate["margin"].max() - failure["margin"] + (100.0 if failure["failure"] != "unexplained" else 0.0)
        if gain > best_gain:
            best, best_gain = pd.concat([case[case["rate"] == 0.0], case[case["rate"] == failure["rate"]]]), gain
    return best
