"""What `import kvsieve` costs beyond its dependencies, in fresh interpreters.

Each repeat starts a new Python process that imports torch, then transformers (the lazy package),
then what kvsieve needs of transformers' heavy modules for a model (`PreTrainedModel`), then
kvsieve; another process imports kvsieve right after transformers (what a user's `import kvsieve`
costs when no model class is loaded yet). Reports medians over the repeats.

    python benchmarks/import_time.py [--repeats 9] [--out import_time]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from importlib.metadata import version

from kvsieve.harness.progress import console
from kvsieve.harness.report import markdown_table
from results_io import Output

#: Each stage's import, timed in order in one process.
STAGES = {
    "after transformers": ["import torch", "import transformers", "import kvsieve"],
    "after PreTrainedModel": [
        "import torch",
        "import transformers",
        "from transformers import PreTrainedModel",
        "import kvsieve",
    ],
}


def _timed(statements: list[str]) -> list[float]:
    """Seconds of each statement, run in order in a fresh interpreter."""
    script = "import json, time\nout = []\n"
    for statement in statements:
        script += f"t = time.perf_counter()\n{statement}\nout.append(time.perf_counter() - t)\n"
    script += "print(json.dumps(out))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def measure(repeats: int) -> list[dict]:
    """One row per (stage, statement): the median seconds over `repeats` fresh processes."""
    rows = []
    for stage, statements in STAGES.items():
        runs = [_timed(statements) for _ in range(repeats)]
        for i, statement in enumerate(statements):
            rows.append({"stage": stage, "import": statement, "median_s": statistics.median(r[i] for r in runs)})
    return rows


def markdown(report: dict) -> str:
    """The table of the report."""
    body = [[r["stage"], f"`{r['import']}`", f"{r['median_s']:.3f}"] for r in report["rows"]]
    return markdown_table(["process", "import", "seconds (median)"], body) + "\n"


TABLE = Output("import_time*", {"": markdown})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="import_time", type=TABLE.named, help="results file stem (import_time*)")
    args = parser.parse_args()
    report = {
        "repeats": args.repeats,
        "python": sys.version.split()[0],
        "transformers": version("transformers"),
        "rows": measure(args.repeats),
    }
    console.print(markdown(report))
    console.print(f"wrote {TABLE.write(report, args.out)}")


if __name__ == "__main__":
    main()
