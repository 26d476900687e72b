"""Prefill time with sieve attention and statistics, per scorer, over the model's own SDPA prefill.

A scorer's cost at prefill is the observed prefill it needs (exactly what it declares in
`needs`: fused SDPA plus the last queries for window scorers; chunked attention with materialised exponentials
for scorers that read the attention accumulated over all queries) plus computing its scores
and keep indices; for kvzip, the reconstruction pass after the prefill (the context fed again,
`chunk` tokens a forward). After one untimed warm-up of each, every repeat runs the SDPA prefill and
every distinct observed prefill back to back; scoring is timed on the observations of the last
repeat. Medians over repeats.

    python benchmarks/prefill_overhead.py [--lengths 2048,4096] [--repeats 3]
    python benchmarks/prefill_overhead.py --policies kvzip:chunk=512,kvzip:chunk=1024,kvzip:chunk=2048 \
        --lengths 2048,4096,8192 --out prefill_overhead_kvzip
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table
from transformers import DynamicCache

from kvsieve import Needs, known_policies, load_model, make_policy, observe_prefill
from kvsieve.harness.data import long_context
from kvsieve.harness.report import markdown_table
from kvsieve.runtime.compat import cache_argument
from results_io import Output


def timed(fn: object, *args: object, **kwargs: object) -> tuple[float, object]:
    tick = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - tick, out


@torch.no_grad()
def sdpa_prefill(model: torch.nn.Module, ids: torch.Tensor) -> None:
    model.set_attn_implementation("sdpa")
    model(input_ids=ids, **cache_argument(model, DynamicCache()), use_cache=True, logits_to_keep=1)


def _kind(needs: Needs) -> str:
    if needs.reconstruction is not None:
        return f"reconstruct, chunk {needs.reconstruction.chunk}"
    return "accumulate" if needs.accumulated else "window"


def markdown(report: dict) -> str:
    """The report as a Markdown table: per scorer, its observed prefill and its time over SDPA at each context."""
    contexts = list(dict.fromkeys(r["context"] for r in report["rows"]))
    ratio = {(r["scorer"], r["context"]): r["ratio"] for r in report["rows"]}
    kinds = {r["scorer"]: r["prefill"] for r in report["rows"]}
    header = ["scorer", "observed prefill", *(f"{c / 1024:g}k ratio" for c in contexts)]
    body = [[scorer, kind, *(f"{ratio[scorer, c]:.2f}" for c in contexts)] for scorer, kind in kinds.items()]
    return markdown_table(header, body) + "\n"


TABLE = Output("prefill_overhead*", {"": markdown})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", type=float, default=0.8)
    parser.add_argument("--policies", help="comma-separated specs (default: every scorer)")
    parser.add_argument(
        "--out", default="prefill_overhead", type=TABLE.named, help="results file stem (prefill_overhead*)"
    )
    args = parser.parse_args()
    console = Console()
    model, tokenizer = load_model()
    lengths = [int(x) for x in args.lengths.split(",")]
    ids = long_context(tokenizer, max(lengths))
    names = args.policies.split(",") if args.policies else known_policies()
    policies = [make_policy(name) for name in names]
    rows = []
    for need in {policy.needs for policy in policies}:  # warm-up: first calls pay one-time costs
        sdpa_prefill(model, ids[:, :256])
        observe_prefill(model, ids[:, :256], need, tokenizer=tokenizer)
    for length in lengths:
        context = ids[:, :length]
        needs = {policy.name: policy.needs for policy in policies}
        runs: dict[object, list[float]] = {"sdpa": []} | {n: [] for n in set(needs.values())}
        observed = {}
        for _ in range(args.repeats):
            runs["sdpa"].append(timed(sdpa_prefill, model, context)[0])
            for need in set(needs.values()):
                seconds, observed[need] = timed(observe_prefill, model, context, need, tokenizer=tokenizer)
                runs[need].append(seconds)
        sdpa = statistics.median(runs["sdpa"])
        for policy in policies:
            kind = _kind(policy.needs)
            prefill = statistics.median(runs[policy.needs])
            scoring, _ = timed(policy.select, observed[policy.needs].observations[0], args.rate)
            rows.append(
                {
                    "context": length,
                    "scorer": policy.name,
                    "prefill": kind,
                    "sdpa_s": sdpa,
                    "prefill_s": prefill,
                    "scoring_s": scoring,
                    "ratio": (prefill + scoring) / sdpa,
                }
            )
        console.print(f"context {length}: SDPA {sdpa:.2f} s")
    table = Table(
        "context",
        "scorer",
        "observed prefill",
        "SDPA s",
        "prefill s",
        "scoring s",
        "ratio",
        title=f"prefill with statistics over SDPA prefill, medians of {args.repeats}, CPU float32",
    )
    for r in rows:
        table.add_row(
            str(r["context"]),
            r["scorer"],
            r["prefill"],
            f"{r['sdpa_s']:.2f}",
            f"{r['prefill_s']:.2f}",
            f"{r['scoring_s']:.3f}",
            f"{r['ratio']:.3f}",
        )
    console.print(table)
    meta = {"model": "SmolLM2-135M-Instruct (float32)", "device": "cpu", "threads": torch.get_num_threads()}
    payload = {**meta, "repeats": args.repeats, "rows": rows}
    console.print(f"wrote {TABLE.write(payload, args.out)}")


if __name__ == "__main__":
    main()
