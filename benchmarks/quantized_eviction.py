"""Quantized entries stacked on eviction, compared at equal bytes: which mix of bits and kept entries wins?

The model runs in bfloat16, so the full cache holds 16 bits per number (as served on GPUs). At byte
budgets of 50, 25, 12.5 and 6.25% of that full cache, every policy reaches the budget four ways:
eviction alone (16 bits), or 8-, 4- or 2-bit entries (`kv_bits`; one scale and one minimum per 32
channels, so 9, 5 and 3 bits per number in all) with as much eviction as the bytes leave. Where a
width fits the budget with nothing evicted, that mix is quantization alone. The eviction rate of a
mix is the one that keeps its share of a nominal context's entries (sinks and the recent tail
always kept); the tables report the bytes each row really held.

- ``ppl``: the perplexity protocol (DESIGN §4) on held-back essays; also trimkv+global and snapkv
  quantized at the *eviction-only* rates (the same entries, fewer bits): do the gates, trained on
  full-precision entries, compose with quantization without retraining?
- ``tasks``: the RULER needle tasks and the routing suite, question-agnostic and -aware.
- ``stream``: streaming perplexity (held-back essays) at the bytes of 1,024 / 512 / 256 / 128
  bfloat16 entries per (layer, kv-head), i.e. 50 / 25 / 12.5 / 6.25% of a 2,048-token cache, every
  run scored on the same tokens (after the first 2,048).

Each stage writes `benchmarks/results/quantized_eviction_<stage>.{json,md}`.

    python benchmarks/quantized_eviction.py [--stages ppl,tasks,stream] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

import kvsieve
from kvsieve.harness.data import essay_split, sample_documents, task_samples
from kvsieve.harness.data.ruler import RULER_TASKS
from kvsieve.harness.eval import run_ppl
from kvsieve.harness.eval.analysis import accuracy_by_rate
from kvsieve.harness.eval.stats import bootstrap_delta_ci, pooled_delta_pct
from kvsieve.harness.eval.streaming import run_streaming, streaming_documents
from kvsieve.harness.eval.sweep import run_sweep
from kvsieve.harness.progress import console, progress_bar
from kvsieve.harness.report import markdown_table
from kvsieve.runtime.codecs import make_codec
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
FULL_RUN = {"docs": 6, "samples": 2, "length": 1024, "stream_docs": 2, "stream_tokens": 4096, "stream_from": 2048}
QUICK = {"docs": 2, "samples": 1, "length": 512, "stream_docs": 1, "stream_tokens": 1024, "stream_from": 512}
STREAM_BUDGETS = (1024, 512, 256, 128)  # bfloat16 entries per (layer, kv-head); QUICK halves them
PROTECTED = DEFAULT_N_SINK + DEFAULT_N_RECENT


@dataclass(frozen=True)
class Mix:
    """One way to reach a byte budget: `bits` per number, keeping `kept` of the entries (1: nothing evicted)."""

    fraction: float
    bits: int
    kept: float

    @property
    def alone(self) -> bool:
        return self.kept >= 1.0

    @property
    def label(self) -> str:
        if self.bits == 16:
            return "eviction only"
        return f"{self.bits}-bit alone" if self.alone else f"{self.bits}-bit + eviction"


def entry_share(bits: int, head_dim: int) -> float:
    """An entry's bytes at `bits` over its bytes in bfloat16."""
    return make_codec(bits).entry_bytes(head_dim, torch.bfloat16) / make_codec(16).entry_bytes(head_dim, torch.bfloat16)


def mixes(head_dim: int) -> list[Mix]:
    out = []
    for fraction in FRACTIONS:
        out += [Mix(fraction, bits, min(1.0, fraction / entry_share(bits, head_dim))) for bits in BITS]
    return out


def rate_for(kept: float, tokens: int) -> float:
    """The eviction rate (over evictable entries) that keeps `kept` of a `tokens`-entry context."""
    return round(max(0.0, 1 - (kept * tokens - PROTECTED) / (tokens - PROTECTED)), 4)


def spec(policy: str, bits: int) -> str:
    return policy if bits == 16 else f"{policy}:kv_bits={bits}"


def plan(head_dim: int, tokens: int) -> dict[int, tuple[list[str], list[float]]]:
    """Per width: the policies and rates whose cross product is every evicting mix of that width."""
    by_bits: dict[int, tuple[list[str], list[float]]] = {}
    for bits in BITS:
        rates = sorted({rate_for(m.kept, tokens) for m in mixes(head_dim) if m.bits == bits and not m.alone})
        if rates:
            by_bits[bits] = ([spec(p, bits) for p in POLICIES], rates)
    return by_bits


def rows_of_mixes(head_dim: int, tokens: int) -> list[tuple[Mix, str, str, float]]:
    """(mix, policy, spec, rate) of every cell of the tables; quantization alone is `ALONE` at rate 0."""
    out = []
    for mix in mixes(head_dim):
        if mix.alone:
            out.append((mix, "quantization alone", spec(ALONE, mix.bits), 0.0))
        else:
            out += [(mix, p, spec(p, mix.bits), rate_for(mix.kept, tokens)) for p in POLICIES]
    return out


def stage_ppl(model: Any, tokenizer: Any, args: argparse.Namespace) -> tuple[dict, str]:
    head_dim, tokens = kv_geometry(model)[1], 1024
    documents = sample_documents(tokenizer, args.docs, 1024 + 512 + 1, names=essay_split()[1])
    runs = [(policies, rates) for policies, rates in plan(head_dim, tokens).values()]
    eviction_rates = plan(head_dim, tokens)[16][1]
    runs += [([spec(p, bits) for p in COMPOSED], eviction_rates) for bits in BITS[1:]]
    runs += [([spec(ALONE, bits) for bits in BITS[1:]], [0.0])]
    cells: dict[tuple[str, float], dict] = {}
    for policies, rates in runs:
        with progress_bar(f"perplexity: {', '.join(policies)}") as progress:
            result = run_ppl(model, documents, policies, rates, progress=progress)
        for policy in policies:
            for rate in rates:
                cells[policy, rate] = result.row(policy, rate) | {"nll": result.nll[policy, rate]}
    full = result  # every run scores the same full cache
    full_bytes = int(np.mean(full.kv_bytes_full))
    table = [
        {"fraction": m.fraction, "mix": m.label, "policy": p, "rate": r} | _ppl_cell(cells[s, r], full_bytes)
        for m, p, s, r in rows_of_mixes(head_dim, tokens)
    ]
    composed = _composition(cells, eviction_rates, np.array(full.nll_full), full.tokens)
    report = {"setup": vars(args), "full_ppl": full.full_ppl, "full_kv_bytes": full_bytes, "rows": table}
    report["composition"] = composed
    markdown = _budget_markdown(table, "delta_pct", "PPL change", lambda r: f"{r['delta_pct']:+.2f}%")
    markdown += f"\nfull-cache PPL {full.full_ppl:.3f} (bfloat16), {args.docs} held-back essays, prefix 1024, "
    markdown += "continuation 512; cells: PPL change [95% CI] and the bytes held as a share of the full cache\n\n"
    return report, markdown + _composition_markdown(composed)


def _ppl_cell(row: dict, full_bytes: int) -> dict:
    return {"delta_pct": row["delta_pct"], "ci95": row["ci95"], "bytes_share": row["kv_bytes"] / full_bytes}


def _composition(cells: dict, rates: list[float], full: np.ndarray, tokens: np.ndarray) -> list[dict]:
    """Per policy, width and rate: the PPL change of the quantized cache against the same entries in 16 bits."""
    out = []
    for policy in COMPOSED:
        for bits in BITS[1:]:
            for rate in rates:
                quantized, plain = (
                    np.array(cells[spec(policy, bits), rate]["nll"]),
                    np.array(cells[policy, rate]["nll"]),
                )
                lo, hi = bootstrap_delta_ci(quantized, plain, tokens)
                vs_full = pooled_delta_pct(quantized, full, tokens)
                change = pooled_delta_pct(quantized, plain, tokens)
                out.append({"policy": policy, "bits": bits, "rate": rate, "vs_16_bits": change, "ci95": [lo, hi]})
                out[-1]["vs_full"] = vs_full
    return out


def _composition_markdown(rows: list[dict]) -> str:
    header = ["policy", "bits", *(f"rate {r:.3f}" for r in sorted({row["rate"] for row in rows}))]
    body = []
    for (policy, bits), group in pd.DataFrame(rows).groupby(["policy", "bits"], sort=False):
        cells = [f"{r.vs_16_bits:+.2f}% [{r.ci95[0]:+.1f}, {r.ci95[1]:+.1f}]" for r in group.itertuples()]
        body.append([policy, str(bits), *cells])
    note = "\nPPL change of the quantized cache against the same entries kept in bfloat16 (paired bootstrap)\n"
    return markdown_table(header, body) + note


def _budget_markdown(table: list[dict], key: str, what: str, cell) -> str:
    """One row per policy (and quantization alone), one column per (budget, mix)."""
    frame = pd.DataFrame(table)
    header = ["policy"] + [f"{f:.2%} {m}" for f, m in dict.fromkeys(zip(frame["fraction"], frame["mix"], strict=True))]
    body = []
    for policy in [*POLICIES, "quantization alone"]:
        cells = []
        for f, m in dict.fromkeys(zip(frame["fraction"], frame["mix"], strict=True)):
            found = frame[(frame["fraction"] == f) & (frame["mix"] == m) & (frame["policy"] == policy)]
            cells.append(cell(found.iloc[0]) + f" ({found.iloc[0]['bytes_share']:.1%})" if len(found) else "")
        body.append([policy, *cells])
    return f"{what} at equal bytes\n\n" + markdown_table(header, body) + "\n"


def stage_tasks(model: Any, tokenizer: Any, args: argparse.Namespace) -> tuple[dict, str]:
    head_dim, tokens = kv_geometry(model)[1], args.length
    frames = []
    for suite, tasks in (("needles", ",".join(NEEDLES)), ("routing", "routing")):
        samples = task_samples(tasks, tokenizer, length=args.length, n=args.samples, seed=0)
        runs = [*plan(head_dim, tokens).values(), ([spec(ALONE, b) for b in BITS[1:]], [0.0])]
        for policies, rates in runs:
            with progress_bar(f"{suite}: {', '.join(policies)}") as progress:
                rows = run_sweep(model, tokenizer, samples, policies, rates, ("agnostic", "aware"),
                                 diagnostics=False, progress=progress)  # fmt: skip
            frames.append(rows.assign(suite=suite))
    rows = pd.concat(frames, ignore_index=True)
    curves = accuracy_by_rate(rows.drop_duplicates(["sample", "mode", "policy", "rate"]))
    table = []
    for (suite, mode), part in curves.groupby(["suite", "mode"]):
        full = part[part["policy"] == "full"].iloc[0]
        for mix, policy, name, rate in rows_of_mixes(head_dim, tokens):
            cell = part[(part["policy"] == name) & (np.isclose(part["rate"], rate))].iloc[0]
            table.append({"suite": suite, "mode": mode, "fraction": mix.fraction, "mix": mix.label, "policy": policy,
                          "accuracy": cell["accuracy"], "gold_logprob": cell["mean_gold_logprob"],
                          "bytes_share": cell["mean_kv_bytes"] / full["mean_kv_bytes"],
                          "full_accuracy": full["accuracy"], "samples": int(cell["n"])})  # fmt: skip
    report = {"setup": vars(args), "rows": table}
    markdown = ""
    for (suite, mode), part in pd.DataFrame(table).groupby(["suite", "mode"], sort=False):
        first = part.iloc[0]
        title = f"{suite}, {mode} ({first['samples']} samples; full cache accuracy {first['full_accuracy']:.2f}): "
        cell = lambda r: f"{r['accuracy']:.2f} ({r['gold_logprob']:.1f})"  # noqa: E731
        markdown += title + _budget_markdown(part.to_dict("records"), "accuracy", "accuracy (gold log-prob)", cell)
        markdown += "\n"
    return report, markdown


def stage_stream(model: Any, tokenizer: Any, args: argparse.Namespace) -> tuple[dict, str]:
    head_dim = kv_geometry(model)[1]
    documents = streaming_documents(tokenizer, args.stream_docs, args.stream_tokens, names=essay_split()[1])
    scale = 1 if args.stream_tokens >= 4096 else 2
    runs = []
    for bits in BITS:
        budgets = sorted({round(b / scale / entry_share(bits, head_dim)) for b in STREAM_BUDGETS})
        runs.append((bits, budgets))
    table, full_nll = [], None
    for bits, budgets in runs:
        usable = [b for b in budgets if b < args.stream_tokens]
        policies = [spec(p, bits) for p in POLICIES]
        with progress_bar(f"streaming, {bits} bits") as progress:
            result = run_streaming(model, documents, policies, usable, progress=progress)
        full_nll = np.stack(next(r for r in result.runs if r.budget is None).nll)
        for run in (r for r in result.runs if r.budget is not None):
            table.append(_stream_cell(run, full_nll, args.stream_from, bits, scale, head_dim))
    report = {"setup": vars(args), "rows": table}
    cell = lambda r: f"{r['delta_pct']:+.1f}%"  # noqa: E731
    markdown = _budget_markdown(table, "delta_pct", "Streaming PPL change", cell)
    markdown += f"\nbfloat16; {args.stream_docs} held-back essays of {args.stream_tokens} tokens fed 64 at a time; "
    markdown += f"every run scored on the tokens after the first {args.stream_from}; budget = the bytes of 1,024 / 512 "
    markdown += (
        "/ 256 / 128 bfloat16 entries per (layer, kv-head); cells: PPL change and bytes held / a 2,048-token cache\n"
    )
    return report, markdown


def _stream_cell(run: Any, full_nll: np.ndarray, start: int, bits: int, scale: int, head_dim: int) -> dict:
    share = entry_share(bits, head_dim)
    bf16_entries = run.budget * share * scale
    fraction = min(FRACTIONS, key=lambda f: abs(f * 2048 - bf16_entries))
    ours, theirs = np.nansum(np.stack(run.nll)[:, start:]), np.nansum(full_nll[:, start:])
    name, policy = run.name, run.name.split(":")[0]
    label = Mix(fraction, bits, 0.5).label
    return {"fraction": fraction, "mix": label, "policy": policy, "spec": name, "budget": run.budget,
            "delta_pct": 100 * (math.exp((ours - theirs) / full_nll[:, start:].size) - 1),
            "bytes_share": run.budget * share / 2048 * scale}  # fmt: skip


STAGES = {"ppl": stage_ppl, "tasks": stage_tasks, "stream": stage_stream}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check the script")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL_RUN
    for key, value in sizes.items():
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
