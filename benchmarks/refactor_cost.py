"""What a refactor costs at run time: `decode_speed` and `prefill_overhead` on two commits, in one run.

Both commits are checked out as git worktrees; each round runs both benchmarks from each worktree (its own
scripts against its own `src/`, in the same interpreter and environment), the order of the commits alternating
between rounds so drift in machine load hits both alike. Reported: per cell, the median over rounds of each
commit's time and the ratio after / before (1.00: no cost).

    python benchmarks/refactor_cost.py --before 25240ae [--after HEAD] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console

from kvsieve.harness.report import markdown_table
from results_io import Output

REPO = Path(__file__).resolve().parent.parent
#: Each benchmark's command-line options (kept small: the point is the ratio) and the time columns compared.
BENCHMARKS = {
    "decode_speed": (["--lengths", "2048,4096", "--steps", "30", "--kv-bits", "8"], ("context", "cache"), "step_ms"),
    "prefill_overhead": (
        ["--lengths", "2048", "--repeats", "3", "--policies", "snapkv,h2o,critical,trimkv+global"],
        ("context", "scorer"),
        "prefill_s",
    ),
}


def markdown(report: dict) -> str:
    header = ["benchmark", "cell", f"before ({report['before']}) ms", f"after ({report['after']}) ms", "after / before"]
    body = [
        [r["benchmark"], r["cell"], f"{r['before_ms']:.1f}", f"{r['after_ms']:.1f}", f"{r['ratio']:.3f}"]
        for r in report["rows"]
    ]
    return markdown_table(header, body) + "\n"


TABLE = Output("refactor_cost*", {"": markdown})


def short_hash(commit: str) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", commit], cwd=REPO, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def worktree(commit: str, where: Path) -> Path:
    """A detached checkout of `commit` under `where`."""
    path = where / commit
    subprocess.run(["git", "worktree", "add", "--detach", str(path), commit], cwd=REPO, check=True, capture_output=True)
    return path


def run_benchmark(tree: Path, name: str, stem: str) -> dict:
    """Run `name` from `tree` against `tree/src`; its JSON report."""
    options, _, _ = BENCHMARKS[name]
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{tree / 'benchmarks'}"}
    command = [sys.executable, str(tree / "benchmarks" / f"{name}.py"), *options, "--out", stem]
    subprocess.run(command, cwd=tree, env=env, check=True, capture_output=True)
    return json.loads((tree / "benchmarks" / "results" / f"{stem}.json").read_text())


def times(report: dict, name: str) -> dict[str, float]:
    """Milliseconds per cell of one report."""
    _, keys, column = BENCHMARKS[name]
    scale = 1e3 if column.endswith("_s") else 1.0
    return {" / ".join(str(row[k]) for k in keys): row[column] * scale for row in report["rows"]}


def measure(trees: dict[str, Path], rounds: int, console: Console) -> dict[str, dict[str, dict[str, list[float]]]]:
    """`[commit][benchmark][cell]` -> the times of every round."""
    out: dict = {commit: {name: {} for name in BENCHMARKS} for commit in trees}
    for round_ in range(rounds):
        order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
        for commit in order:
            for name in BENCHMARKS:
                console.print(f"round {round_ + 1}/{rounds}: {name} at {commit}")
                for cell, ms in times(run_benchmark(trees[commit], name, f"{name}_r{round_}"), name).items():
                    out[commit][name].setdefault(cell, []).append(ms)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the commit before the refactor")
    parser.add_argument("--after", default="HEAD", help="the commit after it (default HEAD)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="refactor_cost", type=TABLE.named, help="results file stem (refactor_cost*)")
    args = parser.parse_args()
    console = Console()
    commits = {label: short_hash(commit) for label, commit in (("before", args.before), ("after", args.after))}
    with tempfile.TemporaryDirectory() as scratch:
        trees = {c: worktree(c, Path(scratch)) for c in commits.values()}
        try:
            measured = measure(trees, args.rounds, console)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)
    before, after = measured[commits["before"]], measured[commits["after"]]
    rows = []
    for name in BENCHMARKS:
        for cell in before[name]:
            b, a = statistics.median(before[name][cell]), statistics.median(after[name][cell])
            rounds = {"before_rounds_ms": before[name][cell], "after_rounds_ms": after[name][cell]}
            rows.append({"benchmark": name, "cell": cell, "before_ms": b, "after_ms": a, "ratio": a / b, **rounds})
    report = {**commits, "rounds": args.rounds, "cpus": os.cpu_count(), "rows": rows}
    console.print(markdown(report))
    console.print(f"wrote {TABLE.write(report, args.out)}")


if __name__ == "__main__":
    main()
