"""Which of several gates trained alike to ship, chosen on validation data that no reported number reads.

Candidates (`--candidates`: variants and ensembles of benchmarks/gate_ablation.py, trained or resumed under the
same gates home): by default the recipe of the model's shipped gates from several seeds and their ensembles
(the default model's `capacity 32 varied` from seeds 0-8 and ensembles of 0-4 and 0-8; Gemma-3-270M's from
seeds 0-4 and their ensemble). Each is judged as ``trimkv+global``, question-agnostic, at 75% and 90% eviction, read
at the horizon of the model's shipped gates wherever it was trained (a seed trained by the scripts records the next
step, one trained by `train-gates --horizon H` records H), on:

- needles of the training formats, fresh samples: RULER's two ablation tasks and the six ``varied`` formats,
  `--samples` each at `--length` tokens, drawn with seed 11 (training draws its own far away; the ablation's
  reported needles use seed 0 and, apart, formats no training uses);
- perplexity (docs/protocols.md: 1,024 tokens evicted, the next 512 scored) on the held-back essays' windows
  after each one's first (`validation_documents`): the training genre, never trained on, and none of the text
  `learned_gates.py` reports perplexity on.

The pick: the candidate that answers the most of these needles over both rates, a tie going to the lower
validation perplexity at 90%. The news bulletins and the unseen formats (the ablation's held-back data) are
never read here, so the ablation's rows of the pick stay a fair test of it.

Raw needle rows go to results/gate_selection/gate_selection.jsonl (a rerun resumes); the table to
benchmarks/results/gate_selection.json (another `--model`, `--samples` or `--length` adds it to the name, and so
does a `--gates-home`, by its folder's name: gate_selection_cpu.json).

    python benchmarks/gate_selection.py [--candidates "capacity 32 varied,capacity 32 varied seed 4"] [--samples 15]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
from rich.console import Console

from gate_ablation import ENSEMBLES, NAMES, RECIPES, shipped_horizons, train_variant, variant_gates, variant_policy
from kvsieve.harness.data import task_samples, validation_documents
from kvsieve.harness.data.ruler import VARIED_TASKS
from kvsieve.harness.eval import run_ppl
from kvsieve.harness.eval.stats import bootstrap_mean_ci, pooled_delta_pct
from kvsieve.harness.eval.sweep import run_sweep
from kvsieve.harness.gemma import GEMMA_MODEL
from kvsieve.harness.models import DEFAULT_MODEL, ModelChoice, cache_home
from kvsieve.harness.progress import progress_bar
from kvsieve.harness.report import markdown_table
from kvsieve.harness.runners import LocalRunner
from kvsieve.selection.checkpoint import read_gates, resolve_gates
from results_io import Output, named_for

RATES = [0.75, 0.9]
GROUPS = {"RULER's format": ("niah_single_2", "niah_multikey_1"), "varied formats": VARIED_TASKS}
TASKS = [task for group in GROUPS.values() for task in group]
#: Validation needles are drawn with this seed; every reported needle row uses seed 0.
SAMPLE_SEED = 11
#: Per model, the candidates by default: the recipe of its shipped gates from several seeds, and their ensembles.
CANDIDATES = {
    DEFAULT_MODEL: (
        "capacity 32 varied",
        *(f"capacity 32 varied seed {seed}" for seed in range(1, 9)),
        *(name for name in ENSEMBLES if name.startswith("ensemble capacity 32 varied")),
    ),
    GEMMA_MODEL: ("capacity 128", *(f"seed {seed}" for seed in range(1, 5)), "ensemble seeds 0-4"),
}
RAW = Path(__file__).parent.parent / "results" / "gate_selection"
SETTING_DEFAULTS = {"samples": 15, "length": 1536}
PPL_TOKENS = 1024 + 512 + 1


def measure(model, tokenizer, policies: dict[str, str], args: argparse.Namespace, raw: Path) -> tuple[dict, dict]:
    """Per candidate (name -> policy): validation perplexity (per window, by rate) and needle rows; the full
    cache's beside."""
    runner = LocalRunner(model, tokenizer)
    documents = validation_documents(tokenizer, PPL_TOKENS)
    with progress_bar("perplexity, validation essays") as progress:
        ppl = run_ppl(runner, documents, list(policies.values()), RATES, progress=progress)
    samples = task_samples(TASKS, tokenizer, length=args.length, n=args.samples, seed=SAMPLE_SEED)
    with progress_bar("needles, validation samples") as progress:
        rows = run_sweep(
            runner, samples, list(policies.values()), RATES, results=raw, diagnostics=False, progress=progress
        )
    rows = rows[["policy", "sample", "task", "rate", "correct"]]
    full = {"nll": ppl.nll_full, "tokens": ppl.tokens.tolist(), "documents": [name for name, _ in documents]}
    full["needles"] = rows[rows["policy"] == "full"].to_dict("records")
    measured = {}
    for name, policy in policies.items():
        nll = {str(rate): ppl.nll[(policy, rate)] for rate in RATES}
        mine = rows[(rows["policy"] == policy) & rows["rate"].isin(RATES)]
        measured[name] = {"policy": policy, "nll": nll, "needles": mine.to_dict("records")}
    return measured, full


def answered(needles: list[dict]) -> int:
    """How many of these needle rows were answered."""
    return int(pd.DataFrame(needles)["correct"].sum())


def pick(report: dict) -> str:
    """The candidate with the most validation needles answered; a tie goes to the lower perplexity at 90%."""
    tokens, full = np.array(report["full"]["tokens"]), np.array(report["full"]["nll"])

    def merit(label: str) -> tuple[int, float]:
        result = report["candidates"][label]
        return answered(result["needles"]), -pooled_delta_pct(np.array(result["nll"]["0.9"]), full, tokens)

    return max(report["candidates"], key=merit)


def _counts(needles: list[dict]) -> list[str]:
    """Answered per group, as `a / b` over the rates."""
    rows = pd.DataFrame(needles)
    rows = rows[rows["rate"] > 0]
    by_rate = (rows[rows["task"].isin(tasks)].groupby("rate")["correct"] for tasks in GROUPS.values())
    return [" / ".join(str(int(s.sum())) for _, s in group) for group in by_rate]


def _against(ours: list[dict], theirs: list[dict]) -> str:
    """How many more (sample, rate) pairs `ours` answered than `theirs`, with a 95% bootstrap interval."""
    joined = pd.DataFrame(ours).merge(pd.DataFrame(theirs), on=["sample", "rate"])
    diff = (joined["correct_x"].astype(float) - joined["correct_y"].astype(float)).to_numpy()
    lo, hi = (len(diff) * x for x in bootstrap_mean_ci(diff))
    return f"{diff.sum():+.0f} [{lo:+.1f}, {hi:+.1f}]"


def markdown(report: dict) -> str:
    """Every candidate's validation needles and perplexity, paired against the pick."""
    tokens, full_nll = np.array(report["full"]["tokens"]), np.array(report["full"]["nll"])
    chosen = pick(report)
    rates = " / ".join(f"{r:.0%}" for r in RATES)
    header = ["candidate", "hidden units a head", *(f"needles, {g}, at {rates}" for g in GROUPS), "all needles"]
    header += [f"PPL change at {rates}", "needles more answered than the pick [95% CI]"]
    body, pick_needles = [], report["candidates"][chosen]["needles"]
    for label, result in report["candidates"].items():
        ppl = " / ".join(f"{pooled_delta_pct(np.array(v), full_nll, tokens):+.2f}%" for v in result["nll"].values())
        against = "the pick" if label == chosen else _against(result["needles"], pick_needles)
        counts = [*_counts(result["needles"]), str(answered(result["needles"]))]
        body.append([label, str(result["width"]), *counts, ppl, against])
    full = pd.DataFrame(report["full"]["needles"])
    per_group = " and ".join(
        f"{int(full[full['task'].isin(tasks)]['correct'].sum())} of {report['samples'] * len(tasks)} in {group}"
        for group, tasks in GROUPS.items()
    )
    caption = (
        f"The full cache answers {per_group}. Perplexity on {len(tokens)} validation windows of the held-back "
        f"essays ({int(tokens.sum())} tokens scored). The pick: **{chosen}**."
    )
    return markdown_table(header, body) + "\n\n" + caption + "\n"


TABLE = Output("gate_selection*", {"": markdown})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--candidates", help="comma-separated, of: " + ", ".join(NAMES) + " (default: the model's)")
    for name, value in SETTING_DEFAULTS.items():
        parser.add_argument(f"--{name}", type=int, default=value)
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=list(RECIPES))
    parser.add_argument("--gates-home", type=Path, help="where candidates train (default: the cache's gates/ablation)")
    args = parser.parse_args()
    candidates = CANDIDATES[args.model] if args.candidates is None else list(filter(None, args.candidates.split(",")))
    unknown = set(candidates) - set(NAMES)
    if unknown or not candidates:
        parser.error(f"unknown or no candidates {sorted(unknown)}; choose from {', '.join(NAMES)}")
    default = args.model == DEFAULT_MODEL
    stem = named_for("gate_selection", None if default else args.model)
    stem += "".join(f"_{k}{getattr(args, k)}" for k, value in SETTING_DEFAULTS.items() if getattr(args, k) != value)
    stem += f"_{args.gates_home.name}" if args.gates_home else ""
    home = args.gates_home or cache_home() / "gates" / "ablation" / ("" if default else args.model)
    model, tokenizer = ModelChoice(None if default else args.model).load()
    for name in candidates:
        train_variant(model, tokenizer, name, home, args.model)
    once = shipped_horizons(args.model).once  # every candidate read as the shipped gates are, wherever it trained
    policies = {name: f"{variant_policy(name, home, args.model)},horizon={once:g}" for name in candidates}
    measured, full = measure(model, tokenizer, policies, args, RAW / f"{stem}.jsonl")
    for name, result in measured.items():
        result["width"] = read_gates(resolve_gates(variant_gates(name, home, args.model)))[0].shape.width
    report = {key: getattr(args, key) for key in SETTING_DEFAULTS} | {"rates": RATES, "sample_seed": SAMPLE_SEED}
    report |= {"full": full, "candidates": measured}
    path = TABLE.write(report, stem)
    Console().print(markdown(report))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
