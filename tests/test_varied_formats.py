"""The varied needle formats: training data alone, apart from the unseen formats every benchmark holds out."""

from __future__ import annotations

import pytest

from kvsieve.harness.data.needle_format import content_words
from kvsieve.harness.data.ruler import NIAH_CONFIGS, UNSEEN_NEEDLE_WORDS, VARIED_FORMATS, VARIED_TASKS
from kvsieve.harness.data.suites import resolve_tasks, task_samples
from kvsieve.harness.training.data import TRAINING_TASKS, training_data
from kvsieve.harness.training.train import TrainConfig


def test_no_varied_format_shares_a_word_with_an_unseen_needle():
    unseen = UNSEEN_NEEDLE_WORDS
    for fmt in VARIED_FORMATS:
        assert content_words(fmt.sentence) and not content_words(fmt.sentence) & unseen, fmt.name
    assert len({fmt.sentence for fmt in VARIED_FORMATS}) == len(VARIED_FORMATS)
    assert not set(resolve_tasks(TRAINING_TASKS)) & set(VARIED_TASKS)  # trained on only when asked


def test_varied_samples_hold_their_answer_once_in_the_asked_needle(tok):
    for sample in task_samples("varied", tok, length=640, n=2, seed=3, chat=False):
        config = NIAH_CONFIGS[sample.task]
        assert sample.suite == "varied" and config.format in VARIED_FORMATS
        (answer,) = sample.answers
        (query,) = sample.meta["queries"]
        (start, end), *_ = sample.evidence
        assert answer in sample.context[start:end] and query in sample.context[start:end]
        assert sample.context.count(answer) == 1 and query in sample.question and query in sample.answer_prefix
        assert len(sample.meta["keys"]) == config.n_keys


def test_training_reads_the_varied_formats_when_asked_and_never_the_unseen_ones(tok):
    data = training_data(tok, 1024, per_task=1, seed=0, tasks="varied")
    text = "".join(tok.decode(ids[0]) for ids in data.sequences)
    for fmt in VARIED_FORMATS:
        assert fmt.sentence.split("{value}")[0].split("}")[-1] in text, fmt.name
    assert data.split["tasks"] == "varied" and sum(n > 0 for n in data.answers) == len(VARIED_TASKS)
    for tasks in ("unseen", "ruler,niah_locker"):
        held_out = r"are held out of every training set .* train on ruler, varied, procedural, routing"
        with pytest.raises(ValueError, match=held_out):
            TrainConfig(tasks=tasks)
    with pytest.raises(ValueError, match="unknown task 'needles'"):
        TrainConfig(tasks="ruler,needles")
