"""Gate ensembles: `ensemble_gates` and `kvsieve ensemble-gates`."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

import kvsieve
from conftest import tiny_llama
from kvsieve.harness.training.ensemble import ensemble_gates
from kvsieve.modeling.gates import Horizons, RetentionGates, gate_shape
from kvsieve.selection.checkpoint import GateCheckpointError, TrainRecord, model_fingerprint, read_gates, save_gates
from kvsieve.selection.merge import WindowMerge

#: The horizons a member records unless a test says otherwise.
MEMBER_HORIZONS = Horizons(16.0)


def _member(folder, model, seed: int, width: int = 8, horizons: Horizons = MEMBER_HORIZONS) -> RetentionGates:
    """Gates of `seed`'s random weights (a random scoring projection too), saved as a checkpoint for `model`."""
    torch.manual_seed(seed)
    gates = RetentionGates(gate_shape(model, width=width), bias_init=2.0 + seed, horizons=horizons)
    torch.nn.init.normal_(gates.scoring.weight, std=1.0)
    record = TrainRecord("tiny", model_fingerprint(model), 8, "global", 1.0, 5, 48, seed, {}, 10.0 * seed)
    save_gates(gates, record, folder)
    return gates


def _entries(model, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    shape = gate_shape(model)
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, shape.kv_heads, 40, shape.head_dim, generator=generator) for _ in range(2))


def test_an_ensemble_scores_by_the_weighted_mean_of_its_members_logits(tmp_path):
    model = tiny_llama()
    members = [
        _member(tmp_path / f"m{i}", model, seed, width) for i, (seed, width) in enumerate([(1, 8), (2, 4), (3, 8)])
    ]
    weights = [0.5, 0.3, 0.2]
    out = ensemble_gates([tmp_path / f"m{i}" for i in range(3)], weights, tmp_path / "ensemble")
    ensemble, record = read_gates(out)
    assert ensemble.shape.width == 20 and ensemble.horizons == Horizons(16.0)
    assert [part["weight"] for part in record.data["ensemble"]] == weights
    assert (record.steps, record.seconds) == (15, 60.0)
    keys, values = (x.double() for x in _entries(model))
    for gates in (ensemble, *members):
        gates.double()
    with torch.no_grad():
        for layer in ensemble.shape.layers:
            logits = [torch.logit(g.log_beta(layer, keys, values).exp()) for g in members]
            expected = F.logsigmoid(sum(w * z for w, z in zip(weights, logits, strict=True)))
            torch.testing.assert_close(ensemble.log_beta(layer, keys, values), expected, rtol=1e-6, atol=1e-7)
            assert not torch.allclose(ensemble.log_beta(layer, keys, values), members[0].log_beta(layer, keys, values))

    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    cache = kvsieve.compress(model, ids, f"trimkv+global:gates={out}", rate=0.5)
    kept = sum(n for layer in cache.full_layers for n in cache.stored_lengths()[layer])
    assert 0 < kept < len(cache.full_layers) * model.config.num_key_value_heads * 60, "the ensemble loads and evicts"


def test_an_ensemble_of_one_weight_ranks_as_that_checkpoint(tmp_path):
    model = tiny_llama()
    alone = _member(tmp_path / "a", model, 1)
    _member(tmp_path / "b", model, 2)
    ensemble, _ = read_gates(ensemble_gates([tmp_path / "a", tmp_path / "b"], [1.0, 0.0], tmp_path / "ensemble"))
    keys, values = _entries(model)
    with torch.no_grad():
        for layer in ensemble.shape.layers:
            torch.testing.assert_close(ensemble.log_beta(layer, keys, values), alone.log_beta(layer, keys, values))


def test_an_ensemble_records_the_horizons_it_is_read_at(tmp_path):
    model = tiny_llama()
    _member(tmp_path / "a", model, 1, horizons=Horizons(16.0))
    _member(tmp_path / "b", model, 2, horizons=Horizons(math.inf, 8.0))
    pair = [tmp_path / "a", tmp_path / "b"]
    with pytest.raises(GateCheckpointError, match=r"name the horizons the ensemble is read at"):
        ensemble_gates(pair, None, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    ensemble, _ = read_gates(ensemble_gates(pair, None, tmp_path / "out", Horizons(math.inf, 128.0)))
    assert ensemble.horizons == Horizons(math.inf, 128.0)


def test_gates_that_do_not_combine_are_refused(tmp_path):
    model = tiny_llama()
    _member(tmp_path / "a", model, 1)
    _member(tmp_path / "other", tiny_llama(seed=1), 2)
    _member(tmp_path / "wide", tiny_llama(kv_heads=4), 2)
    for name in ("other", "wide"):
        with pytest.raises(GateCheckpointError, match="only gates of one model and one shape combine"):
            ensemble_gates([tmp_path / "a", tmp_path / name], None, tmp_path / "out")
    with pytest.raises(ValueError, match="2 gate checkpoints need 2 weights, got 1"):
        ensemble_gates([tmp_path / "a", tmp_path / "a"], [1.0], tmp_path / "out")
    with pytest.raises(ValueError, match="non-negative and sum to 1"):
        ensemble_gates([tmp_path / "a", tmp_path / "a"], [0.9, 0.3], tmp_path / "out")
    assert not (tmp_path / "out").exists(), "nothing written for refused input"


def test_ensemble_gates_command(tmp_path):
    from typer.testing import CliRunner

    from kvsieve.harness.cli import app

    model = tiny_llama()
    for name, seed in (("a", 1), ("b", 2)):
        _member(tmp_path / name, model, seed)
    args = ["ensemble-gates", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "ensemble")]
    runner = CliRunner(env={"COLUMNS": "200"})
    result = runner.invoke(app, [*args, "--horizon", "inf", "--bounded-horizon", "128", "--merge", "window,parts=4"])
    assert result.exit_code == 0, result.output
    ensemble, record = read_gates(tmp_path / "ensemble")
    assert ensemble.shape.width == 16 and ensemble.horizons == Horizons(math.inf, 128.0)
    assert ensemble.merge == WindowMerge(parts=4)
    assert [part["weight"] for part in record.data["ensemble"]] == [0.5, 0.5]
    for bad, message in (
        (["--weights", "0.9,0.3"], "sum to 1"),
        (["--horizon", "-1"], "horizon must be a number of tokens"),
        (["--bounded-horizon", "8"], "--bounded-horizon needs --horizon"),
        (["--merge", "sum"], "unknown merge 'sum'"),
        (["--merge", "window,size=2"], "unknown merge parameter 'size'"),
    ):
        refused = runner.invoke(app, [*args, *bad])
        assert refused.exit_code == 2 and message in refused.output, refused.output
