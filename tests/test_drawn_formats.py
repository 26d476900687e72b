"""Needles in formats drawn anew for every sample (the procedural suite): training data alone, never a held-out word."""

from __future__ import annotations

import random

import pytest

from kvsieve.harness.data.drawn_formats import DrawnFormats
from kvsieve.harness.data.needle_format import content_words
from kvsieve.harness.data.ruler import DRAWN_FORMATS, PROCEDURAL_TASKS, RULER_FORMAT, UNSEEN_NEEDLE_WORDS
from kvsieve.harness.data.suites import task_samples
from kvsieve.harness.training.data import training_data


def test_every_drawn_format_is_new_and_shares_no_word_with_an_unseen_needle():
    rng = random.Random(0)
    formats = [DRAWN_FORMATS.drawn(rng) for _ in range(300)]
    assert len({f.sentence for f in formats}) == len(formats)
    assert len({f.name for f in formats}) > 1
    unseen = UNSEEN_NEEDLE_WORDS
    assert {"ledger", "locker"} <= unseen and DRAWN_FORMATS.excluded == unseen
    for fmt in formats:
        assert not content_words(fmt.sentence) & unseen, fmt.sentence
        needle = fmt.needle("amber-fox", "1234567", "numbers")
        assert "amber-fox" in needle and needle.endswith("1234567.")
        _, question, prefix = fmt.asks(True, "numbers", "amber-fox")
        assert "amber-fox" in question and f"{prefix} 1234567." == needle  # the prefix leads to the value


def test_a_fixed_format_draws_nothing_so_earlier_samples_stay_as_they_were():
    rng = random.Random(5)
    state = rng.getstate()
    assert RULER_FORMAT.drawn(rng) is RULER_FORMAT and rng.getstate() == state


def test_a_skeleton_holding_an_excluded_word_is_refused():
    with pytest.raises(ValueError, match=r"drawn needle skeletons hold excluded words: .*'filed'"):
        DrawnFormats(frozenset({"filed", "zebra"}))


def test_procedural_samples_hold_their_answer_once_in_the_asked_needle(tok):
    samples = task_samples("procedural", tok, length=640, n=2, seed=3, chat=False)
    assert [s.task for s in samples] == [t for t in PROCEDURAL_TASKS for _ in range(2)]
    sentences = set()
    for sample in samples:
        assert sample.suite == "procedural"
        (answer,) = sample.answers
        (query,) = sample.meta["queries"]
        (start, end), *_ = sample.evidence
        needle = sample.context[start:end]
        assert answer in needle and query in needle and sample.context.count(answer) == 1
        assert query in sample.question and query in sample.answer_prefix
        sentences.add(needle.replace(answer, "").replace(query, ""))
    assert len(sentences) == len(samples)


def test_training_reads_procedural_needles_when_asked(tok):
    data = training_data(tok, 1024, per_task=1, seed=0, tasks="procedural")
    assert data.split["tasks"] == "procedural" and sum(n > 0 for n in data.answers) == len(PROCEDURAL_TASKS)
