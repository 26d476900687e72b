"""Streaming perplexity (docs/protocols.md) on the default model, with kvpress's DecodingPress side by side.

Whole essay documents are fed 64 tokens per forward through a cache held at a budget B (entries
per (layer, kv-head) on average) for every kvsieve policy and budget, next to the full cache (fed
while it fits the model's 8,192 positions) and to kvpress's `DecodingPress` around its scorer
presses at two budgets (compressed back to B after every forward). Per configuration: PPL after the
first B tokens with a bootstrap 95% interval over documents, the change against the full cache on
positions B..8192, PPL per 2k-position bucket, peak KV bytes held and allocated per sequence, peak
entries per head, and ms per token. Writes results/streaming_ppl.{json,md,png}.

    python benchmarks/streaming_ppl.py            # the full run (see SIZE for its length)
    python benchmarks/streaming_ppl.py --quick    # a smoke run of about a minute -> results/streaming_ppl_quick.*
"""

from __future__ import annotations

import argparse
import platform
import time
from typing import Any

import torch

import kvsieve
from kvsieve.harness.compare.kvpress import STREAMING_PRESSES
from kvsieve.harness.eval.streaming import (
    BUCKET,
    DOC_TOKENS,
    STREAM_BUDGETS,
    STREAM_POLICIES,
    STREAM_ROWS_PER_PASS,
    run_streaming,
    streaming_documents,
)
from kvsieve.harness.progress import progress_bar
from kvsieve.harness.report import markdown_table, plot_stream_ppl, stream_markdown
from kvsieve.harness.runners import LocalRunner
from kvsieve.runtime.eviction.growth import DEFAULT_BUFFER
from results_io import Output

#: kvpress's presses run at these budgets only (the comparison, not the sweep).
PRESS_BUDGETS = (512, 2048)
#: Documents of the full run (one batch of 2 rows), chosen from the measured speed so it stays within an hour.
DOCS = 2
#: How DOCS was chosen (recorded in the JSON).
SIZE = (
    "speed measured before the run (2 rows x 64-token chunks at steady state, single-threaded CPU time relative to "
    "a 2k-token SDPA prefill, which takes 2.44 s on the idle 2-core machine): about 0.18 s per chunk at budget 256, "
    "0.27 s at 1024 and 0.5-0.8 s at 4096 (h2o slowest). One batch of 2 documents x 16,384 tokens through "
    "25 kvsieve configurations, 10 kvpress ones and the full cache (to 8,192 positions) is then about 47 minutes; "
    "4 documents would take about 95. So 2 documents: the interval over documents is wide, read it as such."
)
#: The smoke run: one short document, two budgets, a few contenders (about a minute on 2 cores).
QUICK = {
    "docs": 1,
    "doc_tokens": 1024,
    "budgets": "256,512",
    "policies": "streaming,snapkv,h2o",
    "presses": "knorm,tova",
    "press_budgets": "256",
}


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default=",".join(map(str, STREAM_BUDGETS)))
    parser.add_argument("--policies", default=",".join(STREAM_POLICIES), help="kvsieve specs")
    parser.add_argument("--presses", default=",".join(STREAMING_PRESSES), help="kvpress presses ('' for none)")
    parser.add_argument("--press-budgets", default=",".join(map(str, PRESS_BUDGETS)))
    parser.add_argument("--docs", type=int, default=DOCS)
    parser.add_argument("--doc-tokens", type=int, default=DOC_TOKENS)
    parser.add_argument("--buffer", type=int, default=DEFAULT_BUFFER)
    parser.add_argument("--rows", type=int, default=STREAM_ROWS_PER_PASS, help="documents per batch")
    parser.add_argument("--quick", action="store_true", help="a smoke run of about a minute")
    args = parser.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def seconds_table(report: dict[str, Any]) -> str:
    """Markdown: wall seconds of the forwards per (policy, budget) and document."""
    body = [
        [
            r["policy"],
            "-" if r["budget"] is None else str(r["budget"]),
            f"{r['seconds'] / report['docs']:.1f}",
            f"{r['ms_per_token']:.2f}",
        ]
        for r in report["rows"]
    ]
    return markdown_table(["policy", "budget", "s per document", "ms/token"], body)


#: The kvsieve policy a kvpress press is set beside in the summary, where the names differ.
TWINS = {"streaming_llm": "streaming"}


def _vs_full(row: dict[str, Any] | None, ci: bool = True) -> str:
    """A row's PPL change against the full cache (with its interval unless `ci` is false); "-" without one."""
    if row is None or row["vs_full"] is None:
        return "-"
    change = row["vs_full"]
    interval = f" [{change['ci95'][0]:+.1f}, {change['ci95'][1]:+.1f}]" if ci else ""
    return f"{change['delta_pct']:+.1f}%{interval}"


def budget_markdown(report: dict[str, Any]) -> str:
    """Markdown: PPL change against the full cache, a row per contender and a column per budget."""
    rows = {(r["policy"], r["budget"]): r for r in report["rows"] if r["budget"] is not None}
    contenders = list(dict.fromkeys(policy for policy, _ in rows))
    budgets = sorted({budget for _, budget in rows})
    body = [[c, *(_vs_full(rows.get((c, b))) for b in budgets)] for c in contenders]
    return markdown_table(["policy", *(f"B={b}" for b in budgets)], body)


def _side_cells(row: dict[str, Any] | None, name: str) -> list[str]:
    """Name, change, ms/token and peak KV MiB of one side of the side-by-side table ("-" where it did not run)."""
    if row is None:
        return ["-"] * 4
    return [name, _vs_full(row, ci=False), f"{row['ms_per_token']:.2f}", f"{row['peak_kv_bytes'] / 2**20:.1f}"]


def side_by_side_markdown(report: dict[str, Any]) -> str:
    """Markdown: at each kvpress budget, each press next to the kvsieve policy with the same rule."""
    rows = {(r["policy"], r["budget"]): r for r in report["rows"] if r["budget"] is not None}
    names = list(dict.fromkeys(name for name, _ in rows))
    policies = [name for name in names if not name.startswith("kvpress:")]
    presses = [name.removeprefix("kvpress:") for name in names if name.startswith("kvpress:")]
    pairs = [(TWINS.get(press, press), press) for press in presses]
    pairs.sort(key=lambda pair: policies.index(pair[0]) if pair[0] in policies else len(policies))
    budgets = sorted({budget for name, budget in rows if name.startswith("kvpress:")})
    body = [
        [str(b), *_side_cells(rows.get((policy, b)), policy), *_side_cells(rows.get((f"kvpress:{press}", b)), press)]
        for b in budgets
        for policy, press in pairs
    ]
    header = ["at B", "kvsieve policy", "vs full", "ms/token", "peak KV MiB"]
    return markdown_table([*header, "kvpress press", "vs full", "ms/token", "peak KV MiB"], body)


def summary_markdown(report: dict[str, Any]) -> str:
    """Markdown: the two summary tables (change per budget; kvsieve and kvpress side by side)."""
    return f"{budget_markdown(report)}\n\n{side_by_side_markdown(report)}\n"


def markdown(report: dict[str, Any]) -> str:
    """Markdown: the whole table (PPL per bucket, bytes, entries, ms/token), then the seconds per document."""
    return f"{stream_markdown(report)}\n{seconds_table(report)}\n"


#: streaming_ppl (with --quick: streaming_ppl_quick), its summary and its plot.
TABLE = Output("streaming_ppl*", {"": markdown, "_summary": summary_markdown}, extras=(".png",))


def main() -> None:
    args = arguments()
    model, tokenizer = kvsieve.load_model()
    documents = streaming_documents(tokenizer, args.docs, args.doc_tokens)
    contenders = args.policies.split(",") + [f"kvpress:{p}" for p in args.presses.split(",") if p]
    start = time.perf_counter()
    with progress_bar("streaming perplexity") as progress:
        result = run_streaming(
            LocalRunner(model),
            documents,
            contenders,
            _ints(args.budgets),
            buffer=args.buffer,
            bucket=min(BUCKET, args.doc_tokens // 4),
            press_budgets=_ints(args.press_budgets),
            rows_per_pass=args.rows,
            progress=progress,
        )
    report = result.to_json()
    report["setup"] = {
        **vars(args),
        "model": "SmolLM2-135M-Instruct (embedded GGUF), float32, CPU",
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "wall_seconds": time.perf_counter() - start,
        "size": SIZE,
    }
    print(markdown(report))
    path = TABLE.write(report, "streaming_ppl_quick" if args.quick else "streaming_ppl")
    plot_stream_ppl(report, path.with_suffix(".png"))
    print(f"wrote {path}, .md, .png in {report['setup']['wall_seconds']:.0f} s")


if __name__ == "__main__":
    main()
