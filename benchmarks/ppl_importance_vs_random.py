"""Importance vs random eviction: perplexity change against the full cache (docs/protocols.md protocol).

Runs on the embedded default model (SmolLM2-135M-Instruct), prints the table, writes JSON and
a PNG under benchmarks/results/. Also times "prefill once, sieve many" against re-running the
prefill for every (policy, rate), on the same documents and in the same run, and checks that
both give the same numbers.

    python benchmarks/ppl_importance_vs_random.py [--docs 8] [--policies importance,random]
"""

from __future__ import annotations

import argparse
import statistics

from rich.console import Console
from rich.table import Table

from kvsieve import load_model
from kvsieve.harness.data import sample_documents
from kvsieve.harness.eval import run_ppl
from kvsieve.harness.report import plot_ppl, ppl_markdown, ppl_table
from kvsieve.harness.runners import LocalRunner
from results_io import RESULTS, Output

TABLE = Output("ppl_importance_vs_random", {"": ppl_markdown}, extras=(".png",))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--continuation", type=int, default=512)
    parser.add_argument("--rates", default="0.5,0.7,0.8,0.9")
    parser.add_argument("--policies", default="importance,random")
    parser.add_argument("--timing-docs", type=int, default=2, help="documents for the re-prefill timing")
    parser.add_argument("--timing-repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    console = Console()
    rates = [float(r) for r in args.rates.split(",")]
    policies = args.policies.split(",")

    model, tokenizer = load_model()
    documents = sample_documents(tokenizer, args.docs, args.prefix + args.continuation + 1, seed=args.seed)
    result = run_ppl(LocalRunner(model), documents, policies, rates, args.prefix, args.continuation)
    report = result.to_json()
    console.print(ppl_table(report))

    # Timing: same documents, both ways, alternating, medians over repeats.
    timing_docs = documents[: args.timing_docs]
    once, again, identical = [], [], True
    for _ in range(args.timing_repeats):
        a = run_ppl(LocalRunner(model), timing_docs, policies, rates, args.prefix, args.continuation)
        b = run_ppl(LocalRunner(model), timing_docs, policies, rates, args.prefix, args.continuation, reprefill=True)
        once.append(a.seconds)
        again.append(b.seconds)
        identical &= all(abs(x - y) < 1e-3 for key in a.nll for x, y in zip(a.nll[key], b.nll[key], strict=True))

    def median(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    n_configs = len(policies) * len(rates)
    timing = {
        "documents": len(timing_docs),
        "configs_per_document": n_configs,
        "repeats": args.timing_repeats,
        "prefill_once_s": median(once, "total"),
        "reprefill_s": median(again, "total"),
        "speedup": median(again, "total") / median(once, "total"),
        "prefill_s_per_doc": median(once, "prefill") / len(timing_docs),
        "identical_results": identical,
    }
    table = Table(
        "way", "total s (median)", "prefill s", "evict s", "continuation s", title="prefill once vs re-prefill"
    )
    for name, runs in (("prefill once, sieve many", once), ("re-prefill per (policy, rate)", again)):
        table.add_row(name, *(f"{median(runs, k):.2f}" for k in ("total", "prefill", "evict", "continuation")))
    console.print(table)
    console.print(
        f"{len(timing_docs)} docs x {n_configs} configs: speed-up {timing['speedup']:.2f}x; "
        f"same numbers both ways: {identical}"
    )

    report["timing"] = timing
    TABLE.write(report)
    plot_ppl(report, RESULTS / "ppl_importance_vs_random.png")
    console.print(f"wrote {RESULTS}/ppl_importance_vs_random.{{json,md,png}}")


if __name__ == "__main__":
    main()
