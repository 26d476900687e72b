"""Rows record the retention gates their policy read; a resumed run refuses rows made with other gates."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from kvsieve.harness.cli import app
from kvsieve.harness.eval.results_log import ResultsLog, StaleRowsError, read_rows
from kvsieve.harness.eval.sweep import run_sweep
from kvsieve.harness.runners import LocalRunner
from kvsieve.modeling.gates import Horizons
from kvsieve.selection.checkpoint import gates_fingerprint, read_gates
from kvsieve.selection.projection import Sentences
from test_recorded_projection import save_random_gates
from test_sweep import make_sample


def _fingerprint(folder: str) -> str:
    return gates_fingerprint(read_gates(folder)[0])


def test_the_fingerprint_follows_what_decides_the_picks(lm, tmp_path):
    """Weights, horizons and the recorded projection change it; the training record (its time) does not."""
    base = _fingerprint(save_random_gates(lm, tmp_path / "base"))
    assert len(base) == 12 and base == _fingerprint(save_random_gates(lm, tmp_path / "slower", seconds=99.0))
    changed = [
        save_random_gates(lm, tmp_path / "seed", seed=1),
        save_random_gates(lm, tmp_path / "projection", projection=Sentences(best_tokens=0.1)),
        save_random_gates(lm, tmp_path / "horizon", horizons=Horizons(128.0)),
        save_random_gates(lm, tmp_path / "bounded", horizons=Horizons(0.0, float("inf"))),
    ]
    fingerprints = [_fingerprint(folder) for folder in changed]
    assert base not in fingerprints and len(set(fingerprints)) == len(fingerprints)


def test_a_log_stamps_new_rows_and_refuses_rows_made_otherwise(tmp_path):
    path = tmp_path / "rows.jsonl"

    def made_by(gates: str):
        return lambda row: {"gates": gates} if row["policy"] == "trimkv" else {}

    log = ResultsLog(path, lambda row: row["policy"], made_by("default=aaa"))
    log.extend([{"policy": "trimkv", "x": 1}, {"policy": "random", "x": 2}])
    assert [row.get("gates") for row in read_rows(path)] == ["default=aaa", None]
    assert "trimkv" in ResultsLog(path, lambda row: row["policy"], made_by("default=aaa"))
    with pytest.raises(StaleRowsError, match=r"holds 1 rows made otherwise.*'default=aaa'.*'default=bbb'"):
        ResultsLog(path, lambda row: row["policy"], made_by("default=bbb"))
    path.write_text(json.dumps({"policy": "trimkv", "x": 1}) + "\n")  # a row from before rows recorded gates
    with pytest.raises(StaleRowsError, match=r"not recorded"):
        ResultsLog(path, lambda row: row["policy"], made_by("default=aaa"))


def test_a_resumed_sweep_refuses_rows_of_retrained_gates(lm, tok, tmp_path):
    """Gates trained again in the same folder keep the policy's name: the rows they made before are an error,
    not rows silently mixed in; the rows of policies that read no gates stay usable."""
    path, folder = tmp_path / "results.jsonl", save_random_gates(lm, tmp_path / "gates")
    spec = f"trimkv+global:gates={folder}"
    rows = run_sweep(LocalRunner(lm, tok), [make_sample(0)], [spec, "random"], [0.5], results=path)
    gates = rows.set_index("policy")["gates"]
    assert gates[spec] == f"{folder}={_fingerprint(folder)}" and gates[["random", "full"]].isna().all()
    run_sweep(LocalRunner(lm, tok), [make_sample(0)], [spec, "random"], [0.5], results=path)
    assert len(read_rows(path)) == 3  # the same gates: resumed, nothing made again

    save_random_gates(lm, tmp_path / "gates", seed=1)  # trained again in place
    with pytest.raises(StaleRowsError, match=rf"{path.name} holds 1 rows made otherwise.*trimkv\+global"):
        run_sweep(LocalRunner(lm, tok), [make_sample(0)], [spec], [0.5], results=path)
    again = run_sweep(LocalRunner(lm, tok), [make_sample(0), make_sample(1)], ["random"], [0.5], results=path)
    assert len(again) == 5 and len(read_rows(path)) == 5


def test_the_sweep_command_names_out_for_rows_of_other_gates(model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    gates, out = save_random_gates(model, tmp_path / "gates"), tmp_path / "sweep"
    args = ["sweep", "--model", str(model_dir), "--tasks", "base", "--policies", f"trimkv+global:gates={gates}"]
    args += ["--rates", "0.5", "--samples", "1", "--length", "256", "--out", str(out), "--no-maps"]
    assert CliRunner().invoke(app, args).exit_code == 0
    save_random_gates(model, tmp_path / "gates", seed=1)
    result = CliRunner().invoke(app, args)
    said = " ".join(result.output.replace("│", " ").split())  # the error panel wraps long lines
    assert result.exit_code == 2 and "--out" in said and "rows made otherwise" in said and "Traceback" not in said


def test_the_gate_ablation_measures_again_an_entry_of_retrained_gates(lm, tok, tmp_path):
    """benchmarks/gate_ablation.py keeps its results per policy in a JSON: an entry records the gates it read (the
    gates home left out), and one whose gates were trained again since is measured again, not kept."""
    from test_docs import _benchmarks_module

    ablation = _benchmarks_module("gate_ablation")
    runner, home = LocalRunner(lm, tok), tmp_path / "home"
    policy = f"trimkv+global:gates={home / 'variant'}"
    assert ablation.gates_now(runner, policy, home) is None  # not trained here: nothing to compare
    save_random_gates(lm, home / "variant")
    stored = {"gates": ablation.gates_now(runner, policy, home)}
    assert stored["gates"] == f"variant={_fingerprint(str(home / 'variant'))}"
    assert ablation.gates_now(runner, "random", home) == ""
    assert not ablation.measured_again(stored, ablation.gates_now(runner, policy, home))
    save_random_gates(lm, home / "variant", seed=1)
    assert ablation.measured_again(stored, ablation.gates_now(runner, policy, home))
    assert not ablation.measured_again({}, ablation.gates_now(runner, policy, home))  # from before the record
