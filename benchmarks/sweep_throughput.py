"""Sweep throughput: configurations per minute with one prefill per sample against one per configuration.

8 policies x 4 rates (+ the full cache) on 2k-token RULER samples (`niah_single_2`, essay
haystack). For each sample the whole sweep runs twice, back to back: once with "prefill once,
sieve many" and once re-prefilling for every configuration (what a library that compresses
during the prefill, like kvpress, must do). Both give the same rows (checked); the ratio of
configurations per minute is the speed-up. Writes benchmarks/results/sweep_throughput.json.

    python benchmarks/sweep_throughput.py [--samples 2] [--length 2048]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from kvsieve import load_model
from kvsieve.harness.data.suites import task_samples
from kvsieve.harness.eval.sweep import run_sweep
from kvsieve.harness.report import markdown_table
from kvsieve.harness.runners import LocalRunner

RESULTS = Path(__file__).parent / "results"
POLICIES = "snapkv,expected,importance,h2o,tova,knorm,streaming,random"
RATES = [0.25, 0.5, 0.75, 0.9]


def markdown(report: dict) -> str:
    """The report as a Markdown table: seconds and configurations per minute of each sweep, and the speed-up."""
    label = {"prefill once": "prefill once", "re-prefill": "re-prefill (as kvpress must)"}
    per_minute, base = report["configurations_per_minute"], report["configurations_per_minute"]["re-prefill"]
    body = [
        [label.get(name, name), str(report["configurations"]), f"{sum(seconds):.1f}", f"{per_minute[name]:.1f}",
         f"{per_minute[name] / base:.2f}x"]
        for name, seconds in report["seconds"].items()
    ]  # fmt: skip
    return markdown_table(["sweep", "configurations", "seconds", "configurations / min", "speed-up"], body) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--length", type=int, default=2048)
    args = parser.parse_args()
    model, tokenizer = load_model()
    samples = task_samples("niah_single_2", tokenizer, length=args.length, n=args.samples, seed=0)
    seconds = {"prefill once": [], "re-prefill": []}
    configurations = 0
    for sample in samples:
        start = time.perf_counter()
        once = run_sweep(LocalRunner(model, tokenizer), [sample], POLICIES, RATES)
        seconds["prefill once"].append(time.perf_counter() - start)
        start = time.perf_counter()
        again = run_sweep(LocalRunner(model, tokenizer), [sample], POLICIES, RATES, reprefill=True)
        seconds["re-prefill"].append(time.perf_counter() - start)
        # the same answers either way: only the time differs
        assert (again["output"].to_numpy() == once["output"].to_numpy()).all()
        assert np.allclose(again["gold_logprob"], once["gold_logprob"], rtol=1e-5)
        configurations += len(once)
    table = Table("sweep", "configurations", "seconds", "configurations / min", "speed-up")
    per_minute = {name: 60 * configurations / sum(s) for name, s in seconds.items()}
    speedup = per_minute["prefill once"] / per_minute["re-prefill"]
    for name, s in seconds.items():
        ratio = per_minute[name] / per_minute["re-prefill"]
        table.add_row(name, str(configurations), f"{sum(s):.1f}", f"{per_minute[name]:.1f}", f"{ratio:.2f}x")
    Console().print(table)
    report = {
        "policies": POLICIES.split(","),
        "rates": RATES,
        "samples": len(samples),
        "length": args.length,
        "configurations": configurations,
        "seconds": seconds,
        "configurations_per_minute": per_minute,
        "speedup": speedup,
        "prefill_seconds_median": float(np.median(once["prefill_seconds"])),
        "configuration_seconds_median": float(np.median(once["seconds"])),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sweep_throughput.json").write_text(json.dumps(report, indent=2))
    (RESULTS / "sweep_throughput.md").write_text(markdown(report))
    print(f"wrote {RESULTS / 'sweep_throughput.json'}")


if __name__ == "__main__":
    main()
