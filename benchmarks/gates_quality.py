"""Do other gates for the default model reach the shipped gates' quality? The held-back perplexity protocol.

The protocol and documents of `learned_gates.py`'s ppl stage (6 held-back essays, prefix 1,024,
continuation 512, rates 0.5 / 0.7 / 0.8 / 0.9), `trimkv+global` with each checkpoint: the PPL change
against the full cache, and the paired difference against the shipped gates (bootstrap over
documents). Used for the gates of the fast trainer (float32 and bfloat16) against kvsieve 0.1's.

    python benchmarks/gates_quality.py --gates fast=DIR [bf16=DIR ...] [--out gates_quality]
"""

from __future__ import annotations

import argparse

import numpy as np

import kvsieve
from kvsieve.harness.data import essay_split, sample_documents
from kvsieve.harness.eval import bootstrap_delta_ci, pooled_delta_pct, run_ppl
from kvsieve.harness.progress import progress_bar
from kvsieve.harness.report import markdown_table
from kvsieve.harness.runners import LocalRunner
from kvsieve.selection.checkpoint import read_gates
from results_io import Output

RATES = [0.5, 0.7, 0.8, 0.9]
SHIPPED = "shipped"


def measure(checkpoints: dict[str, str]) -> dict:
    """PPL change per (checkpoint, rate), and each against the shipped gates, on the same documents."""
    model, tokenizer = kvsieve.load_model()
    documents = sample_documents(tokenizer, 6, 1024 + 512 + 1, names=essay_split()[1])
    specs = {SHIPPED: "trimkv+global"} | {name: f"trimkv+global:gates={path}" for name, path in checkpoints.items()}
    with progress_bar("perplexity, held-back essays") as progress:
        result = run_ppl(LocalRunner(model), documents, list(specs.values()), RATES, progress=progress)
    full, tokens = np.array(result.nll_full), result.tokens
    rows = []
    for name, spec in specs.items():
        seconds = None if name == SHIPPED else read_gates(checkpoints[name])[1].seconds
        for rate in RATES:
            nll, shipped = np.array(result.nll[spec, rate]), np.array(result.nll[specs[SHIPPED], rate])
            row = {"gates": name, "train_seconds": seconds, "rate": rate}
            row |= {"delta_pct": pooled_delta_pct(nll, full, tokens), "ci95": bootstrap_delta_ci(nll, full, tokens)}
            row |= {
                "vs_shipped": pooled_delta_pct(nll, shipped, tokens),
                "vs_ci95": bootstrap_delta_ci(nll, shipped, tokens),
            }
            rows.append(row)
    return {"documents": [name for name, _ in documents], "checkpoints": checkpoints, "rows": rows}


def markdown(report: dict) -> str:
    """PPL change per rate (and against the shipped gates) for each checkpoint; those passed with --gates marked."""
    body = []
    for name in dict.fromkeys(r["gates"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["gates"] == name]
        cells = [f"{r['delta_pct']:+.2f}% [{r['ci95'][0]:+.1f}, {r['ci95'][1]:+.1f}]" for r in rows]
        if name != SHIPPED:
            cells = [
                f"{c}; {r['vs_shipped']:+.2f} [{r['vs_ci95'][0]:+.2f}, {r['vs_ci95'][1]:+.2f}]"
                for c, r in zip(cells, rows, strict=True)
            ]
        body.append([name if name == SHIPPED else f"{name} (not shipped)", *cells])
    header = ["gates", *(f"{rate:.0%}" for rate in RATES)]
    caption = (
        f"trimkv+global, PPL change against the full cache [95% CI] on {len(report['documents'])} held-back essays "
        "(prefix 1024, continuation 512); after the semicolon: against the shipped gates on the same documents, "
        "paired bootstrap. shipped: the gates kvsieve ships for the model; not shipped: a checkpoint passed with "
        "--gates, read from the folder the JSON names"
    )
    return markdown_table(header, body) + "\n\n" + caption + "\n"


TABLE = Output("gates_quality*", {"": markdown})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gates", nargs="+", required=True, help="NAME=DIR checkpoints to compare")
    parser.add_argument("--out", default="gates_quality", type=TABLE.named, help="results file stem (gates_quality*)")
    args = parser.parse_args()
    checkpoints = dict(item.split("=", 1) for item in args.gates)
    report = measure(checkpoints)
    print(markdown(report))
    TABLE.write(report, args.out)


if __name__ == "__main__":
    main()
