"""kvsieve at both ends of the supported transformers range: import time and the decode step against the full cache.

Runs `import_time.py` and `decode_speed.py` once in each environment (by default `make`'s two: `.venv`,
the newest transformers, and `.venv-compare`, the oldest), one environment after the other on the same
machine, and writes one table: the seconds `import kvsieve` adds after `import transformers`, and each
evicted cache's decode step as a ratio of the full cache's, measured in the same run (medians).

    python benchmarks/transformers_versions.py [--envs .venv,.venv-compare] [--lengths 2048,4096]
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from kvsieve.harness.progress import console
from kvsieve.harness.report import markdown_table
from results_io import RESULTS, Output, named_for

HERE = Path(__file__).parent


def run_in(env: Path, script: str, *args: str) -> dict:
    """Run a benchmark script with `env`'s Python; return the report it wrote."""
    stem = named_for(Path(script).stem, env.name.lstrip("."))
    subprocess.run([str(env / "bin" / "python"), str(HERE / script), *args, "--out", stem], check=True)
    return json.loads((RESULTS / f"{stem}.json").read_text())


def rows_of(imports: dict, decode: dict) -> list[dict]:
    """One row per (context, cache) of the decode report, with the environment's import time beside it."""
    added = next(
        r["median_s"] for r in imports["rows"] if r["stage"] == "after transformers" and "kvsieve" in r["import"]
    )
    return [
        {
            "transformers": decode["transformers"],
            "import_kvsieve_s": added,
            "context": r["context"],
            "cache": r["cache"],
            "step_ms": r["step_ms"],
            "ratio_vs_full": r["ratio_vs_full"],
        }
        for r in decode["rows"]
    ]


def markdown(report: dict) -> str:
    """The report as a Markdown table: one row per (release, context, cache)."""
    header = ["transformers", "`import kvsieve` s", "context", "cache", "step ms", "ratio vs full"]
    body = [
        [r["transformers"], f"{r['import_kvsieve_s']:.3f}", str(r["context"]), r["cache"], f"{r['step_ms']:.1f}",
         f"{r['ratio_vs_full']:.3f}"]
        for r in report["rows"]
    ]  # fmt: skip
    return markdown_table(header, body) + "\n"


TABLE = Output("transformers_versions", {"": markdown})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", default=".venv,.venv-compare", help="virtual environments, comma-separated")
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--steps", default="40")
    parser.add_argument("--repeats", default="7", help="fresh interpreters per import timing")
    args = parser.parse_args()
    rows = []
    for env in (Path(name) for name in args.envs.split(",")):
        imports = run_in(env, "import_time.py", "--repeats", args.repeats)
        decode = run_in(env, "decode_speed.py", "--lengths", args.lengths, "--kv-bits", "", "--steps", args.steps)
        rows += rows_of(imports, decode)
    report = {"steps": int(args.steps), "import_repeats": int(args.repeats), "rows": rows}
    console.print(markdown(report))
    console.print(f"wrote {TABLE.write(report)}")


if __name__ == "__main__":
    main()
