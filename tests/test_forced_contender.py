"""Forced slots as a contender of any sweep (`<policy>@force=<forcing>/<swap_out>`), the needle spans a needle task
records, and benchmarks/forced_needles.py's table."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvsieve.harness.cli import app
from kvsieve.harness.data.suites import task_samples
from kvsieve.harness.eval.contenders import contender, parse_contenders
from kvsieve.harness.eval.forced import ForcedSlots
from kvsieve.harness.eval.sweep import run_sweep
from kvsieve.harness.runners import LocalRunner
from kvsieve.selection.errors import PolicyError
from kvsieve.selection.scorers import CAOTEScorer
from test_docs import _benchmarks_module
from test_sweep import make_sample

forced_needles = _benchmarks_module("forced_needles")
ASKED, AS_IT_IS, EVERY, FULL = forced_needles.ASKED, forced_needles.AS_IT_IS, forced_needles.EVERY, forced_needles.FULL
every_needle = forced_needles.every_needle


def test_a_forced_spec_names_the_forced_slots_it_builds():
    method = contender("snapkv+global@force=evicted/caote")
    assert isinstance(method, ForcedSlots)
    assert (method.forcing, method.swap_out, method.policy.name) == ("evicted", CAOTEScorer(), "snapkv+global")
    assert contender(method.name).name == method.name == "snapkv+global@force=evicted/caote"
    names = [m.name for m in parse_contenders("snapkv:window=8,snapkv:window=8@force=all/importance,random")]
    assert names == ["full", "snapkv:window=8", "snapkv:window=8@force=all/importance", "random"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("snapkv@force=most/caote", "unknown forcing 'most'; known: all, evicted, partial"),
        ("snapkv@force=all/nope", "make room (e.g. @force=all/caote), got 'nope'"),
        ("snapkv@force=all", "got ''"),
        ("nope@force=all/caote", "unknown policy 'nope'"),
    ],
)
def test_a_bad_forced_spec_says_what_is_wrong(spec, message):
    with pytest.raises(PolicyError, match=re.escape(message)):
        contender(spec)


def test_a_sweep_keeps_the_forced_evidence_in_every_head_at_the_policys_size(lm, tok):
    samples = [make_sample(0), make_sample(1, number="7654321")]
    rows = run_sweep(LocalRunner(lm, tok), samples, ["random", "random@force=all/caote"], [0.75])
    by = rows[rows.policy != "full"].set_index(["sample", "policy"])
    for sample in {s for s, _ in by.index}:
        plain, forced = by.loc[(sample, "random")], by.loc[(sample, "random@force=all/caote")]
        assert plain.recall_mean < 1.0  # random eviction loses part of the needle ...
        assert forced.recall_mean == 1.0  # ... which every head holds whole once forced in
        assert forced.kept_entries == plain.kept_entries and forced.kv_bytes == plain.kv_bytes


@pytest.mark.parametrize("task", ["niah_ledger", "niah_locker", "niah_multikey_1"])
def test_a_needle_task_records_every_needles_span(tok, task):
    sample = task_samples([task], tok, length=512, n=1, seed=0)[0]
    spans = sample.meta["needle_spans"]
    assert len(spans) == len(sample.meta["keys"]) and sample.evidence[0] in [tuple(s) for s in spans]
    for (start, end), key, values in zip(sorted(spans), *_in_context_order(sample), strict=True):
        assert key in sample.context[start:end] and values[0] in sample.context[start:end]
    assert every_needle(sample).evidence == tuple(tuple(s) for s in spans)


def _in_context_order(sample) -> tuple[list[str], list[list[str]]]:
    """The sample's keys and values, ordered by where each key's needle sits in the context."""
    order = sorted(range(len(sample.meta["keys"])), key=lambda k: sample.context.index(sample.meta["keys"][k]))
    return [sample.meta["keys"][k] for k in order], [sample.meta["values"][k] for k in order]


def test_a_task_without_needles_is_refused_by_name():
    with pytest.raises(ValueError, match="toy#3: no needle spans recorded"):
        every_needle(make_sample(3))


def test_the_table_pairs_every_row_with_the_full_cache():
    full = [True, True, False, True]
    rows = [{"seed": i // 2, "sample": f"s{i}", "task": "a" if i % 2 else "b", "rate": 0.0} for i in range(4)]
    report = {"model": "m", "tasks": ["a", "b"], "samples": 1, "length": 64, "seeds": [0, 1], "swap_out": "caote"}
    report["rows"] = [r | {"policy": "full", "form": FULL, "correct": c} for r, c in zip(rows, full, strict=True)]
    for form, got in ((AS_IT_IS, [False, True, False, False]), (ASKED, [True, True, True, True]), (EVERY, full)):
        report["rows"] += [
            r | {"policy": "p", "form": form, "rate": 0.75, "correct": c} for r, c in zip(rows, got, strict=True)
        ]
    lines = [line for line in forced_needles.markdown(report).splitlines() if line.startswith("| ")]
    table = pd.DataFrame([[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines[1:]])
    assert table[3].tolist() == ["2 + 1", "1 + 0", "2 + 2", "2 + 1"]  # answered per draw
    assert [cell.split(" [")[0] for cell in table[4].tolist()[1:]] == ["-2", "+1", "+0"]
    assert table[4].str.endswith("of 4").tolist()[1:] == [True] * 3
    assert table[1].tolist()[1:] == [AS_IT_IS, ASKED, EVERY]


def test_a_rerun_measures_only_the_pairs_the_stored_rows_lack():
    rows = pd.DataFrame({"policy": ["full", "p", "p", "q"], "rate": [0.0, 0.75, 0.75, 0.9]})
    assert forced_needles.missing(rows, ["p", "q"], [0.75, 0.9]) == {0.75: ["q"], 0.9: ["p"]}
    assert forced_needles.missing(rows, ["p"], [0.75]) == {}


def test_a_rerun_refuses_rows_measured_with_other_settings(tmp_path, monkeypatch):
    settings = {"model": "m", "tasks": ["a"], "samples": 30, "length": 64, "seeds": [0, 1], "swap_out": "caote"}
    rows = [{"policy": "p", "rate": 0.75, "correct": True}]
    (tmp_path / "forced_needles.json").write_text(json.dumps(settings | {"rows": rows}))
    monkeypatch.setattr(forced_needles, "RESULTS", tmp_path)
    assert forced_needles.stored_rows(settings, fresh=False).to_dict("records") == rows
    assert forced_needles.stored_rows(settings, fresh=True).empty
    with pytest.raises(ValueError, match=re.escape("samples 30 (now 10): pass --fresh to start over")):
        forced_needles.stored_rows(settings | {"samples": 10}, fresh=False)


def test_the_sweep_command_runs_a_forced_spec_beside_its_policy(model_dir, tmp_path):
    out = tmp_path / "sweep"
    args = ["sweep", "--model", str(model_dir), "--tasks", "base", "--rates", "0.75", "--samples", "1"]
    args += ["--policies", "random,random@force=all/caote", "--length", "256", "--out", str(out), "--no-maps"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = {r["policy"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert set(rows) == {"full", "random", "random@force=all/caote"}
    assert rows["random@force=all/caote"]["recall_mean"] == 1.0 > rows["random"]["recall_mean"]
