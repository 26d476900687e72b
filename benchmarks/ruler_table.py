"""Task accuracy on the 11 RULER-style tasks and the routing probe suite, full cache vs the main policies.

RULER tasks at 2k tokens, 10 samples each, question-agnostic; the routing suite (7 families,
10 samples each, 1k tokens) question-agnostic and question-aware. Full cache and the main
policies at rates 0.5/0.75/0.9, one prefill per (sample, mode). Raw rows go to
results/ruler_table/<suite>/results.jsonl (a rerun resumes; rows of other policies or rates there are
left out of the tables), with an HTML report per suite next to them; the summary tables, JSON
and figures go to benchmarks/results/. The two suites can run as two processes (`--suites`).

    python benchmarks/ruler_table.py [--suites ruler,routing] [--samples 10] [--length 2048] [--routing-length 1024]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
from rich.console import Console

from kvsieve import load_model
from kvsieve.harness.data.suites import task_samples
from kvsieve.harness.eval.analysis import accuracy_by_rate, cliff, hallucination_vs_ger
from kvsieve.harness.eval.contenders import parse_contenders
from kvsieve.harness.eval.sweep import run_sweep, sample_key
from kvsieve.harness.progress import progress_bar
from kvsieve.harness.report import markdown_table
from kvsieve.harness.report.figures import plot_accuracy_vs_rate, plot_hallucination_vs_ger
from kvsieve.harness.report.html import write_report
from kvsieve.harness.runners import LocalRunner
from results_io import RESULTS, Output

RAW = Path(__file__).parent.parent / "results" / "ruler_table"


def task_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Accuracy (%) per (mode, policy, rate) and task, plus the mean over tasks (rows: configurations)."""
    rows = rows.assign(correct=rows["correct"].astype(float) * 100)
    table = rows.pivot_table(index=["mode", "policy", "rate"], columns="task", values="correct", aggfunc="mean")
    table = table[list(dict.fromkeys(rows["task"]))]
    table["mean"] = table.mean(axis=1)
    order = {p: i for i, p in enumerate(dict.fromkeys(rows["policy"]))}
    table = table.reset_index().sort_values(
        ["mode", "rate", "policy"], key=lambda c: c.map(order) if c.name == "policy" else c
    )
    return table.reset_index(drop=True)


def markdown(report: dict) -> str:
    """The summary's table: accuracy (%) per (mode, policy, rate) and task, and the mean over tasks."""
    table = pd.DataFrame(report["table"])
    header = [str(c) for c in table.columns]
    body = [
        [
            f"{v:.0%}" if c == "rate" else f"{v:.0f}" if isinstance(v, float) else str(v)
            for c, v in zip(header, row, strict=True)
        ]
        for row in table.itertuples(index=False)
    ]
    return markdown_table(header, body) + "\n"


#: ruler_table_<suite>: the summary, its table, and two figures (accuracy by rate; hallucination against GER).
TABLE = Output("ruler_table_*", {"": markdown}, extras=(".png", "_ger.png"))


def run_suite(model, tokenizer, suite: str, length: int, modes: tuple[str, ...], args, console: Console) -> None:
    """Sweep one suite, keep the requested configurations, write its table, cliff, figures and report."""
    rates = [float(r) for r in args.rates.split(",")]
    samples = task_samples(suite, tokenizer, length=length, n=args.samples, seed=args.seed)
    folder = RAW / suite
    folder.mkdir(parents=True, exist_ok=True)
    with progress_bar(f"{suite} at {length} tokens") as progress:
        rows = run_sweep(
            LocalRunner(model, tokenizer),
            samples,
            args.policies,
            rates,
            modes,
            results=folder / "results.jsonl",
            progress=progress,
        )
    wanted = {(c.name, r) for c in parse_contenders(args.policies) for r in ([0.0] if c.is_full else rates)}
    rows = rows[[(p, r) in wanted for p, r in zip(rows["policy"], rows["rate"], strict=True)]]
    rows = rows[rows["sample"].isin({sample_key(s) for s in samples}) & rows["mode"].isin(modes)]
    table = task_table(rows)
    console.print(f"[bold]{suite}[/bold]: accuracy (%) at {length} tokens, {args.samples} samples per task")
    console.print(table.round(1).to_string(index=False))
    halluc = hallucination_vs_ger(rows)
    summary = {
        "suite": suite,
        "length": length,
        "modes": list(modes),
        "samples_per_task": args.samples,
        "policies": args.policies,
        "rates": rates,
        "table": json.loads(table.to_json(orient="records")),
        "cliff": json.loads(cliff(rows).to_json(orient="records")),
        "hallucination_vs_ger": {k: halluc[k] for k in ("r_points", "r_samples", "n_points", "n_samples", "which")},
        "seconds": {
            "prefill": float(rows.groupby(["sample", "mode"])["prefill_seconds"].first().sum()),
            "configurations": float(rows["seconds"].sum()),
        },
    }
    TABLE.write(summary, f"ruler_table_{suite}")
    plot_accuracy_vs_rate(accuracy_by_rate(rows), RESULTS / f"ruler_table_{suite}.png", title=f"{suite} at {length}")
    plot_hallucination_vs_ger(halluc["points"], halluc["r_points"], RESULTS / f"ruler_table_{suite}_ger.png")
    console.print(f"hallucination vs GER: r_points={halluc['r_points']:.3f}, r_samples={halluc['r_samples']:.3f}")
    console.print(f"wrote {RESULTS}/ruler_table_{suite}.{{json,md,png}} and {write_report(folder)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suites", default="ruler,routing")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--routing-length", type=int, default=1024)
    parser.add_argument("--policies", default="snapkv,expected,random")
    parser.add_argument("--rates", default="0.5,0.75,0.9")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    console = Console(width=220)
    model, tokenizer = load_model()
    RESULTS.mkdir(exist_ok=True)
    plans = {"ruler": (args.length, ("agnostic",)), "routing": (args.routing_length, ("agnostic", "aware"))}
    for suite in args.suites.split(","):
        length, modes = plans[suite]
        run_suite(model, tokenizer, suite, length, modes, args, console)


if __name__ == "__main__":
    main()
