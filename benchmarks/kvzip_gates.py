"""Gates taught by KVzip against the shipped gates (taught by the full cache), on needle formats they never saw.

Trains gates for the default model with `train-gates --target kvzip` (Fast KVzip's target, arXiv
2601.17668: KVzip's keep decision at the capacity) at capacity 128 (KVzip always keeps 33 entries of a head, so
the default gates' 32 would leave it nothing to decide) and every other setting as seed 0 of the default gates'
recipe recorded (`make gates-seed0`: the varied suite among the task samples, 160 steps of 1,024 tokens, read 128
tokens ahead), then runs them, the default gates (that recipe's five seeds, `make gates`), seed 0 alone (the same
training but for the target and the capacity) and their teacher `kvzip+global`, question-agnostic at
50 / 75 / 90 / 95% on `--samples` samples of: needles in RULER's format (seen in training: `niah_single_2`,
`niah_multikey_1`), needles in the two formats no training set uses (`niah_ledger`, `niah_locker`), and the routing
families `multi_entity` and `hops`.
Writes benchmarks/results/kvzip_gates{.json,.md}; the gates go to `--gates` (default:
~/.cache/kvsieve/gates/smollm2-135m-kvzip-varied; a rerun resumes there).

    python benchmarks/kvzip_gates.py [--samples 10] [--length 1536] [--gates DIR]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
from rich.console import Console

from kvsieve.harness.data.suites import task_samples
from kvsieve.harness.eval.sweep import run_sweep
from kvsieve.harness.models import DEFAULT_MODEL, ModelChoice, cache_home
from kvsieve.harness.progress import progress_bar
from kvsieve.harness.report import markdown_table
from kvsieve.harness.runners import LocalRunner
from kvsieve.harness.training.train import TrainConfig, train_gates
from kvsieve.selection.checkpoint import read_gates, resolve_gates
from results_io import Output

RATES = [0.5, 0.75, 0.9, 0.95]
#: The capacity KVzip's keep decision is taught at (above the 33 entries of a head it always keeps).
TAUGHT_CAPACITY = 128
#: What the JSON keeps of each row.
COLUMNS = ["sample", "task", "policy", "rate", "kv_bytes", "correct", "gold_logprob"]
#: Seed 0 of the default gates' recipe: the taught gates' settings but the target and the capacity.
SEED0 = "smollm2-135m-capacity32-varied"
GROUPS = {
    "needles, RULER's format (seen)": ("niah_single_2", "niah_multikey_1"),
    "needles, unseen formats": ("niah_ledger", "niah_locker"),
    "routing": ("multi_entity", "hops"),
}


def train(model, tokenizer, out: Path) -> dict:
    """Gates taught by KVzip at `TAUGHT_CAPACITY`, trained (or resumed) in `out` with `SEED0`'s other settings; what
    the training recorded."""
    seed0, made = read_gates(resolve_gates(SEED0))
    settings = made.data["config"] | {"curriculum": tuple(made.data["config"]["curriculum"])}
    config = TrainConfig(**settings | {"target": "kvzip", "capacity": TAUGHT_CAPACITY})
    _, record = train_gates(model, tokenizer, config, out, DEFAULT_MODEL, horizons=seed0.horizons)
    return {
        "seconds": record.seconds,
        "steps": record.steps,
        "capacity": record.capacity,
        "sequences": record.data["sequences"],
    }


def markdown(report: dict) -> str:
    """Correct answers per policy and group of tasks at each rate, and the mean gold log-prob of each group."""
    rows = pd.DataFrame(report["rows"])
    rates = " / ".join(f"{r:.0%}" for r in RATES)
    correct, logprob = [], []
    for name in dict.fromkeys(rows["policy"]):
        mine = rows[rows["policy"] == name]
        counts, means = [], []
        for tasks in GROUPS.values():
            by_rate = mine[mine["task"].isin(tasks)].groupby("rate")
            counts.append(
                " / ".join(str(int(s.sum())) for _, s in by_rate["correct"]) + f" of {by_rate.size().iloc[0]}"
            )
            means.append(" / ".join(f"{m:.2f}" for m in by_rate["gold_logprob"].mean()))
        correct.append([name, *counts])
        logprob.append([name, *means])
    first = markdown_table(["policy", *(f"{group}: correct at {rates}" for group in GROUPS)], correct)
    second = markdown_table(["policy", *(f"{group}: gold log-prob at {rates}" for group in GROUPS)], logprob)
    return first + "\n\n" + second + "\n"


TABLE = Output("kvzip_gates", {"": markdown})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--length", type=int, default=1536)
    parser.add_argument("--gates", type=Path, default=cache_home() / "gates" / "smollm2-135m-kvzip-varied")
    args = parser.parse_args()
    model, tokenizer = ModelChoice().load()
    training = train(model, tokenizer, args.gates)
    taught = f"trimkv+global:gates={args.gates}"
    labels = {
        "full": "full cache",
        "trimkv+global": "trimkv+global (default gates: the full cache's output, five seeds)",
        f"trimkv+global:gates={SEED0}": "trimkv+global (seed 0 of the default gates)",
        taught: "trimkv+global (gates taught by KVzip)",
        "kvzip+global": "kvzip+global (the teacher)",
    }
    tasks = [task for group in GROUPS.values() for task in group]
    samples = task_samples(tasks, tokenizer, length=args.length, n=args.samples, seed=0)
    start = time.perf_counter()
    with progress_bar("gates taught by KVzip") as progress:
        rows = run_sweep(LocalRunner(model, tokenizer), samples, list(labels)[1:], RATES, progress=progress)
    report = {
        "training": training,
        "samples": len(samples),
        "length": args.length,
        "seconds": time.perf_counter() - start,
        "rows": rows[COLUMNS].assign(policy=rows["policy"].map(labels)).to_dict("records"),
    }
    Console().print(markdown(report))
    print(f"wrote {TABLE.write(report)}")


if __name__ == "__main__":
    main()
