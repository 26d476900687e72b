"""Gate soups: `average_gates` and `kvsieve average-gates`."""

from __future__ import annotations

import pytest
import torch

import kvsieve
from conftest import tiny_llama
from kvsieve.harness.training.soup import average_gates
from kvsieve.modeling.gates import RetentionGates, gate_shape
from kvsieve.selection.checkpoint import GateCheckpointError, TrainRecord, model_fingerprint, read_gates, save_gates


def _ingredient(folder, model, seed: int, record_seed: int = 0, seconds: float = 10.0) -> RetentionGates:
    """Gates of `seed`'s random weights, saved as a checkpoint for `model` that says it trained from `record_seed`."""
    torch.manual_seed(seed)
    gates = RetentionGates(gate_shape(model, width=8), bias_init=3.0)
    record = TrainRecord("tiny", model_fingerprint(model), 8, "global", 1.0, 5, 48, record_seed, {}, seconds)
    save_gates(gates, record, folder)
    return gates


def test_a_soup_is_the_weighted_mean_of_every_parameter_and_scores_as_gates(tmp_path):
    model = tiny_llama()
    a, b = (_ingredient(tmp_path / name, model, seed) for name, seed in (("a", 1), ("b", 2)))
    out = average_gates([tmp_path / "a", tmp_path / "b"], [0.25, 0.75], tmp_path / "soup")
    soup, record = read_gates(out)
    for name, value in soup.state_dict().items():
        torch.testing.assert_close(value, 0.25 * a.state_dict()[name] + 0.75 * b.state_dict()[name])
    assert (record.steps, record.seconds, record.model_hash) == (10, 20.0, model_fingerprint(model))
    assert [part["weight"] for part in record.data["soup"]] == [0.25, 0.75]
    assert record.data["soup"][1]["source"] == str(tmp_path / "b")

    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    policies = {name: kvsieve.make_policy(f"trimkv:gates={tmp_path / name}") for name in ("a", "b", "soup")}
    needs = policies["a"].needs | policies["b"].needs | policies["soup"].needs
    first = kvsieve.observe_prefill(model, ids, needs).observations[0][0]
    scores = {name: policy.scorer.score(first) for name, policy in policies.items()}
    assert not torch.allclose(scores["soup"], scores["a"]) and not torch.allclose(scores["soup"], scores["b"])
    cache = kvsieve.compress(model, ids, f"trimkv+global:gates={out}", rate=0.5)
    kept = sum(n for layer in cache.full_layers for n in cache.stored_lengths()[layer])
    assert 0 < kept < len(cache.full_layers) * first.num_kv_heads * 60, "the soup loads for its model and evicts"


def test_a_soup_of_one_weight_is_that_checkpoint(tmp_path):
    model = tiny_llama()
    a = _ingredient(tmp_path / "a", model, 1)
    _ingredient(tmp_path / "b", model, 2)
    soup, _ = read_gates(average_gates([tmp_path / "a", tmp_path / "b"], [1.0, 0.0], tmp_path / "soup"))
    assert all(torch.equal(soup.state_dict()[k], v) for k, v in a.state_dict().items())


def test_gates_that_do_not_average_are_refused(tmp_path):
    model = tiny_llama()
    _ingredient(tmp_path / "a", model, 1)
    _ingredient(tmp_path / "seed", model, 2, record_seed=7)
    _ingredient(tmp_path / "other", tiny_llama(seed=1), 2)
    _ingredient(tmp_path / "wide", tiny_llama(kv_heads=4), 2)
    pairs = [tmp_path / "a", tmp_path / "seed"]
    with pytest.raises(GateCheckpointError, match=r"from seed 7.*same start"):
        average_gates(pairs, [0.5, 0.5], tmp_path / "out")
    for name in ("other", "wide"):
        with pytest.raises(GateCheckpointError, match="only gates of one model and one shape combine"):
            average_gates([tmp_path / "a", tmp_path / name], [0.5, 0.5], tmp_path / "out")
    with pytest.raises(ValueError, match="2 gate checkpoints need 2 weights, got 3"):
        average_gates(pairs, [0.2, 0.3, 0.5], tmp_path / "out")
    for weights in ([0.7, 0.7], [1.5, -0.5]):
        with pytest.raises(ValueError, match="non-negative and sum to 1"):
            average_gates(pairs, weights, tmp_path / "out")
    assert not (tmp_path / "out").exists(), "nothing written for refused input"


def test_average_gates_command(tmp_path):
    from typer.testing import CliRunner

    from kvsieve.harness.cli import app

    model = tiny_llama()
    a, b = (_ingredient(tmp_path / name, model, seed) for name, seed in (("a", 1), ("b", 2)))
    args = ["average-gates", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "soup")]
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, args)
    assert result.exit_code == 0, result.output
    soup, record = read_gates(tmp_path / "soup")
    name = "scoring.weight"
    torch.testing.assert_close(soup.state_dict()[name], (a.state_dict()[name] + b.state_dict()[name]) / 2)
    assert record.data["soup"][0]["weight"] == 0.5
    bad = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args, "--weights", "0.9,0.3"])
    assert bad.exit_code == 2 and "sum to 1" in bad.output
    missing = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args[:2], str(tmp_path / "nowhere"), *args[3:]])
    assert missing.exit_code == 2 and "not a retention-gate checkpoint" in missing.output
