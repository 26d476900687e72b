"""Is a policy's loss on the unseen needles in the needles? The same eviction with the needles forced in.

The gate ablation's unseen samples (`niah_ledger`, `niah_locker`: four needles a haystack, one asked;
`--samples` a task, `--length` tokens, draws `--seeds`), question-agnostic, each policy of `--policies`
at each of `--rates` three ways: as it is; with the asked needle's tokens forced into every (layer,
kv-head) (the sample's evidence: the diagnostic's evidence-first oracle, `<policy>@force=all/<swap-out>`);
and with every needle of the haystack forced in (the asked one and its three distractors). Forcing
swaps entries within each head, the lowest `--swap-out` score out first, so every head keeps as many
entries as the policy gave it. Per row: the samples answered on each draw, and the difference from the
full cache, paired by sample with a bootstrap interval. A rerun measures only the (policy, rate) pairs
the JSON lacks and keeps the rows it holds; `--fresh` starts over.

    python benchmarks/forced_needles.py [--policies "trimkv+global;random"] [--rates 0.75] [--samples 30]
        [--seeds 0,1] [--fresh]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import pandas as pd
from rich.console import Console

from kvsieve import load_model
from kvsieve.harness.data.sample import TaskSample
from kvsieve.harness.data.suites import task_samples
from kvsieve.harness.eval.contenders import parse_contenders
from kvsieve.harness.eval.forced import FORCE_MARK
from kvsieve.harness.eval.stats import bootstrap_mean_ci
from kvsieve.harness.eval.sweep import run_sweep
from kvsieve.harness.models import DEFAULT_MODEL
from kvsieve.harness.progress import progress_bar
from kvsieve.harness.report import markdown_table
from kvsieve.harness.runners import LocalRunner
from policy_args import policy_list
from results_io import RESULTS, Output

TASKS = ("niah_ledger", "niah_locker")
FULL, AS_IT_IS, ASKED, EVERY = "full cache", "as it is", "asked needle forced", "every needle forced"


def every_needle(sample: TaskSample) -> TaskSample:
    """The sample with every needle of its haystack (the asked one and the distractors) as its evidence."""
    spans = sample.meta.get("needle_spans")
    if not spans:
        raise ValueError(f"{sample.task}#{sample.index}: no needle spans recorded (only needle tasks record them)")
    return dataclasses.replace(sample, evidence=tuple((start, end) for start, end in spans))


def forms(rows: pd.DataFrame, forced_form: str) -> pd.DataFrame:
    """Sweep rows with each policy named by what it evicts by, and its form: `FULL`, `AS_IT_IS`, or `forced_form`."""
    forced = rows.policy.str.contains(FORCE_MARK, regex=False)
    form = np.where(rows.policy == "full", FULL, np.where(forced, forced_form, AS_IT_IS))
    return rows.assign(policy=rows.policy.str.split(FORCE_MARK, regex=False).str[0], form=form)


def forced_specs(policies: list[str], swap_out: str) -> list[str]:
    """Each policy with each case's evidence forced in, room made by `swap_out`."""
    return [f"{policy}{FORCE_MARK}all/{swap_out}" for policy in policies]


def measure(
    runner: LocalRunner, samples: list[TaskSample], policies: list[str], rates: list[float], swap_out: str
) -> pd.DataFrame:
    """Rows (policy, form, sample, task, rate, correct) of every policy in every form on `samples`."""
    forced = forced_specs(policies, swap_out)
    with progress_bar("as they are, and with the asked needle forced in") as progress:
        asked = run_sweep(runner, samples, [*policies, *forced], rates, diagnostics=False, progress=progress)
    with progress_bar("with every needle forced in") as progress:
        widened = [every_needle(sample) for sample in samples]
        every = run_sweep(runner, widened, forced, rates, diagnostics=False, progress=progress)
    rows = pd.concat([forms(asked, ASKED), forms(every[every.policy != "full"], EVERY)])
    return rows[["policy", "form", "sample", "task", "rate", "correct"]]


def markdown(report: dict) -> str:
    """One table: every (policy, form, rate) row's answers per draw and its paired difference from the full cache."""
    rows = pd.DataFrame(report["rows"])
    is_full = rows.form == FULL
    full = rows[is_full].set_index(["seed", "sample"]).correct.astype(int)
    n = report["samples"] * len(report["tasks"])
    body = [[FULL, "", "", _per_draw(rows[is_full], report["seeds"]), "", _by_task(rows[is_full])]]
    for (policy, form, rate), got in rows[~is_full].groupby(["policy", "form", "rate"], sort=False):
        diff = got.set_index(["seed", "sample"]).correct.astype(int) - full
        lo, hi = (len(diff) * x for x in bootstrap_mean_ci(diff.to_numpy()))
        paired = f"{int(diff.sum()):+d} [{lo:+.0f}, {hi:+.0f}] of {len(diff)}"
        body.append([policy, form, f"{rate:.0%}", _per_draw(got, report["seeds"]), paired, _by_task(got)])
    header = ["policy", "forced in", "rate", f"answered, draw {' + draw '.join(map(str, report['seeds']))} (of {n})"]
    caption = (
        f"{report['model']}, question-agnostic, {report['samples']} samples a task of {report['length']} tokens; "
        f"forced entries swap out the kept entries of lowest `{report['swap_out']}` score, head by head"
    )
    return caption + "\n\n" + markdown_table([*header, "vs the full cache [95% CI]", "by task"], body)


def _per_draw(rows: pd.DataFrame, seeds: list[int]) -> str:
    return " + ".join(str(int(rows[rows.seed == seed].correct.sum())) for seed in seeds)


def _by_task(rows: pd.DataFrame) -> str:
    return ", ".join(f"{task} {int(got.correct.sum())}" for task, got in rows.groupby("task"))


TABLE = Output("forced_needles", {"": markdown})


def stored_rows(settings: dict, fresh: bool) -> pd.DataFrame:
    """The rows of the stored report (none with `fresh` or none stored); ValueError if its settings (model, tasks,
    samples, length, seeds, swap-out scorer) are not `settings`: a rerun adds rows only to a report measured alike."""
    path = RESULTS / f"{TABLE.stem}.json"
    if fresh or not path.is_file():
        return pd.DataFrame(columns=["policy", "rate"])
    stored = json.loads(path.read_text())
    differ = [f"{key} {stored.get(key)!r} (now {now!r})" for key, now in settings.items() if stored.get(key) != now]
    if differ:
        raise ValueError(f"{path.name} was measured with {', '.join(differ)}: pass --fresh to start over")
    return pd.DataFrame(stored["rows"])


def missing(rows: pd.DataFrame, policies: list[str], rates: list[float]) -> dict[float, list[str]]:
    """The policies each rate still lacks in `rows` (rates with none left out)."""
    done = {(policy, round(rate, 6)) for policy, rate in zip(rows.policy, rows.rate, strict=True)}
    todo = {rate: [policy for policy in policies if (policy, round(rate, 6)) not in done] for rate in rates}
    return {rate: left for rate, left in todo.items() if left}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="trimkv+global;random", help="semicolon-separated kvsieve specs")
    parser.add_argument("--rates", default="0.75")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--length", type=int, default=1536)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--swap-out", default="caote", help="the scorer whose lowest kept entries make room")
    parser.add_argument("--fresh", action="store_true", help="forget the rows already in the JSON")
    args = parser.parse_args()
    policies = policy_list(parser, args.policies)
    rates, seeds = [float(r) for r in args.rates.split(",")], [int(s) for s in args.seeds.split(",")]
    report = {"model": DEFAULT_MODEL, "tasks": list(TASKS), "samples": args.samples, "length": args.length}
    report |= {"seeds": seeds, "swap_out": args.swap_out}
    try:
        parse_contenders([*policies, *forced_specs(policies, args.swap_out)])
        stored = stored_rows(report, args.fresh)
    except ValueError as err:
        parser.error(str(err))
    frames = [stored] if len(stored) else []
    todo = missing(stored, policies, rates)
    if todo:
        runner = LocalRunner(*load_model())
        for seed in seeds:
            samples = task_samples(list(TASKS), runner.tokenizer, length=args.length, n=args.samples, seed=seed)
            for rate, todo_policies in todo.items():
                frames.append(measure(runner, samples, todo_policies, [rate], args.swap_out).assign(seed=seed))
    rows = pd.concat(frames).drop_duplicates(["seed", "sample", "policy", "form", "rate"])
    report["rows"] = rows.to_dict("records")
    Console().print(markdown(report))
    print(f"wrote {TABLE.write(report)}")


if __name__ == "__main__":
    main()
