"""Figures: perplexity change against eviction rate."""

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
