"""Where the lost needles sat: answers and kept evidence by the needle's depth in the context.

Issue 39's unseen needle formats (`niah_ledger`, `niah_locker`; no training set of the gates uses them),
question-agnostic, the gate ablation's samples (`--samples` per task, `--length` tokens, seed 0), so the
answers are those of its rows. Each sample's asked needle is placed by the start of its evidence in the
context (first, middle or last third); per policy, rate and third: needles answered (the full cache's
beside), the evidence recall (the share of the needle's tokens each (layer, kv-head) still stores, mean
over them) and GER (the share of its tokens no head of a layer stores, mean over layers; arXiv 2603.01426).
The figure (`needle_depth.png`) draws the evidence recall of each layer at 75%, every needle.
`--model gemma3-270m` writes `needle_depth_gemma3_270m.*` instead.

Raw rows go to results/needle_depth/results.jsonl (Gemma: results/needle_depth_gemma3_270m/; a rerun
resumes; rows of other policies or rates there are left out of the tables).

    python benchmarks/needle_depth.py [--policies "trimkv+global;kvzip+global"] [--rates 0.5,0.75,0.9] [--samples 30]
        [--model gemma3-270m]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
from rich.console import Console

from kvsieve import SievedCache, load_model
from kvsieve.harness.data.ruler import UNSEEN_TASKS
from kvsieve.harness.data.sample import TaskSample
from kvsieve.harness.data.suites import task_samples
from kvsieve.harness.eval.analysis import recall_by_depth
from kvsieve.harness.eval.contenders import parse_contenders
from kvsieve.harness.eval.sweep import run_sweep, sample_key
from kvsieve.harness.models import DEFAULT_MODEL, GEMMA_MODEL
from kvsieve.harness.progress import progress_bar
from kvsieve.harness.report import markdown_table, plot_recall_by_depth
from kvsieve.harness.runners import LocalRunner
from policy_args import policy_list
from results_io import RESULTS, Output, named_for

RAW = Path(__file__).parent.parent / "results"
THIRDS = ("first", "middle", "last")
POLICIES = (
    "trimkv+global;trimkv;trimkv+global:horizon=inf;kvzip+global;trimkv:horizon=inf;trimkv+adaptive;"
    "trimkv+adaptive:horizon=inf"
)
#: The rate whose evidence recall per layer the figure draws.
FIGURE_RATE = 0.75


def third(sample: TaskSample) -> str:
    """Which third of the context the asked needle starts in."""
    depth = min(start for start, _ in sample.evidence) / len(sample.context)
    return THIRDS[min(int(depth * 3), 2)]


def tally(rows: pd.DataFrame, labels: dict[str, str], column: str, policies: list[str]) -> list[dict]:
    """Per policy (in the order given), rate and `column` (each sample's label in `labels`): samples, answered, the
    full cache's answered, mean recall and GER."""
    rows = rows.assign(**{column: rows["sample"].map(labels)})
    full = rows[rows["policy"] == "full"].set_index("sample")["correct"]
    evicted = rows[rows["policy"] != "full"]
    evicted = evicted.assign(full_correct=evicted["sample"].map(full).astype(bool))
    table = evicted.groupby(["policy", "rate", column], sort=False).agg(
        samples=("correct", "size"),
        answered=("correct", "sum"),
        full=("full_correct", "sum"),
        recall=("recall_mean", "mean"),
        ger=("ger_layer", "mean"),
    )
    table = table.reset_index()
    table = table.sort_values(["policy", "rate"], key=lambda c: c.map(policies.index) if c.name == "policy" else c)
    return table.to_dict("records")


def by_task_markdown(report: dict) -> str:
    """Answered (the full cache's) and evidence recall per policy and rate, one column per task."""
    cells: dict[tuple[str, float], dict[str, str]] = {}
    for row in report["task_rows"]:
        cells.setdefault((row["policy"], row["rate"]), {})[row["task"]] = (
            f"{row['answered']} ({row['full']}) of {row['samples']}; {row['recall']:.2f}"
        )
    body = [
        [policy, f"{rate:.0%}", *(by.get(task, "") for task in report["tasks"])] for (policy, rate), by in cells.items()
    ]
    return markdown_table(["policy", "eviction", *report["tasks"]], body)


def markdown(report: dict) -> str:
    """Answered (full cache), evidence recall and GER per policy and rate, one column per third, and the total."""
    cells: dict[tuple[str, float], dict[str, str]] = {}
    totals: dict[tuple[str, float], list[int]] = {}
    counts = {}
    for row in report["rows"]:
        key = (row["policy"], row["rate"])
        cells.setdefault(key, {})[row["third"]] = (
            f"{row['answered']} ({row['full']}); {row['recall']:.2f}; {row['ger']:.2f}"
        )
        total = totals.setdefault(key, [0, 0])
        total[0], total[1] = total[0] + row["answered"], total[1] + row["full"]
        counts[row["third"]] = row["samples"]
    header = ["policy", "eviction", *(f"{name} third ({counts.get(name, 0)} needles)" for name in THIRDS)]
    header.append(f"answered, all {sum(counts.values())}")
    body = [
        [policy, f"{rate:.0%}", *(by.get(name, "") for name in THIRDS), "{} ({})".format(*totals[policy, rate])]
        for (policy, rate), by in cells.items()
    ]
    model = report.get("model", DEFAULT_MODEL)
    note = (
        f"\nNeedles answered (the full cache's in brackets); evidence recall; GER. Unseen formats "
        f"({', '.join(report['tasks'])}), {report['samples']} samples a task at {report['length']} tokens, "
        f"question-agnostic{'' if model == DEFAULT_MODEL else f', {model}'}.\n"
    )
    table = markdown_table(header, body) + note
    if "task_rows" in report:
        table += "\nPer task: needles answered (the full cache's in brackets); evidence recall.\n\n"
        table += by_task_markdown(report)
    return table


TABLE = Output("needle_depth*", {"": markdown}, extras=(".png",))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default=POLICIES, help="semicolon-separated kvsieve specs")
    parser.add_argument("--rates", default="0.5,0.75,0.9")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--length", type=int, default=1536)
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=[DEFAULT_MODEL, GEMMA_MODEL])
    args = parser.parse_args()
    stem = named_for("needle_depth", None if args.model == DEFAULT_MODEL else args.model)
    policies = policy_list(parser, args.policies)
    rates = [float(rate) for rate in args.rates.split(",")]
    model, tokenizer = load_model(args.model)
    samples = task_samples(list(UNSEEN_TASKS), tokenizer, length=args.length, n=args.samples, seed=0)
    raw = RAW / stem
    raw.mkdir(parents=True, exist_ok=True)
    with progress_bar("needles by depth") as progress:
        rows = run_sweep(
            LocalRunner(model, tokenizer), samples, policies, rates, results=raw / "results.jsonl", progress=progress
        )
    thirds = {sample_key(sample): third(sample) for sample in samples}
    names = [contender.name for contender in parse_contenders(policies)]
    rows = rows[rows["sample"].isin(thirds) & rows["policy"].isin(names)]
    rows = rows[(rows["policy"] == "full") | rows["rate"].isin(rates)]
    report = {"model": args.model, "tasks": list(UNSEEN_TASKS), "samples": args.samples, "length": args.length}
    report["rates"] = rates
    report["rows"] = tally(rows, thirds, "third", names)
    report["task_rows"] = tally(rows, {sample_key(sample): sample.task for sample in samples}, "task", names)
    layers = recall_by_depth(rows[(rows["policy"] != "full") & (rows["rate"] == FIGURE_RATE)])
    # the recall lists count the full-attention layers only: name them by the model's layer index
    layers["layer"] = layers["layer"].map(dict(enumerate(SievedCache.for_model(model).full_layers)))
    report["recall_by_layer"] = layers.to_dict("records")
    title = f"evidence recall per layer at {FIGURE_RATE:.0%}: {len(samples)} unseen-format needles"
    plot_recall_by_depth(layers, RESULTS / f"{stem}.png", title=title)
    Console().print(markdown(report))
    print(f"wrote {TABLE.write(report, stem)}")


if __name__ == "__main__":
    main()
