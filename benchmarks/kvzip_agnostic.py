"""KVzip against the learned gates and the heuristics, question-agnostic, on needles (arXiv 2505.23416).

`--samples` samples each of `niah_single_2` and `niah_multikey_1` (essay haystack, `--length` tokens),
the context compressed before the question is seen, at 50 / 75 / 90 / 95% eviction; one prefill per sample
(kvzip's reconstruction pass included, which every configuration of the sample then shares). Writes
benchmarks/results/kvzip_agnostic{.json,.md}.

    python benchmarks/kvzip_agnostic.py [--samples 6] [--length 1536]
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console

from kvsieve.harness.data.suites import task_samples
from kvsieve.harness.eval.analysis import accuracy_by_rate
from kvsieve.harness.eval.sweep import run_sweep
from kvsieve.harness.models import ModelChoice
from kvsieve.harness.progress import progress_bar
from kvsieve.harness.report import markdown_table
from kvsieve.harness.runners import LocalRunner
from results_io import Output

TASKS = "niah_single_2,niah_multikey_1"
POLICIES = ["trimkv+global", "kvzip+global", "kvzip", "snapkv", "expected", "streaming"]
RATES = [0.5, 0.75, 0.9, 0.95]


def markdown(report: dict) -> str:
    """Correct answers per policy and rate (and the mean gold log-prob), the full cache first."""
    cells = {(r["policy"], r["rate"]): r for r in report["rows"]}
    n = report["rows"][0]["n"]
    full = cells["full", 0.0]
    body = [["full cache", *[f"{round(full['accuracy'] * n)}/{n} ({full['mean_gold_logprob']:.2f})"] * len(RATES)]]
    for policy in POLICIES:
        body.append(
            [policy, *(f"{round(cells[policy, r]['accuracy'] * n)}/{n} ({cells[policy, r]['mean_gold_logprob']:.2f})"
                       for r in RATES)]
        )  # fmt: skip
    header = ["policy", *(f"{rate:.0%} evicted: correct (gold log-prob)" for rate in RATES)]
    return markdown_table(header, body) + "\n"


TABLE = Output("kvzip_agnostic", {"": markdown})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--length", type=int, default=1536)
    args = parser.parse_args()
    model, tokenizer = ModelChoice().load()
    samples = task_samples(TASKS, tokenizer, length=args.length, n=args.samples, seed=0)
    start = time.perf_counter()
    with progress_bar("kvzip, question-agnostic") as progress:
        rows = run_sweep(LocalRunner(model, tokenizer), samples, POLICIES, RATES, progress=progress)
    seconds = time.perf_counter() - start
    stats = accuracy_by_rate(rows)
    stats = stats[(stats["policy"] == "full") | (stats["rate"] > 0)]
    report = {
        "tasks": TASKS.split(","),
        "samples": len(samples),
        "length": args.length,
        "seconds": seconds,
        "prefill_seconds_median": float(rows["prefill_seconds"].median()),
        "rows": stats[["policy", "rate", "n", "accuracy", "mean_gold_logprob", "mean_kv_bytes"]].to_dict("records"),
    }
    Console().print(markdown(report))
    print(f"wrote {TABLE.write(report)}")


if __name__ == "__main__":
    main()
