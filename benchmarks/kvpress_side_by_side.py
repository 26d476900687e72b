"""kvsieve and kvpress side by side: the same samples, the same number of kept entries, one sweep.

Each kvpress press runs next to its kvsieve counterpart (same scoring rule) on 2k-token RULER
samples, question-agnostic, at rates 0.25/0.5/0.75 (kvpress's ratio converted so both keep the
same number of entries). Per rate and pair: accuracy, mean gold log-probability, KV bytes
actually held and wall seconds per configuration (kvsieve: eviction + answer + its share of the
one prefill; kvpress: its compressing prefill + answer). Raw rows: results/kvpress_side_by_side/
(a rerun resumes); summary: benchmarks/results/kvpress_side_by_side.{json,md}.

    python benchmarks/kvpress_side_by_side.py [--samples 3] [--tasks niah_single_2,niah_multikey_1]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
from rich.console import Console

from kvsieve import load_model
from kvsieve.harness.data.suites import task_samples
from kvsieve.harness.eval.sweep import run_sweep
from kvsieve.harness.progress import progress_bar
from kvsieve.harness.report import markdown_table
from kvsieve.harness.runners import LocalRunner
from results_io import Output

RAW = Path(__file__).parent.parent / "results" / "kvpress_side_by_side"

#: kvsieve policy -> the kvpress press with the same scoring rule.
PAIRS = {
    "random": "random",
    "knorm": "knorm",
    "streaming": "streaming_llm",
    "tova": "tova",
    "snapkv": "snapkv",
    "importance": "observed_attention",
    "expected": "expected_attention",
    "expected+adaptive": "adakv_expected_attention",
}


def side_by_side(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per (rate, pair): both libraries' accuracy, gold log-prob, KV MiB and wall seconds."""
    stats = rows.groupby(["policy", "rate"]).agg(
        accuracy=("correct", "mean"),
        gold_logprob=("gold_logprob", "mean"),
        kv_mib=("kv_bytes", lambda b: b.mean() / 2**20),
        kept=("kept_entries", "mean"),
        wall_s=("wall_seconds", "mean"),
        n=("correct", "size"),
    )
    lines = []
    for rate in sorted(rows.loc[rows["policy"] != "full", "rate"].unique()):
        for ours, theirs in PAIRS.items():
            a, b = stats.loc[(ours, rate)], stats.loc[(f"kvpress:{theirs}", rate)]
            if a["kept"] != b["kept"]:
                raise AssertionError(f"{ours} and {theirs} keep different entry counts at {rate}")
            lines.append(
                {
                    "rate": rate,
                    "kvsieve": ours,
                    "kvpress": theirs,
                    "acc_kvsieve": 100 * a["accuracy"],
                    "acc_kvpress": 100 * b["accuracy"],
                    "logprob_kvsieve": a["gold_logprob"],
                    "logprob_kvpress": b["gold_logprob"],
                    "kv_mib_kvsieve": a["kv_mib"],
                    "kv_mib_kvpress": b["kv_mib"],
                    "wall_s_kvsieve": a["wall_s"],
                    "wall_s_kvpress": b["wall_s"],
                    "n": int(a["n"]),
                }
            )
    return pd.DataFrame(lines)


def markdown(report: dict) -> str:
    """Each kvsieve policy beside the kvpress press with its rule, per rate; the full cache in the caption."""
    table, full = pd.DataFrame(report["rows"]), report["full"]
    header = [
        "rate",
        "kvsieve / kvpress",
        "accuracy % (kvsieve / kvpress)",
        "gold log-prob",
        "KV MiB held",
        "wall s per config",
    ]
    body = [
        [
            f"{r.rate:.0%}",
            f"{r.kvsieve} / {r.kvpress}",
            f"{r.acc_kvsieve:.0f} / {r.acc_kvpress:.0f}",
            f"{r.logprob_kvsieve:.2f} / {r.logprob_kvpress:.2f}",
            f"{r.kv_mib_kvsieve:.2f} / {r.kv_mib_kvpress:.2f}",
            f"{r.wall_s_kvsieve:.2f} / {r.wall_s_kvpress:.2f}",
        ]
        for r in table.itertuples()
    ]
    caption = (
        f"full cache: accuracy {100 * full['accuracy']:.0f}%, gold log-prob {full['gold_logprob']:.2f}, "
        f"KV {full['kv_mib']:.2f} MiB, wall {full['wall_s']:.2f} s; {int(full['n'])} samples"
    )
    return markdown_table(header, body) + f"\n\n{caption}\n"


TABLE = Output("kvpress_side_by_side", {"": markdown})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--tasks", default="niah_single_2,niah_multikey_1")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--rates", default="0.25,0.5,0.75")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    model, tokenizer = load_model()
    samples = task_samples(args.tasks, tokenizer, length=args.length, n=args.samples, seed=0)
    policies = [*PAIRS, *(f"kvpress:{press}" for press in PAIRS.values())]
    RAW.mkdir(parents=True, exist_ok=True)
    with progress_bar("kvsieve and kvpress, same samples") as progress:
        rows = run_sweep(
            LocalRunner(model, tokenizer), samples, policies, rates, results=RAW / "results.jsonl", progress=progress
        )
    table = side_by_side(rows)
    full_rows = rows[rows["policy"] == "full"]
    full = pd.Series(
        {
            "accuracy": full_rows["correct"].mean(),
            "gold_logprob": full_rows["gold_logprob"].mean(),
            "kv_mib": full_rows["kv_bytes"].mean() / 2**20,
            "wall_s": full_rows["wall_seconds"].mean(),
            "n": len(full_rows),
        }
    )
    summary = {"tasks": args.tasks, "samples_per_task": args.samples, "length": args.length, "rates": rates}
    summary |= {"full": full.to_dict(), "rows": json.loads(table.to_json(orient="records"))}
    Console(width=200).print(markdown(summary))
    print(f"wrote {TABLE.write(summary)}")


if __name__ == "__main__":
    main()
