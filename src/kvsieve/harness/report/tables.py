"""Tables: perplexity change per policy and rate (and the advantage over random), streaming perplexity; Markdown."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
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


def _policy_cells(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """One row per policy, one column per rate, and the mean advantage over random (for many policies)."""
    rows = report["rows"]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    rates = list(dict.fromkeys(r["rate"] for r in rows))
    by_key = {(r["policy"], r["rate"]): r for r in rows}
    header = ["policy", *(f"{rate:.0%} delta% [95% CI]" for rate in rates), "KV MiB at last rate"]
    if BASELINE in policies:
        header.append("mean advantage (pp)")
    body = []
    for p in policies:
        line = [p]
        for rate in rates:
            r = by_key[p, rate]
            line.append(f"{r['delta_pct']:+.2f}% [{r['ci95'][0]:+.1f}, {r['ci95'][1]:+.1f}]")
        line.append(f"{by_key[p, rates[-1]]['kv_bytes'] / 2**20:.1f}")
        if BASELINE in policies:
            gaps = [by_key[BASELINE, rate]["delta_pct"] - by_key[p, rate]["delta_pct"] for rate in rates]
            line.append(f"{sum(gaps) / len(gaps):+.2f}")
        body.append(line)
    return header, body


def _layout(report: dict[str, Any], by_policy: bool | None) -> tuple[list[str], list[list[str]]]:
    if by_policy is None:
        by_policy = len({r["policy"] for r in report["rows"]}) > 3
    return _policy_cells(report) if by_policy else _cells(report)


def ppl_table(report: dict[str, Any], by_policy: bool | None = None) -> Table:
    """A rich table of `PplResult.to_json()`: a row per rate, or a row per policy when there are many."""
    header, body = _layout(report, by_policy)
    table = Table(*header, title="Perplexity change vs full cache", caption=_caption(report))
    for line in body:
        table.add_row(*line)
    return table


def markdown_table(header: Sequence[str], body: Iterable[Sequence[str]]) -> str:
    """A Markdown table: the header, its rule, one line per row of cells (no trailing newline)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


def ppl_markdown(report: dict[str, Any], by_policy: bool | None = None) -> str:
    """The same table in Markdown."""
    return markdown_table(*_layout(report, by_policy)) + f"\n\n{_caption(report)}\n"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _change(versus: dict[str, Any] | None) -> str:
    if versus is None:
        return "-"
    return f"{versus['delta_pct']:+.1f}% [{versus['ci95'][0]:+.1f}, {versus['ci95'][1]:+.1f}]"


def _bucket_label(bucket: dict[str, Any]) -> str:
    return f"{bucket['start'] / 1024:g}-{bucket['end'] / 1024:g}k"


def _stream_cells(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """One line per (contender, budget): PPL, against the full cache, per bucket, bytes, entries, time."""
    rows = report["rows"]
    header = ["policy", "budget", "PPL [95% CI]", "vs full", *(_bucket_label(b) for b in rows[0]["buckets"])]
    header += ["KV MiB", "alloc MiB", "entries/head", "ms/token"]
    body = []
    for r in rows:
        line = [
            r["policy"],
            "-" if r["budget"] is None else str(r["budget"]),
            f"{r['ppl']:.2f} [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]",
            _change(r["vs_full"]),
            *("-" if b["ppl"] is None else f"{b['ppl']:.2f}" for b in r["buckets"]),
            _mib(r["peak_kv_bytes"]),
            _mib(r["peak_allocated_bytes"]),
            f"{r['peak_entries_per_head']:.0f}",
            f"{r['ms_per_token']:.2f}",
        ]
        body.append(line)
    return header, body


def _stream_caption(report: dict[str, Any]) -> str:
    return (
        f"{report['docs']} documents of {report['doc_tokens']} tokens, fed {report['buffer']} tokens per forward; "
        "PPL pooled over the tokens after the first `budget` (the full cache: every token it scored), "
        "bootstrap 95% CI over documents; "
        f"vs full = PPL change against the full cache on the same tokens, positions budget..{report['context_limit']} "
        "(the full cache is fed up to the document's end or the model's max_position_embeddings, if sooner); "
        f"position buckets of {report['bucket']} tokens; KV = peak bytes of keys and values per sequence"
    )


def stream_table(report: dict[str, Any]) -> Table:
    """A rich table of `StreamResult.to_json()`."""
    header, body = _stream_cells(report)
    table = Table(*header, title="Streaming perplexity", caption=_stream_caption(report))
    for line in body:
        table.add_row(*line)
    return table


def stream_markdown(report: dict[str, Any]) -> str:
    """The same table in Markdown."""
    return markdown_table(*_stream_cells(report)) + f"\n\n{_stream_caption(report)}\n"
