"""Figures of the routing diagnostics and the sweep analysis (matplotlib figures, written as PNG).

Each function takes the data, a path and an optional title, writes a PNG and returns its path.
The tables come from `kvsieve.harness.eval.analysis`; GER and consensus follow arXiv 2603.01426.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..eval.allocation import Allocation


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    return path


def _figure(*grid: int, figsize: tuple[float, float], dpi: int = 120, **kwargs: object) -> tuple[Figure, object]:
    """A figure (no pyplot, no global backend) and its axes, as `plt.subplots` returns them."""
    fig = Figure(figsize=figsize, dpi=dpi)
    return fig, fig.subplots(*grid, **kwargs)


def _legend(ax: Axes, entries: int) -> None:
    if entries > 8:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    elif entries:
        ax.legend(fontsize=8)


def plot_eviction_map(
    survival: torch.Tensor,
    evidence_positions: torch.Tensor | Sequence[int],
    path: str | Path,
    title: str | None = None,
    per_head: bool = False,
) -> Path:
    """Which context tokens survive where: layers (rows) x tokens (columns), evidence marked in a strip above.

    Colour = share of the layer's kv-heads keeping the token (0 = globally evicted in that layer).
    With `per_head=True` every (layer, kv-head) pair gets its own row (kept / evicted).
    """
    if not isinstance(survival, torch.Tensor) or survival.ndim != 3:
        raise ValueError("survival must be a bool tensor [layers, kv_heads, n_context]")
    layers, heads, n = survival.shape
    grid = survival.float().flatten(0, 1) if per_head else survival.float().mean(dim=1)
    evidence = torch.as_tensor(evidence_positions, dtype=torch.long).flatten().cpu()
    strip = np.zeros((1, n))
    strip[0, evidence[(evidence >= 0) & (evidence < n)].numpy()] = 1.0
    height = min(9.0, 2.0 + 0.18 * grid.shape[0])
    fig, (top, ax) = _figure(
        2, 1, figsize=(10, height), dpi=120, sharex=True, gridspec_kw={"height_ratios": [1, 12], "hspace": 0.05}
    )
    top.imshow(strip, aspect="auto", cmap="Reds", vmin=0, vmax=1, interpolation="nearest")
    top.set_yticks([0], ["evidence"])
    top.tick_params(axis="x", bottom=False, labelbottom=False)
    image = ax.imshow(grid.numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    if len(evidence):
        ax.set_xticks(evidence.tolist(), minor=True)
        ax.tick_params(axis="x", which="minor", length=6, color="red", width=1.2)
    ax.set_xlabel("context token position")
    if per_head:
        ax.set_ylabel(f"(layer, kv-head), {heads} heads per layer")
        shown = range(0, layers, max(1, layers // 12))
        ax.set_yticks([layer * heads + (heads - 1) / 2 for layer in shown], [f"L{layer}" for layer in shown])
        for layer in range(1, layers):
            ax.axhline(layer * heads - 0.5, color="white", linewidth=0.6)
    else:
        ax.set_ylabel("layer")
    label = "kept (1) / evicted (0)" if per_head else f"share of the layer's {heads} kv-heads keeping the token"
    fig.colorbar(image, ax=[top, ax], label=label, fraction=0.03, pad=0.01)
    kept = float(survival.float().mean())
    top.set_title(title or f"eviction map: {layers} layers x {n} tokens, {100 * kept:.0f}% of entries kept")
    return _save(fig, path)


def _curve_label(row: pd.Series, suites: int) -> str:
    label = str(row["policy"])
    if row.get("library") not in (None, "kvsieve") and not label.startswith(f"{row['library']}:"):
        label = f"{row['library']}:{label}"
    return f"{label} [{row['suite']}]" if suites > 1 else label


def plot_accuracy_vs_rate(table: pd.DataFrame, path: str | Path, title: str | None = None) -> Path:
    """Accuracy (%) vs eviction rate, one line per policy, one panel per mode; the full cache as a dashed line.

    `table` is `accuracy_by_rate(df)`.
    """
    modes = sorted(table["mode"].unique()) if "mode" in table.columns else [None]
    suites = table["suite"].nunique() if "suite" in table.columns else 1
    labels = sorted({_curve_label(row, suites) for _, row in table[table["policy"] != "full"].iterrows()})
    palette = colormaps["tab10" if len(labels) <= 10 else "tab20"]
    colours = {label: palette(i % palette.N) for i, label in enumerate(labels)}  # one colour per curve in every panel
    fig, axes = _figure(1, len(modes), figsize=(6.5 * len(modes), 4.5), dpi=120, sharey=True, squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        rows = table if mode is None else table[table["mode"] == mode]
        full = rows[rows["policy"] == "full"]
        for _, row in full.drop_duplicates(subset=["suite"] if "suite" in rows else None).iterrows():
            ax.axhline(
                100 * row["accuracy"], color="grey", linestyle="--", linewidth=1, label=_curve_label(row, suites)
            )
        keys = [k for k in ("suite", "library", "policy") if k in rows.columns]
        curves = rows[rows["policy"] != "full"].groupby(keys, sort=True)
        for _, curve in curves:
            curve = curve.sort_values("rate")
            label = _curve_label(curve.iloc[0], suites)
            style = "-" if curve.iloc[0].get("library", "kvsieve") == "kvsieve" else "--"
            ax.plot(
                100 * curve["rate"],
                100 * curve["accuracy"],
                marker="o",
                linestyle=style,
                color=colours[label],
                label=label,
            )
        ax.set_xlabel("eviction rate (% of evictable entries)")
        ax.set_title(f"question-{mode}" if mode else "accuracy")
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
        _legend(ax, len(curves) + len(full))
    axes[0][0].set_ylabel("accuracy (%)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_hallucination_vs_ger(points: pd.DataFrame, r: float, path: str | Path, title: str | None = None) -> Path:
    """Scatter of hallucination rate vs mean GER, one colour per policy, one marker per mode; Pearson r in the title.

    `points` is `hallucination_vs_ger(df)["points"]`.
    """
    fig, ax = _figure(figsize=(6.5, 4.5), dpi=120)
    markers = {"agnostic": "o", "aware": "^"}
    policies = sorted(points["policy"].unique())
    colours = colormaps["tab10" if len(policies) <= 10 else "tab20"]
    for i, policy in enumerate(policies):
        for mode, rows in points[points["policy"] == policy].groupby("mode"):
            ax.scatter(
                100 * rows["mean_ger"],
                100 * rows["hallucination_rate"],
                color=colours(i % colours.N),
                marker=markers.get(mode, "s"),
                label=f"{policy} ({mode})",
                alpha=0.85,
            )
    ax.set_xlabel("mean GER, per-layer scope (% of evidence tokens no head of the layer keeps)")
    ax.set_ylabel("hallucination rate (%)")
    ax.grid(alpha=0.3)
    _legend(ax, len(ax.collections))
    ax.set_title(f"{title + ': ' if title else ''}Pearson r = {r:.2f} over {len(points)} (policy, rate, mode) points")
    fig.tight_layout()
    return _save(fig, path)


def _plot_by_layer(table: pd.DataFrame, value: str, ylabel: str, title: str, path: str | Path) -> Path:
    """`table[value]` vs layer index, a line per (policy, rate); darker = higher rate (one rate: a hue per policy)."""
    fig, ax = _figure(figsize=(7.5, 4.5), dpi=120)
    policies = list(dict.fromkeys(table["policy"]))
    maps = ["Blues", "Oranges", "Greens", "Reds", "Purples", "Greys", "YlOrBr", "PuRd", "BuGn", "GnBu"]
    lines = 0
    for i, policy in enumerate(policies):
        rows = table[table["policy"] == policy]
        rates = sorted(rows["rate"].unique())
        cmap = colormaps[maps[i % len(maps)]]
        for j, rate in enumerate(rates):
            curve = rows[rows["rate"] == rate].sort_values("layer")
            shade = 0.45 + 0.5 * (j / max(1, len(rates) - 1))
            color = cmap(shade) if len(rates) > 1 else colormaps["tab10"](i % 10)
            ax.plot(curve["layer"], curve[value], marker=".", color=color, label=f"{policy} @ {100 * rate:.0f}%")
            lines += 1
    ax.set_xlabel("layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    _legend(ax, lines)
    ax.set_title(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_consensus_by_depth(table: pd.DataFrame, path: str | Path, title: str | None = None) -> Path:
    """Head consensus vs layer index, a line per (policy, rate); darker = higher rate.

    `table` is `consensus_by_depth(df)`; H = the query heads of one layer.
    """
    ylabel = "head consensus (distinct argmax tokens / query heads)"
    title = title or "head consensus by depth (H = query heads of one layer; low = rigid)"
    return _plot_by_layer(table.sort_values("policy", kind="stable"), "consensus", ylabel, title, path)


def plot_recall_by_depth(table: pd.DataFrame, path: str | Path, title: str | None = None) -> Path:
    """Evidence recall vs layer index, a line per (policy, rate) in the table's order; darker = higher rate.

    `table` is `recall_by_depth(df)`: the share of the evidence tokens a layer's kv-heads still store.
    """
    ylabel = "evidence recall (share of the evidence kept, mean over kv-heads)"
    return _plot_by_layer(table, "recall", ylabel, title or "evidence recall by depth", path)


def plot_allocation(allocation: Allocation, path: str | Path, title: str | None = None) -> Path:
    """Entries kept per (layer, kv-head) under the policy's allocator, and per layer beside the uniform split.

    Left: a heat map, layers (rows) x kv-heads, of the entries each head keeps, as a multiple of what
    the uniform split gives it (log scale: 1 = the uniform share). Right: entries kept per layer, the
    policy's (bars) and the uniform split's (line); both keep the same number in all.
    """
    kept, uniform = np.array(allocation.kept, dtype=float), np.array(allocation.uniform, dtype=float)
    ratio = np.log2(np.maximum(kept, 0.5) / np.maximum(uniform, 1.0))
    height = min(10.0, 2.0 + 0.22 * len(allocation.layers))
    fig, (left, right) = _figure(1, 2, figsize=(11, height), gridspec_kw={"width_ratios": [1, 2], "wspace": 0.25})
    limit = max(1.0, float(np.abs(ratio).max()))
    image = left.imshow(ratio, aspect="auto", cmap="RdBu_r", vmin=-limit, vmax=limit, interpolation="nearest")
    left.set_yticks(range(len(allocation.layers)), [f"L{layer}" for layer in allocation.layers], fontsize=7)
    left.set_xticks(range(kept.shape[1]))
    left.set_xlabel("kv-head")
    left.set_ylabel("layer (full attention)")
    bar = fig.colorbar(image, ax=left, fraction=0.08, pad=0.03)
    bar.set_label("log2(kept / uniform share)")
    totals, uniform_totals = allocation.layer_totals()
    rows = np.arange(len(allocation.layers))
    right.barh(rows, totals, color="tab:blue", label=allocation.policy)
    right.plot(uniform_totals, rows, color="black", linestyle="--", marker="|", label="uniform split")
    right.set_yticks(rows, [f"L{layer}" for layer in allocation.layers], fontsize=7)
    right.invert_yaxis()
    right.set_xlabel(f"entries kept per layer (all kv-heads), of {allocation.tokens} tokens per head")
    right.legend(fontsize=8, loc="lower right")
    right.grid(axis="x", alpha=0.3)
    fig.suptitle(title or f"{allocation.policy} at {allocation.rate:.0%} eviction: where the budget goes")
    return _save(fig, path)
