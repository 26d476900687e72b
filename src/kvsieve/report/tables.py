"""The perplexity table: one row per rate, delta% per policy, and each policy's advantage over random."""

from __future__ import annotations

from typing import Any

from rich.table import Table

BASELINE = "random"


def _cells(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    rows = report["rows"]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    rates = list(dict.fromkeys(r["rate"] for r in rows))
    by_key = {(r["policy"], r["rate"]): r for r in rows}
    contenders = [p for p in policies if p != BASELINE] if BASELINE in policies else []
    header = ["rate", *(f"{p} delta% [95% CI]" for p in policies)]
    header += ["advantage (pp)"] if len(contenders) == 1 else [f"{p} advantage (pp)" for p in contenders]
    body = []
    for rate in rates:
        line = [f"{rate:.0%}"]
        for p in policies:
            r = by_key[p, rate]
            line.append(f"{r['delta_pct']:+.2f}% [{r['ci95'][0]:+.1f}, {r['ci95'][1]:+.1f}]")
        for p in contenders:
            line.append(f"{by_key[BASELINE, rate]['delta_pct'] - by_key[p, rate]['delta_pct']:+.2f}")
        body.append(line)
    return header, body


def _caption(report: dict[str, Any]) -> str:
    return (
        f"full-cache PPL {report['full_ppl']:.3f}; {report['docs']} documents, {report['tokens']} scored tokens "
        f"(prefix {report['prefix']}, continuation {report['continuation']}); rate = {report['rate_counts']}; "
        "advantage = random delta% minus the policy's"
    )


def ppl_table(report: dict[str, Any]) -> Table:
    """A rich table of `PplResult.to_json()`."""
    header, body = _cells(report)
    table = Table(*header, title="Perplexity change vs full cache", caption=_caption(report))
    for line in body:
        table.add_row(*line)
    return table


def ppl_markdown(report: dict[str, Any]) -> str:
    """The same table in Markdown."""
    header, body = _cells(report)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(line) + " |" for line in body]
    return "\n".join(lines) + f"\n\n{_caption(report)}\n"
