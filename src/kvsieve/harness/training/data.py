"""Training sequences for retention gates: windows of documents and evidence-bearing samples with their answers.

By default, the bundled essays and task generators; with a corpus (`train-gates --data`,
`kvsieve.harness.training.corpus`), the user's documents and question-answer records. Essays are
split by document (`kvsieve.harness.data.essay_split`): only the training ones are read here, and
the perplexity of learned policies is measured on the held-back ones. Task samples (RULER-style and
routing families) come from `TRAINING_TASK_SEED`, far from every evaluation seed, and are fed with
their question and gold answer after the context, so the distillation loss sees what evidence a
later question needs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from ..data import document_windows, encode, essay_split, essay_texts, task_samples
from ..data.suites import SUITES, resolve_tasks
from .corpus import CorpusError, QARecord, read_corpus

#: Seed of the task samples gates are trained on; evaluations use small seeds (0 by default).
TRAINING_TASK_SEED = 1_000_003
#: The task suites training samples come from by default (`TrainConfig.tasks`; ``varied`` adds needles written
#: six more ways). The ``unseen`` suite is never trained on.
TRAINING_TASKS = "ruler,routing"


def training_tasks(names: str) -> list[str]:
    """The tasks `names` (tasks or suites) expand to; ValueError if one is unknown or held out of training."""
    tasks = resolve_tasks(names)
    held_out = [task for task in tasks if task in SUITES["unseen"]]
    if held_out:
        raise ValueError(
            f"tasks {held_out} are held out of every training set (the unseen suite tells what gates learned "
            f"beyond their training formats); train on {', '.join(s for s in SUITES if s != 'unseen')}"
        )
    return tasks


@dataclass(frozen=True)
class TrainingData:
    """Token sequences (`[1, n]` each, `n <= seq_len`) in training order, and the record of where they came from.

    `answers`: per sequence, how many of its last tokens are a sample's gold answer (0 for a document's window;
    empty: none anywhere).
    """

    sequences: list[torch.Tensor]
    split: dict
    answers: list[int] = field(default_factory=list)

    def answer(self, index: int) -> int:
        """How many of sequence `index`'s last tokens are its gold answer."""
        return self.answers[index] if self.answers else 0


def essay_windows(tokenizer: PreTrainedTokenizerBase, names: list[str], seq_len: int) -> list[torch.Tensor]:
    """Non-overlapping `seq_len`-token windows of each named essay, each starting as the essay does (BOS kept)."""
    return document_windows(tokenizer, list(essay_texts(names).values()), seq_len)


def task_sequences(
    tokenizer: PreTrainedTokenizerBase, seq_len: int, per_task: int, tasks: str = TRAINING_TASKS
) -> list[tuple[torch.Tensor, int]]:
    """Context, question and gold answer of `per_task` training samples of every task in `tasks`, cut to `seq_len`
    tokens, each with its answer's length in tokens."""
    names = training_tasks(tasks)
    samples = task_samples(names, tokenizer, length=seq_len - 64, n=per_task, seed=TRAINING_TASK_SEED)
    sequences = []
    for sample in samples:
        encoded = encode(sample, tokenizer)
        ids = torch.cat([encoded.context_ids, encoded.question_ids, encoded.gold_ids], dim=1)
        sequences.append((ids[:, -seq_len:], encoded.gold_ids.shape[1]))
    return sequences


def _shuffled(pairs: list[tuple[torch.Tensor, int]], seed: int) -> tuple[list[torch.Tensor], list[int]]:
    """`(sequences, answer lengths)` of `pairs`, shuffled together by `seed`."""
    random.Random(seed).shuffle(pairs)
    return [ids for ids, _ in pairs], [answer for _, answer in pairs]


def training_data(
    tokenizer: PreTrainedTokenizerBase, seq_len: int, per_task: int, seed: int, tasks: str = TRAINING_TASKS
) -> TrainingData:
    """The training essays' windows and `per_task` samples of every task in `tasks`, shuffled by `seed`."""
    train, heldout = essay_split()
    windows = [(ids, 0) for ids in essay_windows(tokenizer, train, seq_len)]
    sequences, answers = _shuffled(windows + task_sequences(tokenizer, seq_len, per_task, tasks), seed)
    split = {
        "train_essays": train,
        "heldout_essays": heldout,
        "tasks": tasks,
        "task_seed": TRAINING_TASK_SEED,
        "task_samples_per_task": per_task,
        "sequences": len(sequences),
    }
    return TrainingData(sequences, split, answers)


def qa_sequence(tokenizer: PreTrainedTokenizerBase, record: QARecord, seq_len: int) -> tuple[torch.Tensor, int]:
    """A question-answer record as one sequence: context, question, answer (the last `seq_len` tokens), and the
    answer's length in tokens."""
    parts = [tokenizer(record.context, return_tensors="pt").input_ids]
    for text in (f"\n\n{record.question}\n", record.answer):
        parts.append(tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids)
    return torch.cat(parts, dim=1)[:, -seq_len:], parts[-1].shape[1]


def corpus_training_data(tokenizer: PreTrainedTokenizerBase, path: str | Path, seq_len: int, seed: int) -> TrainingData:
    """The training part of a user's corpus as sequences: `seq_len`-token windows of its documents (each must be that
    long) and its question-answer records, shuffled by `seed`; the split and the corpus hash are recorded."""
    corpus = read_corpus(path)
    train, heldout = corpus.split()
    sequences = []
    for name in train:
        if name in corpus.records:
            sequences.append(qa_sequence(tokenizer, corpus.records[name], seq_len))
            continue
        windows = [(ids, 0) for ids in document_windows(tokenizer, [corpus.documents[name]], seq_len)]
        if not windows:
            tokens = len(tokenizer(corpus.documents[name]).input_ids)
            raise CorpusError(
                f"{name}: {tokens} tokens, shorter than one training sequence of {seq_len}; "
                "lower --seq-len or join short documents"
            )
        sequences += windows
    if not sequences:
        raise CorpusError(f"--data {path} yields no training sequence (its {len(heldout)} item(s) are all held back)")
    sequences, answers = _shuffled(sequences, seed)
    split = {"source": str(path), "sha256": corpus.sha256, "train": train, "heldout": heldout}
    split |= {"documents": len(corpus.documents), "qa_records": len(corpus.records), "sequences": len(sequences)}
    return TrainingData(sequences, split, answers)
