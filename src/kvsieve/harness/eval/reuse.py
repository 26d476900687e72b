"""Compress once, ask many: one compression of a context answers several questions, each from its own copy.

A serving system that keeps a compressed document answers every later question about it from that
cache. Here a context and its questions (`harness.data.question_sets`) are encoded, the context is
prefilled once and compressed once per configuration, and every question is then answered from a
fork of the compressed cache (the gold answer teacher-forced, a greedy answer generated, as in a
sweep), so no answer sees another question and the compressed cache is never changed.

How a configuration was compressed (`COMPRESSED_WITH`): ``context`` is question-agnostic (before any
question is seen); ``first_question`` scores the context with the first question in view (SnapKV's
window on it, question-aware) and then drops the question's entries, so the later questions read a
cache chosen for another one: the misuse of keeping a question-aware compression.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ...runtime.storage.cache import SievedCache
from ...selection.budget import check_rate
from ..data.sample import EncodedSample, TaskSample, encode
from ..progress import ProgressCallback
from ..runners import Runner
from .contenders import parse_contenders
from .gate_records import gates_made_by
from .logged_cells import run_logged
from .methods import CacheMethod, Compressed, Configuration, build, passes
from .respond import Response, fork
from .results_log import ResultsLog
from .sweep import SWEEP_ROWS_PER_PASS, answer_row, prefill_needs, sample_case, split_prompt

#: How a configuration's cache was compressed: before any question, or with the first question in view.
COMPRESSED_WITH = ("context", "first_question")


def context_key(questions: Sequence[TaskSample]) -> str:
    """A short stable id of a question set's context (resuming matches rows by it)."""
    first = questions[0]
    digest = hashlib.sha1(f"{first.task}\0{first.context}".encode()).hexdigest()
    return f"{first.task}#{first.index}:{digest[:10]}"


def row_key(row: dict[str, Any]) -> tuple[str, int, str, str, float]:
    return row["context"], int(row["question"]), row["compressed_with"], row["policy"], float(row["rate"])


def answer_from_copy(model: torch.nn.Module, compressed: Compressed, encoded: EncodedSample) -> list[Response]:
    """Every row's answer to `encoded`'s question, from a copy of `compressed`'s cache (which is left as it is)."""
    _, prompt = split_prompt(encoded, "agnostic")
    copied = dataclasses.replace(compressed, cache=fork(compressed.cache))
    return copied.answer(model, prompt, encoded.gold_ids, encoded.sample.max_new_tokens, encoded.gold_content_index)


def without_question(compressed: Compressed, n_context: int) -> Compressed:
    """A question-aware compression with the question's entries dropped: only its context remains."""
    cache = compressed.cache
    if not isinstance(cache, SievedCache):
        raise ValueError("only kvsieve policies compress with the first question here (their cache can drop it)")
    cache.crop(n_context)
    return dataclasses.replace(compressed, kv_bytes=[cache.row_nbytes(row) for row in range(cache.batch_size)])


@dataclass(frozen=True)
class ReuseCell:
    """A context with its questions, and the configurations (method name, rate, compressed with) it still needs."""

    questions: tuple[TaskSample, ...]
    todo: tuple[tuple[str, float, str], ...]

    @property
    def size(self) -> int:
        return len(self.todo) * len(self.questions)


@dataclass(frozen=True)
class ReuseWork:
    """One cell: compress the context once per configuration, answer every question from a copy; a row each."""

    methods: dict[str, CacheMethod]
    chat: bool | None
    rows_per_pass: int

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module, tokenizer: Any, cell: ReuseCell) -> list[dict[str, Any]]:
        encoded = [encode(q, tokenizer, self.chat).to(model.device) for q in cell.questions]
        if any(not torch.equal(e.context_ids, encoded[0].context_ids) for e in encoded):
            raise ValueError(f"{context_key(cell.questions)}: the questions of a set must share one context")
        rows = []
        for compressed_with in COMPRESSED_WITH:
            todo = [(self.methods[name], rate) for name, rate, how in cell.todo if how == compressed_with]
            if todo:
                rows += self._answer_all(model, tokenizer, encoded, compressed_with, todo)
        head = {"context": context_key(cell.questions), "task": cell.questions[0].task}
        return [head | {"context_tokens": encoded[0].context_length} | row for row in rows]

    def _answer_all(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        encoded: list[EncodedSample],
        compressed_with: str,
        todo: list[Configuration],
    ) -> list[dict[str, Any]]:
        mode = "agnostic" if compressed_with == "context" else "aware"
        needs = prefill_needs([method for method, _ in todo], diagnostics=False)
        case = sample_case(encoded[0], mode, needs, tokenizer)
        rows = []
        for batch in passes(todo, self.rows_per_pass):
            compressed = build(model, case, batch)
            if mode == "aware":
                compressed = without_question(compressed, case.n_context)
            for index, question in enumerate(encoded):
                responses = answer_from_copy(model, compressed, question)
                for (method, rate), response, kv_bytes in zip(batch, responses, compressed.kv_bytes, strict=True):
                    row = {"question": index, "compressed_with": compressed_with}
                    row |= {"library": method.library, "policy": method.name}
                    row |= {"rate": rate, "kv_bytes": int(kv_bytes), **answer_row(question, response, tokenizer)}
                    rows.append(row)
        return rows


def run_reuse(
    runner: Runner,
    question_sets: Sequence[Sequence[TaskSample]],
    policies: str | Sequence[str],
    rates: Sequence[float],
    *,
    first_question: str | Sequence[str] = (),
    results: str | Path | None = None,
    chat: bool | None = None,
    rows_per_pass: int = SWEEP_ROWS_PER_PASS,
    progress: ProgressCallback | None = None,
) -> pd.DataFrame:
    """Every (contender, rate) compresses each context once and answers each of its questions; one row each.

    Args:
        question_sets: contexts with their questions (`harness.data.question_sets`).
        policies: compressed with the context alone; kvsieve policy specs and ``kvpress:<press>`` names
            (the full cache is always included).
        first_question: kvsieve policies compressed with the first question in view, whose entries are then
            dropped (see the module doc).
        results: a JSONL file; rows it holds are not run again, new rows are appended.

    Returns:
        Every row (old and new) as a DataFrame: context, question, compressed_with, policy, rate, the answer.
    """
    agnostic = parse_contenders(list(policies) if not isinstance(policies, str) else policies)
    aware = [m for m in parse_contenders(first_question) if not m.is_full] if first_question else []
    if any(method.library != "kvsieve" for method in aware):
        raise ValueError("first_question takes kvsieve policies only (their cache can drop the question)")
    rates = [check_rate(r) for r in rates]
    grid = [(m.name, 0.0 if m.is_full else r, "context") for m in agnostic for r in ([0.0] if m.is_full else rates)]
    grid += [(m.name, r, "first_question") for m in aware for r in rates]
    methods = {m.name: m for m in [*agnostic, *aware]}
    log = ResultsLog(results, row_key, gates_made_by(runner, methods))
    cells = []
    for questions in question_sets:
        key = context_key(questions)
        todo = tuple(c for c in grid if (key, 0, c[2], c[0], c[1]) not in log)  # a cell's rows are logged together
        if todo:
            cells.append(ReuseCell(tuple(questions), todo))
    total = len(grid) * sum(len(q) for q in question_sets)
    run_logged(runner, ReuseWork(methods, chat, rows_per_pass), cells, log, total, progress)
    return pd.DataFrame(log.rows)
