"""benchmarks/gate_ablation.py's tables: every policy paired against the one `--against` chose, at every rate."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from test_docs import _benchmarks_module

ablation = _benchmarks_module("gate_ablation")


def _needles(policy: str, rate: float, correct: dict[str, int]) -> list[dict]:
    """Four samples of each task; `correct[task]` of them answered."""
    return [
        {"policy": policy, "sample": f"{task}#{i}", "task": task, "rate": rate, "correct": i < correct[task]}
        for task in ablation.TASKS
        for i in range(4)
    ]


def _policy(name: str, nats: float, correct: dict[str, int]) -> dict:
    """A policy whose every bulletin loses `nats` a token more than the full cache at every rate."""
    tokens = np.array([100, 300])
    return {
        "policy": name,
        "nll": {str(rate): (tokens * (2.0 + nats)).tolist() for rate in ablation.RATES},
        "needles": [row for rate in ablation.RATES for row in _needles(name, rate, correct)],
    }


def _report(against: str | None) -> dict:
    everything = dict.fromkeys(ablation.TASKS, 4)
    full = {"tokens": [100, 300], "nll": [200.0, 600.0], "needles": _needles("full", 0.0, everything)}
    default = _policy("trimkv+global", 0.01, dict.fromkeys(ablation.TASKS, 3))
    fewer = _policy("trimkv", 0.03, {"niah_single_2": 3, "niah_multikey_1": 3, "niah_ledger": 1, "niah_locker": 2})
    report = {"samples": 4, "full": full, "policies": {"trimkv+global": default, "trimkv": fewer}}
    return report | ({"against": against} if against else {})


def test_every_policy_is_paired_against_the_chosen_one_at_every_rate():
    text = ablation.markdown(_report("trimkv+global"))
    captions = [line for line in text.splitlines() if "(`--against`)" in line]
    assert captions == [f"At {rate:.0%}, paired against trimkv+global (`--against`):" for rate in ablation.RATES]
    table = text.split(captions[-1])[1]
    row = next(line for line in table.splitlines() if line.startswith("| trimkv |"))
    ppl = f"{100 * math.expm1(0.02):+.2f}%"  # 0.02 nats a token more than the chosen policy, on both bulletins
    assert row.startswith(f"| trimkv | {ppl} [{ppl[:-1]}, {ppl[:-1]}] | +0 [+0.0, +0.0] of 8 | -3 [")
    assert "| trimkv+global |" not in table.split("\n\n")[1]  # not paired against itself


def test_no_policy_chosen_no_tables_and_the_others_unchanged():
    assert "`--against`" not in ablation.markdown(_report(None))
    assert ablation.markdown(_report(None)) in ablation.markdown(_report("trimkv+global"))


def test_against_a_policy_never_measured_is_refused_before_the_model_loads(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["gate_ablation.py", "--policies", "random", "--against", "no such policy"])
    monkeypatch.setattr(ablation.ModelChoice, "load", lambda self: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        ablation.main()
    said = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--against 'no such policy' is no policy of gate_ablation.json" in said
    assert "random" in said.splitlines()[-1]  # the run's own policies are named among the known


def test_against_alone_trains_no_variant_and_writes_the_tables_again(monkeypatch):
    """On the second draw's results: only the model's rivals are judged (already there), and the choice is kept."""
    judged, written = [], []
    monkeypatch.setattr(
        "sys.argv", ["gate_ablation.py", "--samples", "30", "--seed", "1", "--against", "trimkv+global"]
    )
    monkeypatch.setattr(ablation.ModelChoice, "load", lambda self: (None, None))
    monkeypatch.setattr(ablation, "measure", lambda model, tokenizer, todo, *rest: judged.append(todo) or [])
    monkeypatch.setattr(ablation, "TABLE", SimpleNamespace(write=lambda report, stem: written.append((stem, report))))
    ablation.main()
    assert judged == [{"kvzip+global": "kvzip+global"}]
    assert [(stem, report["against"]) for stem, report in written] == [
        ("gate_ablation_samples30_seed1", "trimkv+global")
    ]


def test_without_against_only_what_was_measured_is_written(monkeypatch):
    """The tables are written again at the end only for `--against`; a run that measured nothing leaves the JSON."""
    written = []
    monkeypatch.setattr(
        "sys.argv", ["gate_ablation.py", "--samples", "30", "--seed", "1", "--policies", "kvzip+global"]
    )
    monkeypatch.setattr(ablation.ModelChoice, "load", lambda self: (None, None))
    monkeypatch.setattr(ablation, "measure", lambda *args: [])
    monkeypatch.setattr(ablation, "TABLE", SimpleNamespace(write=lambda report, stem: written.append(stem)))
    ablation.main()
    assert written == []
