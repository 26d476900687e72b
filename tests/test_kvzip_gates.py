"""Gates taught by KVzip (`train-gates --target kvzip`): the target is kvsieve's own kvzip+global decision, the loss
is the binary cross-entropy of each entry's survival, and training moves the gates' ranking toward KVzip's."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import kvsieve
from conftest import tiny_llama
from kvsieve.harness.training.data import TrainingData
from kvsieve.harness.training.kvzip_target import KVZIP_TEACHER, keep_loss, kvzip_keep, kvzip_step, log_survival
from kvsieve.harness.training.train import TrainConfig, train_gates
from kvsieve.modeling.gates import RetentionGates, gate_shape
from kvsieve.selection.observation import Needs
from tokenizer import VOCAB_SIZE

SEQ, CAPACITY = 96, 48  # 33 entries of a head are protected (a sink, 32 recent)


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB_SIZE, (1, SEQ), generator=torch.Generator().manual_seed(seed))


def test_keep_loss_is_the_binary_cross_entropy_of_survival():
    log_p = torch.log(torch.tensor([0.9, 0.2, 0.6, 0.05]))
    keep = torch.tensor([True, False, False, True])
    expected = F.binary_cross_entropy(log_p.exp(), keep.float())
    torch.testing.assert_close(keep_loss(log_p, keep), expected)
    assert torch.isfinite(keep_loss(torch.zeros(2), torch.tensor([False, True])))  # p = 1 for an evicted entry


@torch.no_grad()
def test_the_target_is_what_kvzip_global_keeps(tok):
    model, ids = tiny_llama(vocab_size=VOCAB_SIZE), _ids(0)
    teacher = kvsieve.make_policy(KVZIP_TEACHER)
    prefill = kvsieve.observe_prefill(model, ids, teacher.needs, tokenizer=tok)
    masks = kvzip_keep(prefill.observations[0], teacher, CAPACITY)
    cache = kvsieve.compress(model, ids, KVZIP_TEACHER, max_tokens=CAPACITY, tokenizer=tok)
    for layer, mask in enumerate(masks):
        for head, kept in enumerate(cache.kept_positions(layer)):
            assert torch.equal(mask[head].nonzero().flatten(), kept)
    assert sum(int(m.sum()) for m in masks) == CAPACITY * 3 * 2
    assert len({int(m.sum()) for mask in masks for m in mask}) > 1, "one global budget: ragged heads"


@torch.no_grad()
def test_log_survival_is_distance_times_log_beta(tok):
    model, ids = tiny_llama(vocab_size=VOCAB_SIZE), _ids(1)
    gates = RetentionGates(gate_shape(model, 8), bias_init=2.0)
    obs = kvsieve.observe_prefill(model, ids, Needs(rotary=True)).observations[0][1]
    policy = kvsieve.make_policy("trimkv:gates=untrained")
    scores = log_survival(gates, obs)
    assert scores.shape == (2, SEQ)
    # trimkv's own score at the next step is the same quantity, for gates of the same weights
    from kvsieve.modeling.gates import retention_scores
    from kvsieve.modeling.rotary import unrotate

    cos, sin = obs.rotary(obs.positions.flatten())
    keys = unrotate(obs.keys.float(), *(x.view(*obs.positions.shape, -1) for x in (cos, sin)))
    expected = retention_scores(gates.log_beta(1, keys, obs.values.float()), obs.positions, SEQ)
    torch.testing.assert_close(scores, expected)
    assert policy.needs.rotary


def test_training_on_kvzip_lowers_the_loss_and_raises_the_agreement(tok, tmp_path):
    model = tiny_llama(vocab_size=VOCAB_SIZE)
    data = TrainingData([_ids(seed) for seed in range(4)], {})
    config = TrainConfig(capacity=CAPACITY, steps=40, seq_len=SEQ, lr=3e-2, width=8, target="kvzip", save_every=40)
    gates, record = train_gates(model, tok, config, tmp_path / "g", "tiny", data=data, show_progress=False)
    torch.manual_seed(config.seed)
    fresh = RetentionGates(gate_shape(model, 8), bias_init=config.bias_init)
    with torch.no_grad():
        before = [kvzip_step(model, tok, fresh, ids, CAPACITY) for ids in data.sequences]
        after = [kvzip_step(model, tok, gates, ids, CAPACITY) for ids in data.sequences]
    mean = lambda terms, key: sum(float(t[key]) for t in terms) / len(terms)  # noqa: E731
    assert mean(after, "loss") < 0.8 * mean(before, "loss")
    assert mean(after, "recall") > mean(before, "recall") + 0.05
    assert record.data["config"]["target"] == "kvzip"
    assert all(p.grad is None for p in model.parameters())
    # the checkpoint is a trimkv policy like any other
    cache = kvsieve.compress(model, data.sequences[0], f"trimkv+global:gates={tmp_path / 'g'}", max_tokens=CAPACITY)
    assert cache.mean_stored() == pytest.approx(CAPACITY, abs=1.0)


def test_train_gates_command_takes_the_kvzip_target(model_dir, tmp_path):
    from typer.testing import CliRunner

    from kvsieve.harness.cli import app
    from kvsieve.selection.checkpoint import read_gates

    out = tmp_path / "gates"
    args = ["train-gates", "--model", str(model_dir), "--out", str(out), "--steps", "2", "--seq-len", str(SEQ)]
    args += ["--capacity", str(CAPACITY), "--per-task", "0"]
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args, "--target", "kvzip"])
    assert result.exit_code == 0, result.output
    _, record = read_gates(out)
    assert record.data["config"]["target"] == "kvzip" and record.steps == 2
    bad = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args, "--target", "kvzap"])
    assert bad.exit_code == 2 and "target must be one of" in bad.output
