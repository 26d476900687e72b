"""The gates' training objectives beyond the plain ones: KVzip's keep decision mixed into the full cache's output,
the output weighed again at the answers, a length curriculum, their bad input, and the held-back genre no training
set reads."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from typer.testing import CliRunner

from conftest import tiny_llama
from kvsieve.harness.cli import app
from kvsieve.harness.data.news import news_reports, sample_news
from kvsieve.harness.training.data import TrainingData, training_data
from kvsieve.harness.training.kvzip_target import (
    KVZIP_TEACHER,
    indifferent_entries,
    keep_loss,
    kvzip_keep,
    kvzip_step,
    log_survival,
)
from kvsieve.harness.training.retention import RetentionTape
from kvsieve.harness.training.train import (
    TrainConfig,
    answer_positions,
    loss_positions,
    objective_step,
    output_sensitivity,
    train_gates,
    train_step,
)
from kvsieve.modeling.gates import RetentionGates, gate_shape
from kvsieve.modeling.rotary import find_rotary
from kvsieve.runtime.observing.prefill import observe_prefill
from kvsieve.selection.checkpoint import read_gates
from kvsieve.selection.observation import Needs
from kvsieve.selection.protection import protected_mask
from kvsieve.selection.spec import make_policy
from tokenizer import VOCAB_SIZE

SEQ, CAPACITY = 96, 48


def _ids(seed: int, length: int = SEQ) -> torch.Tensor:
    return torch.randint(3, VOCAB_SIZE, (1, length), generator=torch.Generator().manual_seed(seed))


def _tape(model, gates: RetentionGates, length: int = SEQ) -> RetentionTape:
    return RetentionTape(gates, *find_rotary(model)(torch.arange(length)))


def test_the_mixed_objective_weighs_kvzips_keep_decision_against_the_output(tok):
    model = tiny_llama(vocab_size=VOCAB_SIZE)
    gates = RetentionGates(gate_shape(model, 8), bias_init=2.0)
    ids, weight = _ids(0), 0.3
    config = TrainConfig(capacity=CAPACITY, seq_len=SEQ, kl_tokens=32, kvzip_weight=weight)
    with torch.no_grad():
        mixed = objective_step(model, tok, _tape(model, gates), ids, config, torch.Generator().manual_seed(5))
        positions = loss_positions(SEQ, 32, torch.Generator().manual_seed(5))
        output = train_step(model, gates, _tape(model, gates), ids, config, positions)
        keep = kvzip_step(model, tok, gates, ids, CAPACITY)
        plain = objective_step(
            model,
            tok,
            _tape(model, gates),
            ids,
            dataclasses.replace(config, kvzip_weight=0.0),
            torch.Generator().manual_seed(5),
        )
    expected = (1 - weight) * output["quality"] + weight * keep["loss"] + config.lam * output["capacity"]
    torch.testing.assert_close(mixed["loss"], expected)
    torch.testing.assert_close(mixed["recall"], keep["recall"])
    torch.testing.assert_close(plain["loss"], output["loss"])  # weight 0: the full cache's output alone
    assert "keep" not in plain


def test_mixing_in_kvzip_moves_the_gates_toward_its_decision(tok, tmp_path):
    model = tiny_llama(vocab_size=VOCAB_SIZE)
    data = TrainingData([_ids(seed) for seed in range(4)], {})
    variants = {"plain": {}, "all": {"kvzip_weight": 0.5}, "kept": {"kvzip_weight": 0.5, "kvzip_entries": "kept"}}
    recall = {}
    for name, settings in variants.items():
        config = TrainConfig(capacity=CAPACITY, steps=30, seq_len=SEQ, lr=3e-2, width=8, **settings)
        gates, record = train_gates(model, tok, config, tmp_path / name, "tiny", data=data, show_progress=False)
        with torch.no_grad():
            steps = [kvzip_step(model, tok, gates, ids, CAPACITY)["recall"] for ids in data.sequences]
        recall[name] = float(sum(steps)) / len(steps)
        assert record.data["config"]["kvzip_weight"] == config.kvzip_weight
    assert recall["all"] > recall["plain"] + 0.05, recall
    assert recall["kept"] > recall["plain"] + 0.05, recall  # raising KVzip's kept entries alone moves them too


def test_the_kept_only_keep_loss_raises_kvzips_kept_entries_and_pushes_none_down():
    log_p = torch.log(torch.tensor([0.9, 0.2, 0.5, 0.05], dtype=torch.float64, requires_grad=True))
    keep = torch.tensor([True, False, True, False])
    torch.testing.assert_close(keep_loss(log_p, keep, kept_only=True), -(log_p[0] + log_p[2]) / 2)
    (grad,) = torch.autograd.grad(keep_loss(log_p, keep, kept_only=True), log_p)
    assert (grad[keep] < 0).all() and (grad[~keep] == 0).all()  # descent raises the kept, leaves the rest
    (both,) = torch.autograd.grad(keep_loss(log_p, keep), log_p)
    assert (both[~keep] > 0).all()  # the full decision pushes the dropped entries down


def test_the_output_sensitivity_is_zero_for_entries_no_drawn_position_reads():
    model = tiny_llama(vocab_size=VOCAB_SIZE)
    gates = RetentionGates(gate_shape(model, 8), bias_init=2.0)
    tape = _tape(model, gates)
    positions = torch.tensor([3, 20, 40, 59])
    terms = train_step(model, gates, tape, _ids(0), TrainConfig(capacity=CAPACITY, seq_len=SEQ), positions)
    sensitivity = output_sensitivity(terms["quality"], tape)
    assert set(sensitivity) == set(gates.shape.layers)
    for size in sensitivity.values():
        assert size.shape == (model.config.num_key_value_heads, SEQ)
        assert (size[:, 60:] == 0).all()  # read by no drawn query
        assert (size[:, :59] > 0).any()


def test_kvzip_decides_only_where_the_output_is_indifferent(tok):
    model = tiny_llama(vocab_size=VOCAB_SIZE)
    gates = RetentionGates(gate_shape(model, 8), bias_init=2.0)
    ids = _ids(1)
    moving = torch.arange(SEQ) % 4 == 0  # a quarter of the entries move the output, the rest not at all
    sensitivity = {layer: moving.float().expand(model.config.num_key_value_heads, SEQ) for layer in gates.shape.layers}
    teacher = make_policy(KVZIP_TEACHER)
    with torch.no_grad():
        loss = kvzip_step(model, tok, gates, ids, CAPACITY, "indifferent", sensitivity)["loss"]
        observations = observe_prefill(model, ids, Needs(rotary=True) | teacher.needs, tokenizer=tok).observations[0]
        keep = kvzip_keep(observations, teacher, CAPACITY)
        still = [~protected_mask(obs, teacher.n_sink, teacher.n_recent) & ~moving for obs in observations]
        log_p = torch.cat([log_survival(gates, obs)[mask] for obs, mask in zip(observations, still, strict=True)])
        target = torch.cat([kept[mask] for kept, mask in zip(keep, still, strict=True)])
    torch.testing.assert_close(loss, keep_loss(log_p, target))  # where the output moves, KVzip stays out
    small = [torch.tensor([[0.0, 5.0, 1.0, 2.0]]), torch.tensor([[3.0, 9.0, 0.5, 4.0]])]
    scored = [torch.tensor([[True, True, True, False]]), torch.tensor([[True, False, True, True]])]
    picked = indifferent_entries(small, scored)  # the scored sizes 0, 5, 1, 3, 0.5, 4: median 1
    assert [mask.tolist() for mask in picked] == [[[True, False, True, False]], [[False, False, True, False]]]


def test_the_answer_weight_adds_the_kl_where_the_answer_is_predicted():
    model = tiny_llama(vocab_size=VOCAB_SIZE)
    gates = RetentionGates(gate_shape(model, 8), bias_init=1.0)
    ids, answer, weight = _ids(0), 5, 2.0
    assert answer_positions(SEQ, answer).tolist() == list(range(SEQ - 6, SEQ - 1))  # each predicts an answer token
    config = TrainConfig(capacity=CAPACITY, seq_len=SEQ, kl_tokens=32, answer_weight=weight)
    with torch.no_grad():
        weighed = objective_step(
            model, None, _tape(model, gates), ids, config, torch.Generator().manual_seed(5), answer
        )
        positions = loss_positions(SEQ, 32, torch.Generator().manual_seed(5))
        plain = train_step(model, gates, _tape(model, gates), ids, TrainConfig(capacity=CAPACITY), positions)
        at_answer = train_step(
            model, gates, _tape(model, gates), ids, TrainConfig(capacity=CAPACITY), answer_positions(SEQ, answer)
        )
        document = objective_step(model, None, _tape(model, gates), ids, config, torch.Generator().manual_seed(5))
    assert float(at_answer["kl"]) > 0
    torch.testing.assert_close(weighed["answer"], at_answer["kl"])
    torch.testing.assert_close(weighed["loss"], plain["loss"] + weight * at_answer["kl"])
    torch.testing.assert_close(document["loss"], plain["loss"])  # no answer: the plain objective
    assert "answer" not in document


def test_weighing_the_answers_trains_gates_that_keep_what_the_answer_needs(tmp_path):
    model = tiny_llama(vocab_size=VOCAB_SIZE)
    answer = 6
    data = TrainingData([_ids(seed) for seed in range(4)], {}, [answer] * 4)
    at_answer = {}
    for weight in (0.0, 4.0):
        config = TrainConfig(capacity=24, steps=30, seq_len=SEQ, lr=3e-2, width=8, kl_tokens=16, answer_weight=weight)
        gates, record = train_gates(model, None, config, tmp_path / str(weight), "tiny", data=data, show_progress=False)
        assert record.data["config"]["answer_weight"] == weight
        read = TrainConfig(capacity=24)
        with torch.no_grad():
            kls = [
                train_step(model, gates, _tape(model, gates), ids, read, answer_positions(SEQ, answer))["kl"]
                for ids in data.sequences
            ]
        at_answer[weight] = float(sum(kls)) / len(kls)
    assert at_answer[4.0] < 0.9 * at_answer[0.0], at_answer


class _Interrupting(list):
    """Sequences whose first read stops the run, as Ctrl-C would."""

    def __getitem__(self, index):
        raise KeyboardInterrupt


def test_a_curriculum_trains_each_length_in_its_share_and_resumes_exactly(tmp_path):
    model = tiny_llama(vocab_size=VOCAB_SIZE)
    short = TrainingData([_ids(s, SEQ // 2) for s in range(3)], {"source": "short"})
    long = TrainingData([_ids(s, SEQ) for s in range(10, 13)], {"source": "long"})
    config = TrainConfig(capacity=8, steps=7, curriculum=(SEQ // 2, SEQ), lr=5e-2, width=8, save_every=3)
    assert config.lengths == (SEQ // 2, SEQ)
    assert [config.phase_of(step)[0] for step in range(7)] == [0, 0, 0, 1, 1, 1, 1]  # the remainder goes last
    assert [config.phase_of(step)[1] for step in range(7)] == [0, 1, 2, 0, 1, 2, 3]
    gates, record = train_gates(model, None, config, tmp_path / "a", "tiny", data=[short, long], show_progress=False)
    assert record.data["phase_sequences"] == [3, 3] and tuple(record.data["config"]["curriculum"]) == (SEQ // 2, SEQ)
    # a run interrupted when the long phase begins (saved at step 3) finishes to the same gates
    interrupted = TrainingData(_Interrupting(long.sequences), {})
    with pytest.raises(KeyboardInterrupt):
        train_gates(model, None, config, tmp_path / "b", "tiny", data=[short, interrupted], show_progress=False)
    assert torch.load(tmp_path / "b" / "train_state.pt", weights_only=True)["step"] == 3
    resumed, _ = train_gates(model, None, config, tmp_path / "b", "tiny", data=[short, long], show_progress=False)
    for name, tensor in gates.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], tensor, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="the curriculum has 2 phases, the data 1"):
        train_gates(model, None, config, tmp_path / "c", "tiny", data=short, show_progress=False)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"kvzip_weight": 1.5}, r"kvzip_weight must be in \[0, 1\]"),
        ({"kvzip_weight": -0.1}, r"kvzip_weight must be in \[0, 1\]"),
        ({"kvzip_weight": 0.5, "target": "kvzip"}, "target 'kvzip' uses it alone"),
        ({"curriculum": (512, 64)}, "capacity 128 must be below every sequence length, got 64"),
        ({"curriculum": (512, 1024, 2048), "steps": 2}, "needs at least as many steps"),
        ({"answer_weight": -1.0}, "answer_weight must be >= 0"),
        ({"kvzip_entries": "kept"}, "give a kvzip_weight > 0"),
        ({"kvzip_entries": "indifferent", "target": "kvzip"}, "give a kvzip_weight > 0"),
        ({"kvzip_entries": "some", "kvzip_weight": 0.1}, "kvzip_entries must be one of"),
        ({"answer_weight": 1.0, "target": "kvzip"}, "target 'kvzip' has no output"),
    ],
)
def test_bad_settings_are_refused_when_the_config_is_made(settings, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**settings)


def test_what_the_model_cannot_do_is_refused_before_training(tmp_path):
    model = tiny_llama(vocab_size=VOCAB_SIZE)  # 1,024 positions, and no tokenizer given
    data = TrainingData([_ids(0)], {})
    too_long = TrainConfig(capacity=8, steps=2, curriculum=(SEQ, 2048))
    with pytest.raises(ValueError, match=r"curriculum's longest sequence \(2048 tokens\) is longer than the model's"):
        train_gates(model, None, too_long, tmp_path / "a", "tiny", data=[data, data], show_progress=False)
    for config in (
        TrainConfig(capacity=8, seq_len=SEQ, target="kvzip"),
        TrainConfig(capacity=8, seq_len=SEQ, kvzip_weight=0.2),
    ):
        with pytest.raises(ValueError, match="the kvzip target needs the model's tokenizer"):
            train_gates(model, None, config, tmp_path / "b", "tiny", data=data, show_progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # nothing written, no step taken


def test_the_command_line_takes_the_mix_and_the_curriculum_and_names_bad_values(model_dir, tmp_path):
    out = tmp_path / "gates"
    args = ["train-gates", "--model", str(model_dir), "--out", str(out), "--steps", "2", "--capacity", str(CAPACITY)]
    args += ["--per-task", "0", "--tasks", "ruler,varied"]
    runner = CliRunner(env={"COLUMNS": "200"})
    mix = ["--kvzip-weight", "0.25", "--kvzip-entries", "indifferent", "--answer-weight", "2"]
    result = runner.invoke(app, [*args, *mix, "--curriculum", f"{SEQ},{2 * SEQ}"])
    assert result.exit_code == 0, result.output
    _, record = read_gates(out)
    assert record.data["config"]["kvzip_weight"] == 0.25 and record.data["config"]["curriculum"] == [SEQ, 2 * SEQ]
    assert record.data["config"]["answer_weight"] == 2.0 and record.data["config"]["kvzip_entries"] == "indifferent"
    assert record.data["config"]["tasks"] == "ruler,varied"
    for extra, message in [
        (["--kvzip-weight", "2"], "kvzip_weight must be in [0, 1]"),
        (["--answer-weight", "-1"], "answer_weight must be >= 0"),
        (["--kvzip-entries", "kept"], "give a kvzip_weight > 0"),
        (["--curriculum", "96,many"], "is not a comma-separated list of sequence lengths"),
        (["--curriculum", "96,100000"], "is longer than the model's context"),
        (["--kvzip-weight", "0.1", "--capacity", "20"], "capacity 20 leaves KVzip nothing to decide"),
        (["--tasks", "ruler,unseen"], "are held out of every training set"),
    ]:
        bad = runner.invoke(app, [*args, "--out", str(tmp_path / "bad"), *extra])
        assert bad.exit_code == 2 and message in bad.output, bad.output
    assert not (tmp_path / "bad").exists()


def test_the_held_back_genre_is_read_by_no_training_set(tok):
    bulletins = sample_news(tok, 4, 700, seed=1)
    assert len({name for name, _ in bulletins}) == 4 and all(ids.shape == (1, 700) for _, ids in bulletins)
    assert all(ids[0, 0] == tok.bos_token_id for _, ids in bulletins)
    with pytest.raises(ValueError, match="fewer than 100000"):
        sample_news(tok, 100_000, 700)
    trained_on = "".join(tok.decode(ids[0]) for ids in training_data(tok, 1024, per_task=0, seed=0).sequences)
    openings = [report[:60] for report in news_reports()]
    assert len(openings) == 300 and not any(opening in trained_on for opening in openings)


def test_a_model_folder_without_a_tokenizer_is_named_before_anything_trains(tmp_path):
    folder = tmp_path / "no-tokenizer"
    tiny_llama(vocab_size=VOCAB_SIZE).save_pretrained(folder)
    args = ["train-gates", "--model", str(folder), "--out", str(tmp_path / "gates"), "--target", "kvzip"]
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args, "--capacity", str(CAPACITY), "--seq-len", str(SEQ)])
    assert result.exit_code == 2 and "has no tokenizer kvsieve can load" in result.output, result.output
    assert "--model" in result.output and not (tmp_path / "gates").exists()
