"""Compress once, ask many: one compression of a context, then every question it answers, from copies of it.

Contexts of `--samples` samples each of the multi-key needle tasks (RULER's `niah_multikey_1` and the
two unseen formats `niah_ledger`, `niah_locker`, which no training set of the gates uses) and of the
routing families `multi_entity` and `hops`, `--length` tokens; each context is asked every question
it answers (`harness.data.question_sets`: 3 to 6). Every policy compresses the context once, before
any question (`snapkv` also with the first question in view, then kept for the others), at
50 / 75 / 90 / 95% eviction. Writes benchmarks/results/agnostic_reuse{.json,.md}.

    python benchmarks/agnostic_reuse.py [--samples 3] [--length 1536]
"""

from __future__ import annotations

import argparse
import time

import pandas as pd
from rich.console import Console

from kvsieve.harness.data.question_sets import QUESTION_SET_TASKS, question_sets
from kvsieve.harness.eval.reuse import run_reuse
from kvsieve.harness.models import ModelChoice
from kvsieve.harness.progress import progress_bar
from kvsieve.harness.report import markdown_table
from kvsieve.harness.runners import LocalRunner
from results_io import Output

POLICIES = ["trimkv+global", "kvzip+global", "kvzip", "expected", "streaming", "kvpress:kvzip"]
FIRST_QUESTION = ["snapkv"]
RATES = [0.5, 0.75, 0.9, 0.95]
#: What the JSON keeps of each row.
COLUMNS = ["context", "task", "question", "compressed_with", "policy", "rate", "kv_bytes", "correct", "gold_logprob"]
#: Columns of the table: groups of tasks.
GROUPS = {
    "needles, RULER's format": ("niah_multikey_1",),
    "needles, unseen formats": ("niah_ledger", "niah_locker"),
    "routing (multi_entity, hops)": ("multi_entity", "hops"),
}


def contenders(rows: pd.DataFrame) -> list[tuple[str, str]]:
    """(policy, compressed with) in the order of the table: the full cache, then as listed."""
    order = ["full", *POLICIES, *FIRST_QUESTION]
    pairs = rows[["policy", "compressed_with"]].drop_duplicates().itertuples(index=False)
    return sorted(pairs, key=lambda p: (order.index(p[0]), p[1]))


def label(policy: str, compressed_with: str) -> str:
    if policy == "full":
        return "full cache"
    return f"{policy} (aware of the first question only)" if compressed_with == "first_question" else policy


def accuracy_cells(rows: pd.DataFrame, tasks: tuple[str, ...] | None = None) -> str:
    """Correct answers at each rate, of how many (the full cache: once)."""
    if tasks is not None:
        rows = rows[rows["task"].isin(tasks)]
    by_rate = rows.groupby("rate")["correct"]
    return " / ".join(str(int(s.sum())) for _, s in by_rate) + f" of {by_rate.size().iloc[0]}"


def rates_of(rows: pd.DataFrame) -> str:
    """The eviction rates the compressed rows ran at, as the tables' headers write them."""
    return " / ".join(f"{r:.0%}" for r in sorted(rows.loc[rows["policy"] != "full", "rate"].unique()))


def markdown(report: dict) -> str:
    """Three tables: correct answers per group of tasks, the first question against the later ones, and the
    mean gold log-prob with the cache held."""
    rows = pd.DataFrame(report["rows"])
    rates = rates_of(rows)
    header = ["policy", *(f"{group}: correct at {rates}" for group in GROUPS)]
    body, split = [], []
    for policy, how in contenders(rows):
        mine = rows[(rows["policy"] == policy) & (rows["compressed_with"] == how)]
        body.append([label(policy, how), *(accuracy_cells(mine, tasks) for tasks in GROUPS.values())])
        first, later = mine[mine["question"] == 0], mine[mine["question"] > 0]
        split.append([label(policy, how), accuracy_cells(first), accuracy_cells(later)])
    second = markdown_table(["policy", f"first question: correct at {rates}", f"later questions: at {rates}"], split)
    return markdown_table(header, body) + "\n\n" + second + "\n\n" + cost_table(rows) + "\n"


def cost_table(rows: pd.DataFrame) -> str:
    """Mean gold log-prob over every question, and the MiB of keys and values each context's cache holds."""
    body = []
    for policy, how in contenders(rows):
        mine = rows[(rows["policy"] == policy) & (rows["compressed_with"] == how)].groupby("rate")
        cells = [f"{logprob:.2f} ({kv / 2**20:.1f} MiB)" for logprob, kv in zip(
            mine["gold_logprob"].mean(), mine["kv_bytes"].mean(), strict=True)]  # fmt: skip
        body.append([label(policy, how), " / ".join(cells)])
    return markdown_table(["policy", f"gold log-prob (KV cache held) at {rates_of(rows)}"], body)


TABLE = Output("agnostic_reuse", {"": markdown})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--length", type=int, default=1536)
    args = parser.parse_args()
    model, tokenizer = ModelChoice().load()
    sets = question_sets(list(QUESTION_SET_TASKS), tokenizer, length=args.length, n=args.samples, seed=0)
    start = time.perf_counter()
    with progress_bar("compress once, ask many") as progress:
        rows = run_reuse(
            LocalRunner(model, tokenizer), sets, POLICIES, RATES, first_question=FIRST_QUESTION, progress=progress
        )
    report = {
        "tasks": list(QUESTION_SET_TASKS),
        "contexts": len(sets),
        "questions": sum(len(s) for s in sets),
        "length": args.length,
        "seconds": time.perf_counter() - start,
        "rows": rows[COLUMNS].to_dict("records"),
    }
    Console().print(markdown(report))
    print(f"wrote {TABLE.write(report)}")


if __name__ == "__main__":
    main()
