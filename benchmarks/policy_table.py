"""The policy table: every scorer with `uniform`, then the best three with every other allocator.

The perplexity protocol (docs/protocols.md) on the default model at rates 0.5/0.7/0.8/0.9, same
documents for every policy. Stage 1 runs every scorer with the uniform budget (and the
key-key variant of `window`); the three with the lowest mean delta% then run with
`adaptive`, `pyramid` and `global` under both calibrations (`mass`, `zscore`). Prints
the tables, writes JSON, Markdown and two plots under benchmarks/results/.

    python benchmarks/policy_table.py [--docs 8] [--prefix 1024] [--continuation 512]
"""

from __future__ import annotations

import argparse
import statistics

from rich.console import Console

from kvsieve import known_policies, load_model
from kvsieve.harness.data import sample_documents
from kvsieve.harness.eval import run_ppl
from kvsieve.harness.progress import progress_bar
from kvsieve.harness.report import plot_ppl, ppl_markdown, ppl_table
from kvsieve.harness.runners import LocalRunner
from results_io import RESULTS, Output

ALLOCATED = ["adaptive", "pyramid", "global", "global:calibration=zscore"]


def subset(report: dict, policies: list[str]) -> dict:
    return report | {"rows": [r for r in report["rows"] if r["policy"] in policies]}


def markdown(report: dict) -> str:
    """The report's table, a row per policy."""
    return ppl_markdown(report, by_policy=True)


TABLE = Output("policy_table", {"": markdown}, extras=("_scorers.png", "_allocators.png"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--continuation", type=int, default=512)
    parser.add_argument("--rates", default="0.5,0.7,0.8,0.9")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    console = Console(width=200)
    rates = [float(r) for r in args.rates.split(",")]
    model, tokenizer = load_model()
    documents = sample_documents(tokenizer, args.docs, args.prefix + args.continuation + 1, seed=args.seed)

    scorers = [*known_policies(), "window:keykey=true"]
    with progress_bar("stage 1: every scorer, uniform") as progress:
        stage1 = run_ppl(
            LocalRunner(model), documents, scorers, rates, args.prefix, args.continuation, progress=progress
        )
    mean_delta = {p: statistics.mean(stage1.row(p, r)["delta_pct"] for r in rates) for p in stage1.policies}
    best = sorted((p for p in mean_delta if p != "random"), key=mean_delta.get)[:3]
    console.print(f"best three by mean delta%: {', '.join(best)}")

    combos = [f"{scorer}+{allocator}" for scorer in best for allocator in ALLOCATED]
    with progress_bar("stage 2: best three x allocators") as progress:
        stage2 = run_ppl(
            LocalRunner(model), documents, combos, rates, args.prefix, args.continuation, progress=progress
        )

    report = stage1.to_json()
    report["rows"] += stage2.to_json()["rows"]
    report["seconds"] = {"stage1": stage1.seconds, "stage2": stage2.seconds}
    report["best_three"] = best
    # the stages may observe differently (fused SDPA or chunked softmax): same baseline up to float rounding
    gap = max(abs(a - b) / a for a, b in zip(stage1.nll_full, stage2.nll_full, strict=True))
    assert gap < 1e-4, f"the two stages disagree on the full-cache NLL by {gap:.1e}"
    console.print(ppl_table(report, by_policy=True))

    TABLE.write(report)
    plot_ppl(subset(report, stage1.policies), RESULTS / "policy_table_scorers.png", title="every scorer, uniform")
    allocated = [*best, *stage2.policies]
    plot_ppl(subset(report, allocated), RESULTS / "policy_table_allocators.png", title="best three x allocators")
    console.print(f"wrote {RESULTS}/policy_table.{{json,md}} and two plots")


if __name__ == "__main__":
    main()
