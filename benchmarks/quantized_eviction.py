"""Quantized entries stacked on eviction, compared at equal bytes: which mix of bits and kept entries wins?

The model runs in bfloat16, so the full cache holds 16 bits per number (as served on GPUs). At byte
budgets of 50, 25, 12.5 and 6.25% of that full cache, every policy reaches the budget four ways:
eviction alone (16 bits), or 8-, 4- or 2-bit entries (`kv_bits`; one scale and one minimum per 32
channels, so 9, 5 and 3 bits per number; the newest 32 entries of every head in bfloat16) with as
much eviction as the bytes leave. Where a width fits the budget with nothing evicted, that mix is
quantization alone. A mix keeps the entries a byte budget would give it over a nominal context
(`kept_entries`; sinks and the recent tail always kept); the tables report the bytes each row held.

- ``ppl``: the perplexity protocol (docs/protocols.md) on held-back essays; also trimkv+global and snapkv
  quantized at the *eviction-only* rates (the same entries, fewer bits): do the gates, trained on
  full-precision entries, compose with quantization without retraining?
- ``tasks``: the RULER needle tasks and the routing suite, question-agnostic and -aware.
- ``stream``: streaming perplexity (held-back essays) at the bytes of 1,024 / 512 / 256 / 128
  bfloat16 entries per (layer, kv-head), i.e. 50 / 25 / 12.5 / 6.25% of a 2,048-token cache, every
  run scored on the same tokens (after the first 2,048).

- ``kvpress``: kvpress's snapkv and expected-attention presses over its own quantized cache (4 and 2 bits;
  `transformers`' `QuantizedCache` with optimum-quanto) next to kvsieve's, by perplexity at the same bytes.

Each stage writes `benchmarks/results/quantized_eviction_<stage>.{json,md}`.

    python benchmarks/quantized_eviction.py [--stages ppl,tasks,stream,kvpress] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

import kvsieve
from kvsieve.harness.compare.kvpress_quantized import KVPRESS_KV_BITS
from kvsieve.harness.data import essay_split, sample_documents, task_samples
from kvsieve.harness.data.ruler import RULER_TASKS
from kvsieve.harness.eval import run_ppl
from kvsieve.harness.eval.analysis import accuracy_by_rate
from kvsieve.harness.eval.stats import bootstrap_delta_ci, pooled_delta_pct
from kvsieve.harness.eval.streaming import run_streaming, streaming_documents
from kvsieve.harness.eval.sweep import run_sweep
from kvsieve.harness.progress import console, progress_bar
from kvsieve.harness.report import markdown_table
from kvsieve.harness.runners import LocalRunner
from kvsieve.runtime.codecs import DEFAULT_RESIDUAL, make_codec
from kvsieve.selection.architecture import kv_geometry
from kvsieve.selection.protection import DEFAULT_N_RECENT, DEFAULT_N_SINK

RESULTS = Path(__file__).parent / "results"
FRACTIONS = (0.5, 0.25, 0.125, 0.0625)
BITS = (16, 8, 4, 2)
POLICIES = ("trimkv+global", "snapkv", "expected", "h2o", "streaming")
#: Quantized at the eviction-only rates too (the same entries, fewer bits).
COMPOSED = ("trimkv+global", "snapkv")
#: Any policy at rate 0 keeps every entry: quantization alone.
ALONE = "streaming"
NEEDLES = tuple(task for task in RULER_TASKS if task.startswith("niah"))
#: kvsieve's best policy, then the policies whose scoring rule a kvpress press shares (`PRESSES`, in order).
KVPRESS_OURS = ("trimkv+global", "snapkv", "expected")
PRESSES = ("snapkv", "expected_attention")
KVPRESS_ROWS = ("trimkv+global", "snapkv", "kvpress:snapkv", "expected", "kvpress:expected_attention")
#: Widths kvpress's quantized cache stores (optimum-quanto), after full precision.
KVPRESS_BITS = (16, *sorted(KVPRESS_KV_BITS, reverse=True))
FULL_RUN = {"docs": 6, "samples": 1, "length": 1024, "stream_docs": 1, "stream_tokens": 4096, "stream_from": 2048}
QUICK = {"docs": 2, "samples": 1, "length": 1024, "stream_docs": 1, "stream_tokens": 1024, "stream_from": 512}
STREAM_BUDGETS = (1024, 512, 256, 128)  # bfloat16 entries per (layer, kv-head); QUICK halves them
PROTECTED = DEFAULT_N_SINK + DEFAULT_N_RECENT


@dataclass(frozen=True)
class Mix:
    """One way to reach a byte budget: `bits` per number and `kept` entries per (layer, kv-head)."""

    fraction: float
    bits: int
    kept: int
    tokens: int

    @property
    def alone(self) -> bool:
        return self.kept >= self.tokens

    @property
    def rate(self) -> float:
        """The eviction rate (over evictable entries) that keeps `kept` of the `tokens`."""
        return 0.0 if self.alone else round(1 - (self.kept - PROTECTED) / (self.tokens - PROTECTED), 4)

    @property
    def label(self) -> str:
        return "eviction only" if self.bits == 16 else f"{self.bits}-bit"


def kept_entries(
    fraction: float, bits: int, tokens: int, head_dim: int, residual: int = DEFAULT_RESIDUAL
) -> int | None:
    """Entries per (layer, kv-head) a byte budget of `fraction` of `tokens` bfloat16 entries holds at `bits`: the
    `residual` in bfloat16 (kvpress after its prefill: none), the rest quantized. None when the protected entries
    alone do not fit."""
    entry = make_codec(16).entry_bytes(head_dim, torch.bfloat16)
    budget = fraction * tokens * entry
    if bits == 16:
        kept = budget / entry
    else:
        kept = residual + (budget - residual * entry) / make_codec(bits).entry_bytes(head_dim, torch.bfloat16)
    return None if kept < PROTECTED + 1 else min(tokens, math.floor(kept))


def mixes(
    head_dim: int, tokens: int, bits_options: tuple[int, ...] = BITS, residual: int = DEFAULT_RESIDUAL
) -> list[Mix]:
    out = []
    for fraction in FRACTIONS:
        for bits in bits_options:
            kept = kept_entries(fraction, bits, tokens, head_dim, residual)
            if kept is not None:
                out.append(Mix(fraction, bits, kept, tokens))
    return out


def spec(policy: str, bits: int) -> str:
    return policy if bits == 16 else f"{policy}:kv_bits={bits}"


def runs_for(head_dim: int, tokens: int) -> list[tuple[list[str], list[float]]]:
    """Per width: the policies and rates whose cross product is every evicting mix of it; then quantization alone."""
    runs = []
    for bits in BITS:
        rates = sorted({m.rate for m in mixes(head_dim, tokens) if m.bits == bits and not m.alone})
        if rates:
            runs.append(([spec(p, bits) for p in POLICIES], rates))
    return [*runs, ([spec(ALONE, bits) for bits in BITS[1:]], [0.0])]


def cells_of(head_dim: int, tokens: int) -> list[tuple[Mix, str, str]]:
    """(mix, policy, spec) of every cell of the tables; quantization alone (`ALONE` at rate 0) fills a whole column."""
    out = []
    for mix in mixes(head_dim, tokens):
        policies = POLICIES if not mix.alone else ("quantization alone",)
        out += [(mix, p, spec(ALONE if mix.alone else p, mix.bits)) for p in policies]
    return out


def budget_markdown(
    table: list[dict],
    cell: Callable[[dict], str],
    policies: tuple[str, ...] = POLICIES,
    bits_options: tuple[int, ...] = BITS,
) -> str:
    """Rows (budget, policy), one column per width; a width that fits unevicted reads "alone: ..." in every row."""
    by_key = {(r["fraction"], r["bits"], r["policy"]): r for r in table}
    header = ["budget", "policy", *(Mix(0, bits, 0, 1).label for bits in bits_options)]
    body = []
    for fraction in FRACTIONS:
        for policy in policies:
            cells = []
            for bits in bits_options:
                own, alone = by_key.get((fraction, bits, policy)), by_key.get((fraction, bits, "quantization alone"))
                row = own or alone
                text = "" if row is None else f"{cell(row)} ({row['bytes_share']:.1%})"
                cells.append(f"alone: {text}" if own is None and alone is not None else text)
            if any(cells):
                body.append([f"{fraction:.2%}", policy, *cells])
    return markdown_table(header, body) + "\n"


def stage_ppl(model: Any, tokenizer: Any, args: argparse.Namespace) -> tuple[dict, str]:
    head_dim, tokens = kv_geometry(model)[1], 1024
    documents = sample_documents(tokenizer, args.docs, 1024 + 512 + 1, names=essay_split()[1])
    runs = runs_for(head_dim, tokens)
    eviction_rates = runs[0][1]
    runs += [([spec(p, bits) for p in COMPOSED], eviction_rates) for bits in BITS[1:]]
    cells: dict[tuple[str, float], dict] = {}
    for policies, rates in runs:
        with progress_bar(f"perplexity: {', '.join(policies)}") as progress:
            result = run_ppl(LocalRunner(model), documents, policies, rates, progress=progress)
        cells |= {(p, r): result.row(p, r) | {"nll": result.nll[p, r]} for p in policies for r in rates}
    full_bytes = int(np.mean(result.kv_bytes_full))  # every run scores the same full cache
    table = []
    for mix, policy, name in cells_of(head_dim, tokens):
        row = cells[name, mix.rate]
        where = {"fraction": mix.fraction, "bits": mix.bits, "policy": policy, "rate": mix.rate}
        table.append(
            where | {"delta_pct": row["delta_pct"], "ci95": row["ci95"], "bytes_share": row["kv_bytes"] / full_bytes}
        )
    composed = composition(cells, eviction_rates, np.array(result.nll_full), result.tokens)
    report = {"setup": vars(args), "full_ppl": result.full_ppl, "full_kv_bytes": full_bytes, "rows": table}
    report["composition"] = composed
    markdown = budget_markdown(table, lambda r: f"{r['delta_pct']:+.2f}%")
    markdown += f"\nPPL change against the full cache (PPL {result.full_ppl:.3f}, bfloat16), {args.docs} held-back "
    markdown += "essays, prefix 1024, continuation 512; in brackets the bytes held as a share of the full cache\n\n"
    return report, markdown + composition_markdown(composed)


def composition(cells: dict, rates: list[float], full: np.ndarray, tokens: np.ndarray) -> list[dict]:
    """Per policy, width and rate: the PPL change of the quantized cache against the same entries in 16 bits."""
    out = []
    for policy in COMPOSED:
        for bits in BITS[1:]:
            for rate in rates:
                quantized = np.array(cells[spec(policy, bits), rate]["nll"])
                plain = np.array(cells[policy, rate]["nll"])
                lo, hi = bootstrap_delta_ci(quantized, plain, tokens)
                out.append({"policy": policy, "bits": bits, "rate": rate, "ci95": [lo, hi],
                            "vs_16_bits": pooled_delta_pct(quantized, plain, tokens),
                            "vs_full": pooled_delta_pct(quantized, full, tokens)})  # fmt: skip
    return out


def composition_markdown(rows: list[dict]) -> str:
    rates = sorted({row["rate"] for row in rows})
    header = ["policy", "bits", *(f"rate {r:.3f}" for r in rates)]
    body = []
    for (policy, bits), group in pd.DataFrame(rows).groupby(["policy", "bits"], sort=False):
        cells = [f"{r.vs_16_bits:+.2f}% [{r.ci95[0]:+.1f}, {r.ci95[1]:+.1f}]" for r in group.itertuples()]
        body.append([policy, str(bits), *cells])
    note = "\nPPL change of the quantized cache against the same entries kept in bfloat16 (paired bootstrap); "
    note += "the rates are those of eviction alone at 50, 25, 12.5 and 6.25% of the full cache's bytes\n"
    return markdown_table(header, body) + "\n" + note


def stage_tasks(model: Any, tokenizer: Any, args: argparse.Namespace) -> tuple[dict, str]:
    head_dim, tokens = kv_geometry(model)[1], args.length
    frames = []
    for suite, tasks in (("needles", ",".join(NEEDLES)), ("routing", "routing")):
        samples = task_samples(tasks, tokenizer, length=args.length, n=args.samples, seed=0)
        for policies, rates in runs_for(head_dim, tokens):
            with progress_bar(f"{suite}: {', '.join(policies)}") as progress:
                rows = run_sweep(LocalRunner(model, tokenizer), samples, policies, rates, ("agnostic", "aware"),
                                 diagnostics=False, progress=progress)  # fmt: skip
            frames.append(rows.assign(suite=suite))
    rows = pd.concat(frames, ignore_index=True).drop_duplicates(["sample", "mode", "policy", "rate"])
    curves = accuracy_by_rate(rows)
    table = []
    for (suite, mode), part in curves.groupby(["suite", "mode"], sort=False):
        full = part[part["policy"] == "full"].iloc[0]
        for mix, policy, name in cells_of(head_dim, tokens):
            cell = part[(part["policy"] == name) & np.isclose(part["rate"], mix.rate)].iloc[0]
            table.append({"suite": suite, "mode": mode, "fraction": mix.fraction, "bits": mix.bits, "policy": policy,
                          "accuracy": cell["accuracy"], "gold_logprob": cell["mean_gold_logprob"],
                          "bytes_share": cell["mean_kv_bytes"] / full["mean_kv_bytes"],
                          "full_accuracy": full["accuracy"], "samples": int(cell["n"])})  # fmt: skip
    report = {"setup": vars(args), "rows": table}
    markdown = ""
    for (suite, mode), part in pd.DataFrame(table).groupby(["suite", "mode"], sort=False):
        first = part.iloc[0]
        markdown += f"{suite}, {mode}: {first['samples']} samples, full cache accuracy {first['full_accuracy']:.2f}\n\n"
        markdown += budget_markdown(part.to_dict("records"), lambda r: f"{r['accuracy']:.2f} ({r['gold_logprob']:.1f})")
        markdown += "\n"
    markdown += "accuracy (mean gold log-prob); in brackets the bytes held as a share of the full cache\n"
    return report, markdown


def stage_stream(model: Any, tokenizer: Any, args: argparse.Namespace) -> tuple[dict, str]:
    kv_heads, head_dim = kv_geometry(model)
    per_token = model.config.num_hidden_layers * kv_heads * make_codec(16).entry_bytes(head_dim, torch.bfloat16)
    documents = streaming_documents(tokenizer, args.stream_docs, args.stream_tokens, names=essay_split()[1])
    scale = 1 if args.stream_tokens >= 4096 else 2
    reference = 2048 // scale  # the context the budgets are fractions of
    budgets = {
        (fraction, bits): kept
        for fraction in FRACTIONS
        for bits in BITS
        if (kept := kept_entries(fraction, bits, reference, head_dim)) is not None
    }
    table = []
    for bits in BITS:
        sizes = sorted({kept for (_, b), kept in budgets.items() if b == bits and kept < args.stream_tokens})
        with progress_bar(f"streaming, {bits} bits") as progress:
            result = run_streaming(
                LocalRunner(model), documents, [spec(p, bits) for p in POLICIES], sizes, progress=progress
            )
        full_nll = np.stack(next(r for r in result.runs if r.budget is None).nll)
        for run in (r for r in result.runs if r.budget is not None):
            ours = np.stack(run.nll)[:, args.stream_from :]
            delta = 100 * (math.exp((np.nansum(ours) - np.nansum(full_nll[:, args.stream_from :])) / ours.size) - 1)
            share = run.peak.nbytes / (reference * per_token)
            # budgets that hold the whole reference context share one run
            for fraction in (f for (f, b), kept in budgets.items() if b == bits and kept == run.budget):
                table.append({"fraction": fraction, "bits": bits, "policy": run.name.split(":")[0],
                              "budget": run.budget, "delta_pct": delta, "bytes_share": share})  # fmt: skip
    report = {"setup": vars(args), "rows": table}
    markdown = budget_markdown(table, lambda r: f"{r['delta_pct']:+.1f}%")
    markdown += f"\nstreaming PPL change against the full cache, bfloat16; {args.stream_docs} held-back essays of "
    markdown += f"{args.stream_tokens} tokens fed 64 at a time, every run scored on the tokens after the first "
    markdown += f"{args.stream_from}; in brackets the most bytes held, as a share of a {reference}-token cache\n"
    return report, markdown


def kvpress_contenders(library: str, bits: int) -> dict[str, str]:
    """Row label -> spec of one library's contenders at `bits`."""
    if library == "kvsieve":
        return {policy: spec(policy, bits) for policy in KVPRESS_OURS}
    return {f"kvpress:{press}": f"kvpress:{press}" + ("" if bits == 16 else f":kv_bits={bits}") for press in PRESSES}


def stage_kvpress(model: Any, tokenizer: Any, args: argparse.Namespace) -> tuple[dict, str]:
    """kvpress's presses over its quantized cache next to kvsieve's policies, at the same bytes (perplexity).

    kvpress holds every kept entry quantized after its prefill (no full-precision residual), so the same bytes
    keep a few more of its entries. Where a width holds every entry, each contender runs at rate 0."""
    head_dim, tokens = kv_geometry(model)[1], 1024
    documents = sample_documents(tokenizer, args.docs, 1024 + 512 + 1, names=essay_split()[1])
    plans = {
        "kvsieve": mixes(head_dim, tokens, KVPRESS_BITS),
        "kvpress": mixes(head_dim, tokens, KVPRESS_BITS, residual=0),
    }
    table = []
    for bits in KVPRESS_BITS:
        for library, plan in plans.items():
            todo = [mix for mix in plan if mix.bits == bits]  # rate 0 where the bytes need no eviction
            names = kvpress_contenders(library, bits)
            with progress_bar(f"perplexity, {library}, {bits} bits") as progress:
                result = run_ppl(
                    LocalRunner(model),
                    documents,
                    list(names.values()),
                    sorted({m.rate for m in todo}),
                    progress=progress,
                )
            full_bytes = int(np.mean(result.kv_bytes_full))
            for mix in todo:
                for policy, name in names.items():
                    row = result.row(name, mix.rate)
                    table.append({"fraction": mix.fraction, "bits": bits, "policy": policy, "rate": mix.rate,
                                  "delta_pct": row["delta_pct"], "ci95": row["ci95"],
                                  "bytes_share": row["kv_bytes"] / full_bytes})  # fmt: skip
    report = {"setup": vars(args), "full_ppl": result.full_ppl, "rows": table}
    markdown = budget_markdown(table, lambda r: f"{r['delta_pct']:+.2f}%", KVPRESS_ROWS, KVPRESS_BITS)
    markdown += f"\nPPL change against the full cache (PPL {result.full_ppl:.3f}, bfloat16), {args.docs} held-back "
    markdown += "essays, prefix 1024, continuation 512; in brackets the bytes held as a share of the full cache. "
    markdown += "kvpress: its presses over transformers' quantized cache (optimum-quanto, one scale and shift per "
    markdown += "32 channels, every kept entry quantized after the prefill), its kept counts from the same bytes\n"
    return report, markdown


STAGES = {"ppl": stage_ppl, "tasks": stage_tasks, "stream": stage_stream, "kvpress": stage_kvpress}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check the script")
    args = parser.parse_args()
    for key, value in (QUICK if args.quick else FULL_RUN).items():
        setattr(args, key, value)
    model, tokenizer = kvsieve.load_model(dtype=torch.bfloat16)
    RESULTS.mkdir(exist_ok=True)
    for stage in args.stages.split(","):
        start = time.perf_counter()
        report, markdown = STAGES[stage](model, tokenizer, args)
        report["seconds"] = time.perf_counter() - start
        console.print(markdown)
        stem = f"quantized_eviction_{stage}" + ("_quick" if args.quick else "")
        (RESULTS / f"{stem}.json").write_text(json.dumps(report, indent=2, default=float) + "\n")
        (RESULTS / f"{stem}.md").write_text(markdown)
        console.print(f"{stage}: {report['seconds']:.0f} s; wrote {RESULTS / stem}.json")


if __name__ == "__main__":
    main()
