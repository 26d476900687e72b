"""Figures: perplexity change against eviction rate; streaming perplexity along the document."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure


def plot_ppl(report: dict[str, Any], path: str | Path, title: str | None = None) -> Path:
    """delta% vs rate, one line per policy, with the bootstrap 95% band."""
    many = len({r["policy"] for r in report["rows"]}) > 6
    fig = Figure(figsize=(9, 5) if many else (6, 4), dpi=120)
    ax = fig.subplots()
    for policy in dict.fromkeys(r["policy"] for r in report["rows"]):
        rows = sorted((r for r in report["rows"] if r["policy"] == policy), key=lambda r: r["rate"])
        rates = [100 * r["rate"] for r in rows]
        ax.plot(rates, [r["delta_pct"] for r in rows], marker="o", label=policy)
        ax.fill_between(rates, [r["ci95"][0] for r in rows], [r["ci95"][1] for r in rows], alpha=0.15)
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xlabel("eviction rate (% of evictable entries)")
    ax.set_ylabel("perplexity change vs full cache (%)")
    ax.set_title(title or f"{report['docs']} docs, prefix {report['prefix']}, continuation {report['continuation']}")
    if many:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def plot_stream_ppl(report: dict[str, Any], path: str | Path, title: str | None = None) -> Path:
    """PPL per position bucket, one line per contender, one panel per budget (the full cache in every panel).

    A contender keeps its colour in every panel; kvpress's are dashed; the dotted line is where the
    full cache stops (the model's positions).
    """
    rows = report["rows"]
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    names = [name for name in dict.fromkeys(r["policy"] for r in rows) if name != "full"]
    colours = {name: f"C{i % 10}" for i, name in enumerate(names)} | {"full": "black"}
    fig = Figure(figsize=(3.6 * len(budgets) + 1.8, 3.8), dpi=120)
    axes = fig.subplots(1, len(budgets), sharey=True, squeeze=False)[0]
    handles: dict[str, Any] = {}
    for ax, budget in zip(axes, budgets, strict=True):
        for r in (r for r in rows if r["budget"] in (None, budget)):
            points = [((b["start"] + b["end"]) / 2048, b["ppl"]) for b in r["buckets"] if b["ppl"] is not None]
            style = {"linewidth": 2} if r["budget"] is None else {"marker": "o", "markersize": 3}
            (line,) = ax.plot(
                *zip(*points, strict=True),
                color=colours[r["policy"]],
                linestyle="--" if r["library"] == "kvpress" else "-",
                **style,
            )
            handles.setdefault("full cache" if r["budget"] is None else r["policy"], line)
        ax.axvline(report["context_limit"] / 1024, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"budget {budget}")
        ax.set_xlabel("position (k tokens, bucket middle)")
    axes[0].set_ylabel("perplexity")
    fig.legend(list(handles.values()), list(handles), fontsize=7, loc="center right")
    fig.suptitle(title or f"Streaming perplexity: {report['docs']} document(s) of {report['doc_tokens']} tokens")
    fig.tight_layout(rect=(0, 0, 1 - 1.6 / fig.get_figwidth(), 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
