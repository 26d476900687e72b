"""Sweep throughput: one prefill per sample against one per configuration, here and on Ray; where the time goes.

8 policies x 4 rates (+ the full cache) on 2k-token RULER samples (`niah_single_2`, essay
haystack). Four ways to run the same sweep, each giving the same rows (checked):

- here, "prefill once, sieve many", and re-prefilling for every configuration (what a library
  that compresses during the prefill, like kvpress, must do; run once, it is slow);
- on a local Ray cluster with 1 replica (every core its torch threads) and with 2 (the cores
  shared: torch threads = cores / replicas); configurations per minute count the cells only,
  the start (cluster, replicas loading the model) is reported beside them. The three fast sweeps
  run `--repeats` times, interleaved; their medians are reported.

Then one sample's "prefill once" sweep under cProfile: the seconds of each stage per configuration
(scoring, eviction into rows, forking the cache, the teacher-forced gold answer, generation, the
routing diagnostics). Writes benchmarks/results/sweep_throughput{.json,.md}.

    python benchmarks/sweep_throughput.py [--samples 2] [--length 2048]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

import numpy as np
import pandas as pd
from rich.console import Console

from kvsieve.harness.data.suites import task_samples
from kvsieve.harness.eval.sweep import run_sweep
from kvsieve.harness.models import ModelChoice
from kvsieve.harness.report import markdown_table
from kvsieve.harness.runners import LocalRunner, Runner
from results_io import Output

POLICIES = "snapkv,expected,importance,h2o,tova,knorm,streaming,random"
RATES = [0.25, 0.5, 0.75, 0.9]
ONCE, REPREFILL = "here, prefill once", "here, re-prefill (as kvpress must)"
#: Profiled stages: (label, file suffix, function), cumulative seconds (a stage holds what it calls)...
STAGES = [
    ("prefill (observed, once per sample)", "runtime/observing/prefill.py", "observe_prefill"),
    ("scoring and selection", "selection/policy.py", "select"),
    ("copying the kept entries into the rows' cache", "runtime/api/evictions.py", "evictions"),
    ("forking the cache for the gold answer", "eval/respond.py", "fork"),
    ("the question and gold answer, teacher-forced", "eval/respond.py", "feed"),
    ("generating the answer (padded batch)", "generation/utils.py", "generate"),
    ("routing diagnostics", "eval/routing.py", "diagnose"),
]
#: ...but for this one, which calls the one named: that stage's seconds are taken out of it.
NESTED = {"copying the kept entries into the rows' cache": "scoring and selection"}


def _same_rows(got: pd.DataFrame, want: pd.DataFrame) -> None:
    assert (got["output"].to_numpy() == want["output"].to_numpy()).all()
    assert np.allclose(got["gold_logprob"], want["gold_logprob"], rtol=1e-5)


def _timed_sweep(runner: Runner, samples: list, **options: object) -> tuple[pd.DataFrame, float]:
    start = time.perf_counter()
    rows = run_sweep(runner, samples, POLICIES, RATES, **options)
    return rows, time.perf_counter() - start


def _median(values: list[float]) -> float:
    return float(np.median(values))


def ray_sweep(samples: list, workers: int, want: pd.DataFrame) -> tuple[float, float]:
    """(start seconds, sweep seconds) on a fresh local Ray cluster with `workers` replicas sharing the cores."""
    # the ray extra, imported here so that the script imports without it (tests/test_docs.py imports every script)
    from kvsieve.harness.runners.ray_runner import RayRunner

    start = time.perf_counter()
    with RayRunner(ModelChoice(), workers=workers, cpus_per_worker=os.cpu_count() // workers) as runner:
        started = time.perf_counter() - start
        rows, seconds = _timed_sweep(runner, samples)
    _same_rows(rows, want)
    return started, seconds


def profile(here: LocalRunner, sample: object) -> dict[str, float]:
    """Seconds per configuration of each stage (`STAGES`) of one sample's "prefill once" sweep, and the total."""
    profiler = cProfile.Profile()
    profiler.enable()
    rows, seconds = _timed_sweep(here, [sample])
    profiler.disable()
    by_function = pstats.Stats(profiler).stats  # (file, line, function) -> (calls, ..., cumulative, callers)
    stages = {
        label: sum(v[3] for (file, _, name), v in by_function.items() if file.endswith(suffix) and name == function)
        for label, suffix, function in STAGES
    }
    for outer, inner in NESTED.items():
        stages[outer] -= stages[inner]
    return {label: s / len(rows) for label, s in stages.items()} | {"total": seconds / len(rows)}


def markdown(report: dict) -> str:
    """Throughput per runner (with the speed-up over re-prefilling), then the profile per configuration."""
    per_minute, seconds, start = report["configurations_per_minute"], report["seconds"], report["start_seconds"]
    body = [
        [name, str(report["configurations"]), f"{seconds[name]:.1f}", f"{start.get(name, 0):.1f}",
         f"{per_minute[name]:.1f}", f"{per_minute[name] / per_minute[REPREFILL]:.2f}x"]
        for name in seconds
    ]  # fmt: skip
    header = ["sweep", "configurations", "seconds", "start s", "configurations / min", "speed-up"]
    stages = report["profile"]
    rows = [[label, f"{seconds:.3f}", f"{seconds / stages['total']:.0%}"] for label, seconds in stages.items()]
    profile = markdown_table(["stage (cProfile)", "s per configuration", "share"], rows)
    return markdown_table(header, body) + "\n\n" + profile + "\n"


TABLE = Output("sweep_throughput", {"": markdown})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each fast sweep (medians)")
    args = parser.parse_args()
    here = LocalRunner(*ModelChoice().load())
    samples = task_samples("niah_single_2", here.tokenizer, length=args.length, n=args.samples, seed=0)
    reprefilled, reprefill_seconds = _timed_sweep(here, samples, reprefill=True)
    ray_names = {w: f"Ray, {w} replica{'s' * (w > 1)} x {os.cpu_count() // w} threads" for w in (1, 2)}
    starts: dict[str, list[float]] = {name: [] for name in ray_names.values()}
    runs: dict[str, list[float]] = {ONCE: [], **{name: [] for name in ray_names.values()}}
    for _ in range(args.repeats):  # interleaved, so a slow spell of the machine hits every runner alike
        once, seconds = _timed_sweep(here, samples)
        _same_rows(once, reprefilled)
        runs[ONCE].append(seconds)
        for workers, name in ray_names.items():
            started, seconds = ray_sweep(samples, workers, reprefilled)
            runs[name].append(seconds)
            starts[name].append(started)
    seconds = {ONCE: _median(runs[ONCE]), REPREFILL: reprefill_seconds}
    seconds |= {name: _median(runs[name]) for name in ray_names.values()}
    start_seconds = {name: _median(s) for name, s in starts.items()}
    one_replica = ray_names[1]
    configurations = len(once)
    per_minute = {name: 60 * configurations / s for name, s in seconds.items()}
    report = {
        "policies": POLICIES.split(","),
        "rates": RATES,
        "samples": len(samples),
        "repeats": args.repeats,
        "runs_seconds": runs,
        "length": args.length,
        "cores": os.cpu_count(),
        "configurations": configurations,
        "seconds": seconds,
        "start_seconds": start_seconds,
        "configurations_per_minute": per_minute,
        "speedup": per_minute[ONCE] / per_minute[REPREFILL],
        "ray_overhead_seconds_per_cell": (seconds[one_replica] - seconds[ONCE]) / len(samples),
        "prefill_seconds_median": float(np.median(once["prefill_seconds"])),
        "configuration_seconds_median": float(np.median(once["seconds"])),
        "profile": profile(here, samples[0]),
    }
    Console().print(markdown(report))
    print(f"wrote {TABLE.write(report)}")


if __name__ == "__main__":
    main()
