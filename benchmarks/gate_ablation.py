"""What each change to the gates' training buys at 50-95% question-agnostic eviction, on data no training set uses.

Every variant changes one thing from the base recipe, that of the gates shipped before issue 39 (`train-gates`'
defaults: the full cache's output as the target, capacity 128 under one global budget, 160 steps of 1,024 tokens
of the training essays and task samples, seed 0; Gemma-3-270M's: 240 steps, as `make gates-gemma`), or averages two
variants' gates (a soup, `kvsieve average-gates`), or averages the logits of gates trained alike from different
seeds (an ensemble, `kvsieve ensemble-gates`), is trained (or resumed) under `--gates-home` (a finished checkpoint
already in a variant's folder, made with its settings elsewhere, e.g. `train-gates --device cuda`, is taken as it is,
its time marked "elsewhere"; so is one kept in the repository, benchmarks/gates/MODEL/FOLDER, copied into an empty
folder: candidates trained on one machine, kept for runs on the next, or resumed where kept with their state), and
is judged as ``trimkv+global`` beside the full cache and ``kvzip+global`` (5-9 prefills a prompt; on Gemma-3-270M
also the heuristics that beat its base gates, ``expected`` and ``vatp+global``) on:

- perplexity (docs/protocols.md: a 1,024-token prefix evicted, the next 512 tokens scored) on news bulletins,
  the held-back genre (`kvsieve.harness.data.news`), pooled, with a paired bootstrap over bulletins;
- needles, question-agnostic, `--samples` per task at `--length` tokens: RULER's format (`niah_single_2`,
  `niah_multikey_1`; the format, not these samples, is in training) and two formats no training set uses
  (`niah_ledger`, `niah_locker`), reported apart.

Results are kept per policy in benchmarks/results/gate_ablation.json (Gemma-3-270M: gate_ablation_gemma3_270m.json;
another `--docs`, `--samples`, `--length` or `--seed` adds it to the name, e.g. gate_ablation_samples30.json, and so
does a `--device` other than the CPU: gate_ablation_cuda.json), so a rerun evaluates only what is missing
(`--variants` picks the variants: all by default, none when `--policies` or `--against` is given; `--fresh` starts
over). `--seed` draws other needle samples: a confirmation on fresh ones. `--policies` judges specs as given beside
them (default: the model's rivals), e.g. the shipped gates under another scorer parameter
(`trimkv+global:horizon=inf`) or a variant's gates by path (the gates home is left out of the label). Each policy's
entry records the gates it read (`gates`: each source, the gates home left out, with its fingerprint, as a results
row records them); an entry whose policy reads other gates now (a default replaced, a variant trained again) is
measured again. Entries from before this record are kept as they are, and a rerun names them: remove one from the
JSON to measure it again. `--against LABEL` pairs every policy with that one (e.g. the default) at every rate, in
tables of its own; the JSON keeps the choice, and the tables are written again even when nothing is measured.

    python benchmarks/gate_ablation.py [--variants "capacity 128,mix10"] [--docs 24] [--samples 15] [--length 1536]
                                       [--seed 0] [--model gemma3-270m] [--device cuda] [--policies "SPEC;SPEC"]
                                       [--against LABEL]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
from rich.console import Console

from kvsieve.harness.data.news import sample_news
from kvsieve.harness.data.suites import task_samples
from kvsieve.harness.eval import run_ppl
from kvsieve.harness.eval.contenders import contender
from kvsieve.harness.eval.gate_records import GATES_FIELD, gates_made_by
from kvsieve.harness.eval.stats import bootstrap_delta_ci, bootstrap_mean_ci, pooled_delta_pct, pooled_ppl
from kvsieve.harness.eval.sweep import run_sweep
from kvsieve.harness.gemma import GEMMA_MODEL
from kvsieve.harness.models import DEFAULT_MODEL, ModelChoice, cache_home, torch_device
from kvsieve.harness.progress import progress_bar
from kvsieve.harness.report import markdown_table
from kvsieve.harness.runners import LocalRunner
from kvsieve.harness.training.ensemble import ensemble_gates
from kvsieve.harness.training.soup import average_gates
from kvsieve.harness.training.train import STATE_FILE, TrainConfig, train_gates
from kvsieve.modeling.gates import NEXT_STEP, Horizons
from kvsieve.selection.checkpoint import CONFIG_FILE, GateCheckpointError, TrainRecord, read_gates, resolve_gates
from policy_args import policy_list
from results_io import RESULTS, Output, named_for

RATES = [0.5, 0.75, 0.9, 0.95]
GROUPS = {"RULER's format": ("niah_single_2", "niah_multikey_1"), "unseen formats": ("niah_ledger", "niah_locker")}
TASKS = [task for group in GROUPS.values() for task in group]
#: The variants: what each changes from the base recipe (None: the base recipe's shipped gates, not retrained).
VARIANTS: dict[str, dict | None] = {
    "capacity 128": None,
    "kvzip target": {"target": "kvzip"},
    "mix10": {"kvzip_weight": 0.1},
    "mix30": {"kvzip_weight": 0.3},
    "mix30 kept": {"kvzip_weight": 0.3, "kvzip_entries": "kept"},
    "mix30 indifferent": {"kvzip_weight": 0.3, "kvzip_entries": "indifferent"},
    "answers x1": {"answer_weight": 1.0},
    "head scope": {"scope": "head"},
    "steps 320": {"steps": 320},
    "curriculum 1k-4k": {"curriculum": (1024, 4096)},
    "capacity 64": {"capacity": 64},
    "capacity 64 mix30": {"capacity": 64, "kvzip_weight": 0.3},
    "capacity 32": {"capacity": 32},
    "capacity 48": {"capacity": 48},
    "capacity 32 curriculum": {"capacity": 32, "curriculum": (1024, 4096)},
    "capacity 32 curriculum seed 1": {"capacity": 32, "curriculum": (1024, 4096), "seed": 1},
    "capacity 32 curriculum seed 2": {"capacity": 32, "curriculum": (1024, 4096), "seed": 2},
    "capacity 32 seed 1": {"capacity": 32, "seed": 1},
    "capacity 32 seed 2": {"capacity": 32, "seed": 2},
    "capacity 16": {"capacity": 16},
    "capacity 32 per-task 9": {"capacity": 32, "per_task": 9},
    "capacity 32 steps 320": {"capacity": 32, "steps": 320},
    "capacity 32 varied": {"capacity": 32, "tasks": "ruler,routing,varied"},
    **{
        f"capacity 32 varied seed {seed}": {"capacity": 32, "tasks": "ruler,routing,varied", "seed": seed}
        for seed in range(1, 9)
    },
    "capacity 32 varied procedural": {"capacity": 32, "tasks": "ruler,routing,varied,procedural"},
    "varied": {"tasks": "ruler,routing,varied"},
    **{f"seed {seed}": {"seed": seed} for seed in range(1, 5)},
}
#: Variants whose checkpoint records a horizon (`train-gates --horizon`; the rest record none, read at the next step):
#: the `capacity 32 varied` recipe is read 128 tokens ahead, as its shipped checkpoint, smollm2-135m-capacity32-varied.
READ_AHEAD: dict[str, Horizons] = {name: Horizons(128.0) for name in VARIANTS if name.startswith("capacity 32 varied")}
#: Gate soups: the equal-weight parameter average of variants' gates (`kvsieve average-gates`), each variant trained
#: (or resumed) first; "capacity 128" is the base recipe's shipped checkpoint.
SOUPS: dict[str, tuple[str, ...]] = {
    "soup capacity 128+mix30": ("capacity 128", "mix30"),
    "soup curriculum+mix30": ("curriculum 1k-4k", "mix30"),
    "soup capacity 32+64": ("capacity 32", "capacity 64"),
    "soup capacity 32+curriculum": ("capacity 32", "curriculum 1k-4k"),
}
#: Gate ensembles: the equal-weight mean of the logits of variants' gates trained alike from different seeds
#: (`kvsieve ensemble-gates`), each trained (or resumed) first, read at the horizons of the model's shipped gates.
ENSEMBLES: dict[str, tuple[str, ...]] = {
    "ensemble capacity 32 varied seeds 0-4": (
        "capacity 32 varied",
        *(f"capacity 32 varied seed {s}" for s in range(1, 5)),
    ),
    "ensemble capacity 32 varied seeds 0-8": (
        "capacity 32 varied",
        *(f"capacity 32 varied seed {s}" for s in range(1, 9)),
    ),
    "ensemble seeds 0-4": ("capacity 128", *(f"seed {s}" for s in range(1, 5))),
}
NAMES = [*VARIANTS, *SOUPS, *ENSEMBLES]
#: The rival every variant is paired with (the full cache runs beside each policy).
BASELINE = "kvzip+global"
#: The variant of the base recipe's shipped gates, which every other variant changes one thing of.
BASE_VARIANT = "capacity 128"
#: Per model: what its base recipe changes from `TrainConfig`'s defaults, and the rivals it is judged by.
RECIPES: dict[str, dict] = {DEFAULT_MODEL: {}, GEMMA_MODEL: {"steps": 240}}
RIVALS = {DEFAULT_MODEL: [BASELINE], GEMMA_MODEL: [BASELINE, "expected", "vatp+global"]}
#: Per model: the shipped checkpoint trained by the base recipe (the default model's default gates are `ensemble
#: capacity 32 varied seeds 0-4`'s; `capacity 32 varied`'s and `capacity 32`'s ship as smollm2-135m-capacity32-varied
#: and smollm2-135m-capacity32).
BASE_GATES = {DEFAULT_MODEL: "smollm2-135m-capacity128", GEMMA_MODEL: "gemma3-270m-seed0"}
#: Variants' gates kept in the repository, by model and folder: trained on one machine, taken as trained elsewhere.
KEPT = Path(__file__).parent / "gates"
#: Per model: the shipped default gates, whose horizons an ensemble records.
SHIPPED_GATES = {DEFAULT_MODEL: "smollm2-135m", GEMMA_MODEL: "gemma3-270m"}


def variant_gates(name: str, home: Path, model_name: str) -> Path | str:
    """Where a variant's gates are: its folder under `home`, or the shipped checkpoint's name (not retrained)."""
    trained = name not in VARIANTS or VARIANTS[name] is not None
    return home / _folder(name) if trained else BASE_GATES[model_name]


def variant_label(name: str) -> str:
    """A variant's row in the tables."""
    return f"trimkv+global ({name})"


def variant_policy(name: str, home: Path, model_name: str) -> str:
    """The policy string that runs a variant's gates under one global budget."""
    return f"trimkv+global:gates={variant_gates(name, home, model_name)}"


def _folder(name: str) -> str:
    return name.replace(" ", "-").replace("+", "")


def train_variant(model, tokenizer, name: str, home: Path, model_name: str) -> dict:
    """Train (or resume) a variant of `model_name`'s base recipe, or the parts of a soup or an ensemble; what
    training recorded."""
    if name in SOUPS or name in ENSEMBLES:
        return _combine(model, tokenizer, name, home, model_name)
    if VARIANTS[name] is None:
        return {}
    config = TrainConfig(**RECIPES[model_name] | VARIANTS[name])
    folder = home / _folder(name)
    kept = KEPT / model_name / folder.name
    if kept.is_dir() and not folder.exists():
        shutil.copytree(kept, folder)
    record = _trained_elsewhere(folder, config)
    elsewhere = record is not None
    if record is None:
        _, record = train_gates(model, tokenizer, config, folder, model_name, horizons=READ_AHEAD.get(name, NEXT_STEP))
    return {
        "seconds": record.seconds,
        "changes": {k: list(v) if isinstance(v, tuple) else v for k, v in VARIANTS[name].items()},
    } | ({"elsewhere": True} if elsewhere else {})


def _combine(model, tokenizer, name: str, home: Path, model_name: str) -> dict:
    """Train a soup's or an ensemble's parts, then combine them; their summed training time."""
    kind, parts = ("soup", SOUPS[name]) if name in SOUPS else ("ensemble", ENSEMBLES[name])
    trained = [train_variant(model, tokenizer, part, home, model_name) for part in parts]
    base = resolve_gates(BASE_GATES[model_name])
    folders = [base if VARIANTS[part] is None else home / _folder(part) for part in parts]
    if kind == "soup":
        combined = average_gates(folders, None, home / _folder(name))
    else:
        combined = ensemble_gates(folders, None, home / _folder(name), shipped_horizons(model_name))
    _, record = read_gates(combined)
    elsewhere = any(part.get("elsewhere") for part in trained)
    return {"seconds": record.seconds, "changes": {kind: list(parts)}} | ({"elsewhere": True} if elsewhere else {})


def shipped_horizons(model_name: str) -> Horizons:
    """The horizons the model's shipped default gates are read at."""
    return read_gates(resolve_gates(SHIPPED_GATES[model_name]))[0].horizons


def _trained_elsewhere(folder: Path, config: TrainConfig) -> TrainRecord | None:
    """The record of a finished checkpoint in `folder` made with `config` by a run that kept no resumable state
    (`train-gates --out` on another machine, e.g. with `--device cuda`, its `train_state.pt` left behind)."""
    if (folder / STATE_FILE).is_file() or not (folder / CONFIG_FILE).is_file():
        return None
    _, record = read_gates(folder)
    return record if config.made(record.data.get("config", {})) else None


def gates_now(runner: LocalRunner, policy: str, home: Path) -> str | None:
    """The gates a row of `policy` measured now records (`GATES_FIELD`, the gates home left out): "" when it
    reads none, None when they are not here to read (a variant not trained on this machine)."""
    method = contender(policy)
    try:
        made_by = gates_made_by(runner, {method.name: method})
    except GateCheckpointError:
        return None
    return made_by({"policy": method.name}).get(GATES_FIELD, "").replace(f"{home}/", "")


def measured_again(stored: dict, now: str | None) -> bool:
    """Whether a stored entry was made by other gates than its policy reads now (gates not here, or an entry
    from before entries recorded them, cannot say so: those are kept)."""
    return GATES_FIELD in stored and now is not None and stored[GATES_FIELD] != now


def evaluate(runner: LocalRunner, policy: str, args: argparse.Namespace) -> tuple[dict, dict]:
    """A policy's perplexity (per bulletin, by rate) and needle rows (per sample and rate), and the full cache's."""
    tokenizer = runner.tokenizer
    documents = sample_news(tokenizer, args.docs, 1024 + 512 + 1)
    with progress_bar(f"perplexity on news: {policy[:48]}") as progress:
        ppl = run_ppl(runner, documents, [policy], RATES, progress=progress)
    samples = task_samples(TASKS, tokenizer, length=args.length, n=args.samples, seed=args.seed)
    with progress_bar(f"needles: {policy[:48]}") as progress:
        rows = run_sweep(runner, samples, [policy], RATES, diagnostics=False, progress=progress)
    rows = rows[["policy", "sample", "task", "rate", "correct", "gold_logprob"]]
    full = rows["policy"] == "full"
    mine = {"nll": {str(rate): values for (_, rate), values in ppl.nll.items()}}
    theirs = {"nll": ppl.nll_full, "tokens": ppl.tokens.tolist(), "needles": rows[full].to_dict("records")}
    return mine | {"needles": rows[~full].to_dict("records")}, theirs


def _training_cell(training: dict) -> str:
    """A variant's training time; marked where the checkpoint was trained on another machine (docs say which)."""
    if not training.get("seconds"):
        return ""
    return f"{training['seconds']:.0f} s" + (" (elsewhere)" if training.get("elsewhere") else "")


def _needle_counts(needles: list[dict]) -> list[str]:
    """Correct answers per group at every rate, as `a / b / c of n`."""
    rows = pd.DataFrame(needles)
    cells = []
    for tasks in GROUPS.values():
        mine = rows[rows["task"].isin(tasks)]
        by_rate = mine.groupby("rate")["correct"]
        cells.append(" / ".join(str(int(s.sum())) for _, s in by_rate) + f" of {by_rate.size().iloc[0]}")
    return cells


def _paired(report: dict, label: str, against: str, rate: float) -> list[str]:
    """`label` against the policy `against` at `rate`: PPL change between the two, needles more answered; 95% CIs."""
    tokens = np.array(report["full"]["tokens"])
    mine, base = report["policies"][label], report["policies"][against]
    a, b = np.array(mine["nll"][str(rate)]), np.array(base["nll"][str(rate)])
    lo, hi = bootstrap_delta_ci(a, b, tokens)
    cells = [f"{pooled_delta_pct(a, b, tokens):+.2f}% [{lo:+.2f}, {hi:+.2f}]"]
    ours, theirs = (pd.DataFrame(x["needles"]) for x in (mine, base))
    return cells + _more_answered(ours[ours["rate"] == rate], theirs[theirs["rate"] == rate])


def _more_answered(ours: pd.DataFrame, theirs: pd.DataFrame) -> list[str]:
    """Per needle group, how many more of the same samples `ours` answered than `theirs`, with a 95% interval."""
    joined = ours.merge(theirs, on=["sample", "task"])
    cells = []
    for tasks in GROUPS.values():
        group = joined[joined["task"].isin(tasks)]
        diff = group["correct_x"].astype(float) - group["correct_y"].astype(float)
        lo, hi = (len(diff) * x for x in bootstrap_mean_ci(diff.to_numpy()))
        cells.append(f"{diff.sum():+.0f} [{lo:+.1f}, {hi:+.1f}] of {len(diff)}")
    return cells


def _against_full(report: dict, rates: tuple[float, ...] = (0.5, 0.75)) -> str:
    """Each policy's needles against the full cache's on the same samples at `rates`: does it stay level?"""
    full = pd.DataFrame(report["full"]["needles"])
    body = []
    for label, result in report["policies"].items():
        rows = pd.DataFrame(result["needles"])
        body += [[label, f"{rate:.0%}", *_more_answered(rows[rows["rate"] == rate], full)] for rate in rates]
    columns = ["policy", "eviction", *(f"needles, {g}: more answered than the full cache" for g in GROUPS)]
    return "Paired against the full cache on the same samples:\n\n" + markdown_table(columns, body)


def _per_task(report: dict, rate: float) -> str:
    """Needles answered per task at `rate` (the full cache's beside): which format each group's answers come from."""

    def counts(needles: list[dict], at: float) -> list[str]:
        rows = pd.DataFrame(needles)
        rows = rows[rows["rate"] == at]
        return [str(int(rows.loc[rows["task"] == task, "correct"].sum())) for task in TASKS]

    body = [["full cache", *counts(report["full"]["needles"], 0.0)]]  # the full cache's rows carry rate 0
    body += [[label, *counts(result["needles"], rate)] for label, result in report["policies"].items()]
    caption = f"At {rate:.0%}, needles answered per task (of {report['samples']} each):\n\n"
    return caption + markdown_table(["policy", *TASKS], body)


def markdown(report: dict) -> str:
    """Every policy at every rate, the needles per task at 90%, every policy against the full cache at 50% and 75%,
    then (once measured) each policy against the baseline and against the base recipe's gates at 90% and 95%, and
    against the policy `--against` chose at every rate, paired."""
    tokens, full_nll = np.array(report["full"]["tokens"]), np.array(report["full"]["nll"])
    rates = " / ".join(f"{r:.0%}" for r in RATES)
    header = ["policy", f"PPL change at {rates}", *(f"needles, {g}, at {rates}" for g in GROUPS), "training"]
    reference = f"PPL {pooled_ppl(full_nll, tokens):.2f} ({len(tokens)} bulletins, {int(tokens.sum())} tokens)"
    body = [["full cache", reference, *_needle_counts(report["full"]["needles"]), ""]]
    for label, result in report["policies"].items():
        ppl = " / ".join(f"{pooled_delta_pct(np.array(v), full_nll, tokens):+.2f}%" for v in result["nll"].values())
        body.append([label, ppl, *_needle_counts(result["needles"]), _training_cell(result.get("training", {}))])
    tables = [markdown_table(header, body), _per_task(report, 0.9), _against_full(report)]
    tables += _paired_tables(report, BASELINE, "paired on the same bulletins and samples")
    tables += _paired_tables(report, variant_label(BASE_VARIANT), "paired against the base recipe's gates")
    against = report.get("against")
    tables += _paired_tables(report, against, f"paired against {against} (`--against`)", tuple(RATES))
    return "\n\n".join(tables) + "\n"


def _paired_tables(report: dict, against: str, caption: str, rates: tuple[float, ...] = (0.9, 0.95)) -> list[str]:
    """Every other policy paired against the policy `against` at each rate; none when `against` was not measured."""
    if against not in report["policies"]:
        return []
    tables = []
    for rate in rates:
        paired = [[label, *_paired(report, label, against, rate)] for label in report["policies"] if label != against]
        columns = [
            "policy",
            f"PPL vs {against} [95% CI]",
            *(f"needles, {g}: more answered than {against}" for g in GROUPS),
        ]
        tables.append(f"At {rate:.0%}, {caption}:\n\n" + markdown_table(columns, paired))
    return tables


TABLE = Output("gate_ablation*", {"": markdown})
#: Bulletins, needle samples per task, the needles' length and the seed they are drawn from; results under another
#: setting go to their own file (a file from before the seed was a setting drew seed 0).
SETTING_DEFAULTS = {"docs": 24, "samples": 15, "length": 1536, "seed": 0}


def measure(
    model, tokenizer, todo: dict[str, str], report: dict, home: Path, args: argparse.Namespace, stem: str
) -> list[str]:
    """Judge every policy of `todo` (label: variant or spec) that `report` lacks or measured on other gates, writing
    the results after each; the labels kept as measured before entries recorded their gates."""
    runner, console, unrecorded = LocalRunner(model, tokenizer), Console(), []
    for label, name in todo.items():
        policy = variant_policy(name, home, args.model) if name in NAMES else name
        if label in report["policies"]:
            stored, now = report["policies"][label], gates_now(runner, policy, home)
            if GATES_FIELD not in stored and now != "":
                unrecorded.append(label)
            if not measured_again(stored, now):
                continue
            console.print(f"{label}: measured on gates {stored[GATES_FIELD]}, now {now}: measuring again")
        training = train_variant(model, tokenizer, name, home, args.model) if name in NAMES else {}
        result, report["full"] = evaluate(runner, policy, args)
        gates = {GATES_FIELD: gates_now(runner, policy, home)}
        report["policies"][label] = result | {"policy": policy, "training": training} | gates
        TABLE.write(report, stem)  # after every policy, so an interrupted run keeps what it measured
    return unrecorded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    every = ", ".join(NAMES)
    parser.add_argument(
        "--variants", help=f"comma-separated (default: all; none with --policies or --against): {every}"
    )
    for name, value in SETTING_DEFAULTS.items():
        parser.add_argument(f"--{name}", type=int, default=value)
    parser.add_argument("--policies", help="semicolon-separated specs judged as given (default: the model's rivals)")
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=list(RECIPES))
    parser.add_argument("--gates-home", type=Path, help="where variants train (default: the cache's gates/ablation)")
    parser.add_argument("--fresh", action="store_true", help="forget the results already in the JSON")
    parser.add_argument("--device", default="cpu", help="where the model runs and variants train (cpu, cuda, ...)")
    parser.add_argument("--against", help="also pair every policy with this one (its label) at every rate; kept")
    args = parser.parse_args()
    policies = RIVALS[args.model] if args.policies is None else policy_list(parser, args.policies)
    if args.variants is None:
        variants = list(NAMES) if args.policies is None and args.against is None else []
    else:
        variants = list(filter(None, args.variants.split(",")))
    unknown = set(variants) - set(NAMES)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(NAMES)}")
    default = args.model == DEFAULT_MODEL
    stem = named_for("gate_ablation", None if default else args.model)
    stem += "".join(f"_{k}{getattr(args, k)}" for k, value in SETTING_DEFAULTS.items() if getattr(args, k) != value)
    try:
        device = torch_device(args.device)
    except ValueError as error:
        parser.error(str(error))
    stem += "" if device.type == "cpu" else f"_{device.type}"
    home = args.gates_home or cache_home() / "gates" / "ablation" / ("" if default else args.model)
    path = RESULTS / f"{stem}.json"
    setting = {key: getattr(args, key) for key in SETTING_DEFAULTS} | {"rates": RATES}
    report = json.loads(path.read_text()) if path.is_file() and not args.fresh else {}
    if {k: report.get(k, SETTING_DEFAULTS.get(k)) for k in setting} != setting:
        report = setting | {"policies": {}}
    todo = {variant_label(name): name for name in variants}
    todo |= {spec.replace(f"{home}/", ""): spec for spec in policies}
    if args.against is not None:
        known = [*report["policies"], *todo]
        if args.against not in known:
            parser.error(f"--against {args.against!r} is no policy of {path.name} or of this run: {', '.join(known)}")
        report["against"] = args.against
    model, tokenizer = ModelChoice(None if default else args.model, device).load()
    unrecorded = measure(model, tokenizer, todo, report, home, args, stem)
    console = Console()
    if unrecorded:
        console.print(f"kept as measured, before entries recorded their gates: {', '.join(unrecorded)}")
    if args.against is not None:  # `measure` wrote after each policy; the choice may be all that changed
        TABLE.write(report, stem)
    console.print(markdown(report))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
