"""The fixed-contract diagnostic (arXiv 2605.08234) on the default model: when value-aware ranking
helps, why eviction fails, and whether the seed's fixes help alone and in sequence.

Contract: uniform allocator, 1 sink + 32 recent tokens protected, per-entry top-k (the fixes
change the projection to 8-token chunks), 1,024-token samples of the tasks with annotated
evidence, question-agnostic and -aware, rates 0.5/0.75/0.9. Raw rows: results/contract_diagnostic/
(a rerun resumes; `kvsieve report results/contract_diagnostic` renders them); summary:
benchmarks/results/contract_diagnostic.{json,md}, and its two headline tables (the shares pooled over
the rates, the fixes by mode and rate) in benchmarks/results/contract_diagnostic_summary.md.

    python benchmarks/contract_diagnostic.py [--samples 4] [--tasks hops,multi_entity]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvsieve import load_model
from kvsieve.harness.cli import write_worked_map
from kvsieve.harness.data.suites import task_samples
from kvsieve.harness.eval.contract_diagnostic import DIAGNOSTIC_TASKS, Contract, default_scalars, run_diagnostic
from kvsieve.harness.eval.diagnostic_tables import failure_mix, fixes, raises_margin
from kvsieve.harness.models import DEFAULT_MODEL
from kvsieve.harness.progress import progress_bar
from kvsieve.harness.report import markdown_table
from kvsieve.harness.report.diagnostic_page import (
    DIAGNOSTIC_FILE,
    DIAGNOSTIC_MANIFEST,
    WORKED_MAP,
    write_diagnostic_page,
)
from kvsieve.harness.runners import LocalRunner
from results_io import RESULTS, Output

RAW = Path(__file__).parent.parent / "results" / "contract_diagnostic"


def pooled_markdown(summary: dict) -> str:
    """Markdown: per scalar, the share of cases where it raises the margin over attention mass, pooled over rates."""
    counts: dict[str, list[float]] = {}  # per scalar: cases raised and cases, positive then non-positive
    for r in summary["raises_margin"]:
        c = counts.setdefault(r["policy"], [0.0, 0, 0.0, 0])
        for i, side in enumerate(("positive", "non_positive")):
            n = r[f"n_{side}"]
            c[2 * i] += r[side] * n if n else 0.0  # the share is NaN where a rate has no such case
            c[2 * i + 1] += n
    rates = "/".join(f"{rate * 100:g}" for rate in summary["rates"])

    def cell(hits: float, n: int) -> str:
        """The pooled share and its number of cases."""
        return f"{hits / n:.0%} (n={n})" if n else "-"

    body = [[scalar, cell(*c[:2]), cell(*c[2:])] for scalar, c in counts.items()]
    return markdown_table([f"scalar (pooled over {rates}%)", "positive-margin cases", "non-positive cases"], body)


def fixes_markdown(summary: dict) -> str:
    """Markdown: accuracy and mean margin of each contract, a column per (mode, rate)."""
    fixes = summary["fixes"]
    cell = {(r["contract"], r["mode"], r["rate"]): f"{r['accuracy']:.0%} ({r['margin']:+.1f})" for r in fixes}
    contracts = list(dict.fromkeys(contract for contract, _, _ in cell))
    columns = list(dict.fromkeys((mode, rate) for _, mode, rate in cell))
    body = [[c, *(cell.get((c, mode, rate), "-") for mode, rate in columns)] for c in contracts]
    return markdown_table(["contract", *(f"{mode} {rate:.0%}" for mode, rate in columns)], body)


def summary_markdown(summary: dict) -> str:
    """Markdown: the summary's two headline tables, pooled shares then the fixes."""
    return f"{pooled_markdown(summary)}\n\n{fixes_markdown(summary)}\n"


#: The summary's JSON and its tables; the page (contract_diagnostic.md) and its worked map come from the raw rows.
SUMMARY = Output("contract_diagnostic", {"_summary": summary_markdown}, extras=(".md", ".png"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default=DIAGNOSTIC_TASKS)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--rates", default="0.5,0.75,0.9")
    args = parser.parse_args()
    model, tokenizer = load_model()
    samples = task_samples(args.tasks, tokenizer, length=args.length, n=args.samples, seed=0)
    rates = [float(r) for r in args.rates.split(",")]
    RAW.mkdir(parents=True, exist_ok=True)
    settings = {"model": DEFAULT_MODEL, "tasks": args.tasks.split(","), "scalars": default_scalars(model)}
    settings |= {"rates": rates, "modes": ["agnostic", "aware"], "contract": Contract().spec, "samples": args.samples}
    (RAW / DIAGNOSTIC_MANIFEST).write_text(json.dumps(settings | {"length": args.length, "seed": 0}, indent=2))
    start = time.perf_counter()
    with progress_bar("contract diagnostic") as progress:
        scalars, modes = default_scalars(model), ("agnostic", "aware")
        rows = run_diagnostic(
            LocalRunner(model, tokenizer),
            samples,
            scalars,
            rates,
            modes,
            results=RAW / DIAGNOSTIC_FILE,
            progress=progress,
        )
    seconds = time.perf_counter() - start
    write_worked_map(LocalRunner(model, tokenizer), samples, rows, Contract(), RAW)
    page = write_diagnostic_page(RAW)
    summary = {
        "tasks": args.tasks.split(","),
        "samples_per_task": args.samples,
        "length": args.length,
        "rates": rates,
        "rows": len(rows),
        "seconds_this_run": seconds,
        "raises_margin": raises_margin(rows).to_dict("records"),
        "failure_mix": failure_mix(rows).to_dict("records"),
        "fixes": fixes(rows).to_dict("records"),
    }
    SUMMARY.write(summary)
    markdown = page.read_text().replace(f"]({WORKED_MAP})", "](contract_diagnostic.png)")
    (RESULTS / "contract_diagnostic.md").write_text(markdown)
    if (RAW / WORKED_MAP).exists():
        (RESULTS / "contract_diagnostic.png").write_bytes((RAW / WORKED_MAP).read_bytes())
    print(markdown)


if __name__ == "__main__":
    main()
