"""Quantized entries stacked on eviction, compared at equal bytes: which mix of bits and kept entries wins?

The model runs in bfloat16, so the full cache holds 16 bits per number (as served on GPUs). At byte
budgets of 50, 25, 12.5 and 6.25% of that full cache, every policy reaches the budget five ways:
eviction alone (16 bits), or 8-, 4- or 2-bit entries (`kv_bits`; one scale and one minimum per 32
channels, so 9, 5 and 3 bits per number) or float8 entries (`kv_codec=fp8`, e4m3; one scale per 32
channels, so 8.5 bits per number), the newest 32 entries of every head in bfloat16, with as much
eviction as the bytes leave. Where a width fits the budget with nothing evicted, that mix is
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

Each stage writes `benchmarks/results/quantized_eviction_<stage>.{json,md}`. `--widths` runs only the
given widths of the ``ppl`` stage (and the eviction-only run, the composition's reference) and merges
their cells into its existing results, once the eviction-only cells and the full cache's PPL come out
as stored, so that the other widths' cells still stand (a rerun whose cells moved, e.g. after a library change,
merges nothing).

    python benchmarks/quantized_eviction.py [--stages ppl,tasks,stream,kvpress] [--quick]
    python benchmarks/quantized_eviction.py --stages ppl --widths fp8
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
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
from kvsieve.modeling.architecture import kv_geometry
from kvsieve.runtime.storage.codecs import codec_for, make_codec
from kvsieve.selection.protection import DEFAULT_N_RECENT, DEFAULT_N_SINK
from kvsieve.selection.storage import DEFAULT_RESIDUAL, Storage
from results_io import RESULTS, Output

FRACTIONS = (0.5, 0.25, 0.125, 0.0625)
#: How kept entries are stored: bits per number (16: bfloat16, as computed; 8, 4, 2: integer codes, `kv_bits`)
#: or a codec's name (`kv_codec`). The results' JSON keeps the key ``bits`` for it.
Width = int | str
WIDTHS: tuple[Width, ...] = (16, 8, "fp8", 4, 2)
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
    """One way to reach a byte budget: entries stored at `width`, `kept` of them per (layer, kv-head)."""

    fraction: float
    width: Width
    kept: int
    tokens: int

    @property
    def alone(self) -> bool:
        return self.kept >= self.tokens

    @property
    def rate(self) -> float:
        """The eviction rate (over evictable entries) that keeps `kept` of the `tokens`."""
        return 0.0 if self.alone else round(1 - (self.kept - PROTECTED) / (self.tokens - PROTECTED), 4)


def width_label(width: Width) -> str:
    """A width's column: "eviction only", "8-bit", or the codec's name."""
    if width == 16:
        return "eviction only"
    return f"{width}-bit" if isinstance(width, int) else width


def storage(width: Width) -> Storage:
    """The storage a width names (`kv_bits` for a number, `kv_codec` for a name)."""
    return Storage(width) if isinstance(width, int) else Storage(kv_codec=width)


def kept_entries(
    fraction: float, width: Width, tokens: int, head_dim: int, residual: int = DEFAULT_RESIDUAL
) -> int | None:
    """Entries per (layer, kv-head) a byte budget of `fraction` of `tokens` bfloat16 entries holds at `width`: the
    `residual` in bfloat16 (kvpress after its prefill: none), the rest encoded. None when the protected entries
    alone do not fit."""
    entry = make_codec(16).entry_bytes(head_dim, torch.bfloat16)
    budget = fraction * tokens * entry
    if width == 16:
        kept = budget / entry
    else:
        encoded = codec_for(storage(width), head_dim).entry_bytes(head_dim, torch.bfloat16)
        kept = residual + (budget - residual * entry) / encoded
    return None if kept < PROTECTED + 1 else min(tokens, math.floor(kept))


def mixes(
    head_dim: int, tokens: int, widths: tuple[Width, ...] = WIDTHS, residual: int = DEFAULT_RESIDUAL
) -> list[Mix]:
    out = []
    for fraction in FRACTIONS:
        for width in widths:
            kept = kept_entries(fraction, width, tokens, head_dim, residual)
            if kept is not None:
                out.append(Mix(fraction, width, kept, tokens))
    return out


def spec(policy: str, width: Width) -> str:
    """`policy` storing its kept entries at `width` (``snapkv:kv_bits=4``, ``snapkv:kv_codec=fp8``)."""
    return ":".join([policy, *(f"{key}={value}" for key, value in storage(width).parameters().items())])


def runs_for(head_dim: int, tokens: int, widths: tuple[Width, ...] = WIDTHS) -> list[tuple[list[str], list[float]]]:
    """Per width: the policies and rates whose cross product is every evicting mix of it; then quantization alone
    (the widths that fit a budget unevicted)."""
    runs, alone = [], []
    for width in widths:
        own = mixes(head_dim, tokens, (width,))
        rates = sorted({m.rate for m in own if not m.alone})
        if rates:
            runs.append(([spec(p, width) for p in POLICIES], rates))
        if any(m.alone for m in own):
            alone.append(spec(ALONE, width))
    return [*runs, (alone, [0.0])] if alone else runs


def cells_of(head_dim: int, tokens: int, widths: tuple[Width, ...] = WIDTHS) -> list[tuple[Mix, str, str]]:
    """(mix, policy, spec) of every cell of the tables; quantization alone (`ALONE` at rate 0) fills a whole column."""
    out = []
    for mix in mixes(head_dim, tokens, widths):
        policies = POLICIES if not mix.alone else ("quantization alone",)
        out += [(mix, p, spec(ALONE if mix.alone else p, mix.width)) for p in policies]
    return out


def budget_markdown(
    table: list[dict],
    cell: Callable[[dict], str],
    policies: tuple[str, ...] = POLICIES,
    widths: tuple[Width, ...] | None = None,
) -> str:
    """Rows (budget, policy), one column per width (default: the `WIDTHS` the rows hold); a width that fits unevicted
    reads "alone: ..." in every row."""
    by_key = {(r["fraction"], r["bits"], r["policy"]): r for r in table}
    widths = widths or tuple(w for w in WIDTHS if any(r["bits"] == w for r in table))
    header = ["budget", "policy", *map(width_label, widths)]
    body = []
    for fraction in FRACTIONS:
        for policy in policies:
            cells = []
            for width in widths:
                own, alone = by_key.get((fraction, width, policy)), by_key.get((fraction, width, "quantization alone"))
                row = own or alone
                text = "" if row is None else f"{cell(row)} ({row['bytes_share']:.1%})"
                cells.append(f"alone: {text}" if own is None and alone is not None else text)
            if any(cells):
                body.append([f"{fraction:.2%}", policy, *cells])
    return markdown_table(header, body) + "\n"


def stage_ppl(model: Any, tokenizer: Any, args: argparse.Namespace) -> dict:
    """Both tables at `args.widths`. The composition compares with the same entries in bfloat16, from the
    eviction-only run, so that run goes whatever the widths (`merge_ppl` checks its rows against the stored ones)."""
    head_dim, tokens = kv_geometry(model)[1], 1024
    documents = sample_documents(tokenizer, args.docs, 1024 + 512 + 1, names=essay_split()[1])
    eviction_rates = sorted({m.rate for m in mixes(head_dim, tokens, (16,))})
    encoded = [width for width in args.widths if width != 16]
    widths = (16, *encoded)
    runs = runs_for(head_dim, tokens, widths)
    runs += [([spec(p, width) for p in COMPOSED], eviction_rates) for width in encoded]
    cells: dict[tuple[str, float], dict] = {}
    for policies, rates in runs:
        with progress_bar(f"perplexity: {', '.join(policies)}") as progress:
            result = run_ppl(LocalRunner(model), documents, policies, rates, progress=progress)
        cells |= {(p, r): result.row(p, r) | {"nll": result.nll[p, r]} for p in policies for r in rates}
    full_bytes = int(np.mean(result.kv_bytes_full))  # every run scores the same full cache
    table = []
    for mix, policy, name in cells_of(head_dim, tokens, widths):
        row = cells[name, mix.rate]
        where = {"fraction": mix.fraction, "bits": mix.width, "policy": policy, "rate": mix.rate}
        table.append(
            where | {"delta_pct": row["delta_pct"], "ci95": row["ci95"], "bytes_share": row["kv_bytes"] / full_bytes}
        )
    composed = composition(cells, encoded, eviction_rates, np.array(result.nll_full), result.tokens)
    report = {"setup": vars(args), "full_ppl": result.full_ppl, "full_kv_bytes": full_bytes, "rows": table}
    return report | {"composition": composed}


def ppl_markdown(report: dict) -> str:
    """The ppl stage's two tables, from its report."""
    markdown = budget_markdown(report["rows"], lambda r: f"{r['delta_pct']:+.2f}%")
    markdown += f"\nPPL change against the full cache (PPL {report['full_ppl']:.3f}, bfloat16), "
    markdown += f"{report['setup']['docs']} held-back essays, prefix 1024, continuation 512; in brackets the bytes "
    markdown += "held as a share of the full cache\n\n"
    return markdown + composition_markdown(report["composition"])


def merge_ppl(old: dict, new: dict) -> dict:
    """The `old` ppl report with the rows of `new`'s widths added or replaced. `new`'s other rows (the eviction-only
    run the composition compares with) and its full-cache PPL must be `old`'s: the same essays, scored alike."""
    widths = new["setup"]["widths"]
    stored = {(r["fraction"], r["bits"], r["policy"]): r["delta_pct"] for r in old["rows"]}
    again = [
        (r["delta_pct"], stored[r["fraction"], r["bits"], r["policy"]]) for r in new["rows"] if r["bits"] not in widths
    ]
    if not all(math.isclose(a, b, rel_tol=1e-9) for a, b in [(new["full_ppl"], old["full_ppl"]), *again]):
        raise SystemExit(f"the rerun cells differ from the stored ones (full PPL {new['full_ppl']}): nothing merged")
    rows = [r for r in old["rows"] if r["bits"] not in widths] + [r for r in new["rows"] if r["bits"] in widths]
    composed = [r for r in old["composition"] if r["bits"] not in widths] + new["composition"]
    # stable sorts: the policies (rates) keep their order within a (budget, width) ((policy, width))
    rows.sort(key=lambda r: (FRACTIONS.index(r["fraction"]), WIDTHS.index(r["bits"])))
    composed.sort(key=lambda r: (COMPOSED.index(r["policy"]), WIDTHS.index(r["bits"])))
    added = [*old.get("added", []), {"widths": widths, "seconds": new["seconds"]}]
    return old | {"rows": rows, "composition": composed, "added": added}


def composition(
    cells: dict, widths: list[Width], rates: list[float], full: np.ndarray, tokens: np.ndarray
) -> list[dict]:
    """Per policy, width and rate: the PPL change of the encoded cache against the same entries in 16 bits."""
    out = []
    for policy in COMPOSED:
        for width in widths:
            for rate in rates:
                quantized = np.array(cells[spec(policy, width), rate]["nll"])
                plain = np.array(cells[policy, rate]["nll"])
                lo, hi = bootstrap_delta_ci(quantized, plain, tokens)
                out.append({"policy": policy, "bits": width, "rate": rate, "ci95": [lo, hi],
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


def stage_tasks(model: Any, tokenizer: Any, args: argparse.Namespace) -> dict:
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
            table.append({"suite": suite, "mode": mode, "fraction": mix.fraction, "bits": mix.width, "policy": policy,
                          "accuracy": cell["accuracy"], "gold_logprob": cell["mean_gold_logprob"],
                          "bytes_share": cell["mean_kv_bytes"] / full["mean_kv_bytes"],
                          "full_accuracy": full["accuracy"], "samples": int(cell["n"])})  # fmt: skip
    return {"setup": vars(args), "rows": table}


def tasks_markdown(report: dict) -> str:
    """The tasks stage: per suite and mode, accuracy (gold log-prob) per budget, policy and width."""
    markdown = ""
    for (suite, mode), part in pd.DataFrame(report["rows"]).groupby(["suite", "mode"], sort=False):
        first = part.iloc[0]
        markdown += f"{suite}, {mode}: {first['samples']} samples, full cache accuracy {first['full_accuracy']:.2f}\n\n"
        markdown += budget_markdown(part.to_dict("records"), lambda r: f"{r['accuracy']:.2f} ({r['gold_logprob']:.1f})")
        markdown += "\n"
    return markdown + "accuracy (mean gold log-prob); in brackets the bytes held as a share of the full cache\n"


def reference_tokens(stream_tokens: int) -> int:
    """The context the stream stage's budgets are fractions of (halved for --quick's short documents)."""
    return 2048 // (1 if stream_tokens >= 4096 else 2)


def stage_stream(model: Any, tokenizer: Any, args: argparse.Namespace) -> dict:
    kv_heads, head_dim = kv_geometry(model)
    per_token = model.config.num_hidden_layers * kv_heads * make_codec(16).entry_bytes(head_dim, torch.bfloat16)
    documents = streaming_documents(tokenizer, args.stream_docs, args.stream_tokens, names=essay_split()[1])
    reference = reference_tokens(args.stream_tokens)
    budgets = {
        (fraction, width): kept
        for fraction in FRACTIONS
        for width in WIDTHS
        if (kept := kept_entries(fraction, width, reference, head_dim)) is not None
    }
    table = []
    for width in WIDTHS:
        sizes = sorted({kept for (_, w), kept in budgets.items() if w == width and kept < args.stream_tokens})
        with progress_bar(f"streaming, {width_label(width)}") as progress:
            result = run_streaming(
                LocalRunner(model), documents, [spec(p, width) for p in POLICIES], sizes, progress=progress
            )
        full_nll = np.stack(next(r for r in result.runs if r.budget is None).nll)
        for run in (r for r in result.runs if r.budget is not None):
            ours = np.stack(run.nll)[:, args.stream_from :]
            delta = 100 * (math.exp((np.nansum(ours) - np.nansum(full_nll[:, args.stream_from :])) / ours.size) - 1)
            share = run.peak.nbytes / (reference * per_token)
            # budgets that hold the whole reference context share one run
            for fraction in (f for (f, w), kept in budgets.items() if w == width and kept == run.budget):
                table.append({"fraction": fraction, "bits": width, "policy": run.name.split(":")[0],
                              "budget": run.budget, "delta_pct": delta, "bytes_share": share})  # fmt: skip
    return {"setup": vars(args), "rows": table}


def stream_markdown(report: dict) -> str:
    """The stream stage: streaming PPL change per budget, policy and width."""
    setup = report["setup"]
    markdown = budget_markdown(report["rows"], lambda r: f"{r['delta_pct']:+.1f}%")
    markdown += f"\nstreaming PPL change against the full cache, bfloat16; {setup['stream_docs']} held-back essays of "
    markdown += f"{setup['stream_tokens']} tokens fed 64 at a time, every run scored on the tokens after the first "
    markdown += f"{setup['stream_from']}; in brackets the most bytes held, as a share of a "
    return markdown + f"{reference_tokens(setup['stream_tokens'])}-token cache\n"


def kvpress_contenders(library: str, bits: int) -> dict[str, str]:
    """Row label -> spec of one library's contenders at `bits`."""
    if library == "kvsieve":
        return {policy: spec(policy, bits) for policy in KVPRESS_OURS}
    return {f"kvpress:{press}": f"kvpress:{press}" + ("" if bits == 16 else f":kv_bits={bits}") for press in PRESSES}


def stage_kvpress(model: Any, tokenizer: Any, args: argparse.Namespace) -> dict:
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
            todo = [mix for mix in plan if mix.width == bits]  # rate 0 where the bytes need no eviction
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
    return {"setup": vars(args), "full_ppl": result.full_ppl, "rows": table}


def kvpress_markdown(report: dict) -> str:
    """The kvpress stage: kvpress's presses over its quantized cache beside kvsieve's policies, per budget."""
    markdown = budget_markdown(report["rows"], lambda r: f"{r['delta_pct']:+.2f}%", KVPRESS_ROWS, KVPRESS_BITS)
    markdown += f"\nPPL change against the full cache (PPL {report['full_ppl']:.3f}, bfloat16), "
    markdown += f"{report['setup']['docs']} held-back essays, prefix 1024, continuation 512; in brackets the bytes "
    markdown += "held as a share of the full cache. "
    markdown += "kvpress: its presses over transformers' quantized cache (optimum-quanto, one scale and shift per "
    markdown += "32 channels, every kept entry quantized after the prefill), its kept counts from the same bytes\n"
    return markdown


# What each stage writes: quantized_eviction_<stage>.{json,md} (with --quick: quantized_eviction_<stage>_quick).
PPL = Output("quantized_eviction_ppl*", {"": ppl_markdown})
TASKS = Output("quantized_eviction_tasks*", {"": tasks_markdown})
STREAM = Output("quantized_eviction_stream*", {"": stream_markdown})
KVPRESS = Output("quantized_eviction_kvpress*", {"": kvpress_markdown})
STAGES = {"ppl": (stage_ppl, PPL), "tasks": (stage_tasks, TASKS), "stream": (stage_stream, STREAM)}
STAGES |= {"kvpress": (stage_kvpress, KVPRESS)}


def parse_widths(text: str) -> tuple[Width, ...]:
    """``8,fp8`` -> (8, "fp8"), in the order of `WIDTHS`."""
    given = {int(item) if item.isdigit() else item for item in text.split(",") if item}
    if not given or not given <= set(WIDTHS):
        raise argparse.ArgumentTypeError(f"widths are some of {','.join(map(str, WIDTHS))}, got {text!r}")
    return tuple(width for width in WIDTHS if width in given)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check the script")
    parser.add_argument(
        "--widths", type=parse_widths, default=WIDTHS, help="ppl only: run these widths, merge into its results"
    )
    args = parser.parse_args()
    merging = args.widths != WIDTHS
    if merging and args.stages != "ppl":
        parser.error("--widths merges into the ppl stage's results: give --stages ppl")
    for key, value in (QUICK if args.quick else FULL_RUN).items():
        setattr(args, key, value)
    model, tokenizer = kvsieve.load_model(dtype=torch.bfloat16)
    for stage in args.stages.split(","):
        run, output = STAGES[stage]
        start = time.perf_counter()
        report = run(model, tokenizer, args)
        report["seconds"] = time.perf_counter() - start
        stem = f"quantized_eviction_{stage}" + ("_quick" if args.quick else "")
        if merging:
            report = merge_ppl(json.loads((RESULTS / f"{stem}.json").read_text()), report)
        path = output.write(report, stem)
        console.print(path.with_suffix(".md").read_text())
        console.print(f"{stage}: {time.perf_counter() - start:.0f} s; wrote {path}")


if __name__ == "__main__":
    main()
